// Fuse many buffers into one, split one into many, and fp32 <-> fp16/bf16 casts.
// Plain C++17 on pointers and lengths; no Python or TensorFlow headers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsgd {

// One contiguous copy of `bytes` bytes from `src` to `dst` (non-overlapping).
struct Span {
  const void* src;
  void* dst;
  std::size_t bytes;
};

// Copies every span. Large copies are cut into blocks spread over up to
// `max_threads` threads (<= 0: hardware_concurrency()); small ones run inline.
// Blocks until done.
void CopySpans(const Span* spans, std::size_t num_spans, int max_threads);

// dst = srcs[0] ++ srcs[1] ++ ... (byte sizes in `bytes`).
void Fuse(const void* const* srcs, const std::size_t* bytes, std::size_t n, void* dst,
          int max_threads);

// dsts[i] = the next bytes[i] bytes of src.
void Split(const void* src, void* const* dsts, const std::size_t* bytes, std::size_t n,
           int max_threads);

// IEEE 754 binary16 <-> binary32, round-to-nearest-even, with subnormals,
// infinities and NaN (as numpy's astype does, except that where the CPU has F16C
// signalling NaNs come out quiet).
void CastF32ToF16(const float* src, std::uint16_t* dst, std::size_t n);
void CastF16ToF32(const std::uint16_t* src, float* dst, std::size_t n);

// bfloat16 (the upper 16 bits of a binary32) <-> binary32: round-to-nearest-even,
// NaN kept NaN (quiet), as TensorFlow's and ml_dtypes' bfloat16 do.
void CastF32ToBF16(const float* src, std::uint16_t* dst, std::size_t n);
void CastBF16ToF32(const std::uint16_t* src, float* dst, std::size_t n);

// Widens `n` 16-bit values (binary16 if `bfloat16` is false, else bfloat16) to
// float32, exactly (NaN stays NaN; the F16C path returns signalling NaNs quieted). Large buffers are split over up to `max_threads` threads
// (<= 0: hardware_concurrency()). Blocks until done.
void WidenToF32(const std::uint16_t* src, float* dst, std::size_t n, bool bfloat16,
                int max_threads);

// Bytes below which a copy is not worth a thread.
constexpr std::size_t kMinBytesPerThread = std::size_t{1} << 20;

}  // namespace dsgd
