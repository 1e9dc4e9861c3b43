#include "core/reduce.h"

#include "core/copy.h"

#include <emmintrin.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace dsgd {
namespace {

// Elements per block: every pass over a block runs while it is still in L1/L2
// (8-16 KB per array), so `out` goes to memory once instead of once per pass.
constexpr std::size_t kBlockElements = 2048;
// From this size on, the result is written with non-temporal (streaming) stores:
// it is far larger than the caches and read later by another process, so
// fetching its old contents into the cache before overwriting them (what a
// normal store does) only costs memory bandwidth.
constexpr std::size_t kStreamMinBytes = 1 << 20;

template <typename T>
void SumScaledBlocked(const T* const* inputs, std::size_t num_inputs, std::size_t begin,
                      std::size_t end, T scale, T* out) {
  // Two inputs at a time keeps each pass vectorisable while preserving the
  // left-to-right summation order (bit-exact with numpy's (a + b + c) * scale).
  const T* first = inputs[0];
  for (std::size_t b = begin; b < end; b += kBlockElements) {
    const std::size_t e = std::min(end, b + kBlockElements);
    if (num_inputs == 1) {
      for (std::size_t k = b; k < e; ++k) out[k] = first[k] * scale;
      continue;
    }
    const T* second = inputs[1];
    for (std::size_t k = b; k < e; ++k) out[k] = first[k] + second[k];
    for (std::size_t i = 2; i < num_inputs; ++i) {
      const T* in = inputs[i];
      for (std::size_t k = b; k < e; ++k) out[k] += in[k];
    }
    for (std::size_t k = b; k < e; ++k) out[k] *= scale;
  }
}

// SSE2 vectors of float and double: load (unaligned), add, multiply, stream.
inline __m128 Load(const float* p) { return _mm_loadu_ps(p); }
inline __m128d Load(const double* p) { return _mm_loadu_pd(p); }
inline __m128 Add(__m128 a, __m128 b) { return _mm_add_ps(a, b); }
inline __m128d Add(__m128d a, __m128d b) { return _mm_add_pd(a, b); }
inline __m128 Mul(__m128 a, __m128 b) { return _mm_mul_ps(a, b); }
inline __m128d Mul(__m128d a, __m128d b) { return _mm_mul_pd(a, b); }
inline __m128 Splat(float x) { return _mm_set1_ps(x); }
inline __m128d Splat(double x) { return _mm_set1_pd(x); }
inline void Stream(float* p, __m128 v) { _mm_stream_ps(p, v); }
inline void Stream(double* p, __m128d v) { _mm_stream_pd(p, v); }

// One pass: each element summed left to right in a register, scaled, and
// streamed to `out` (the same operations in the same order as SumScaledBlocked,
// so the result is bit-identical).
template <typename T>
void SumScaledStreaming(const T* const* inputs, std::size_t num_inputs, std::size_t begin,
                        std::size_t end, T scale, T* out) {
  constexpr std::size_t kLanes = 16 / sizeof(T);
  std::size_t k = begin;
  auto scalar = [&](std::size_t k) {
    T sum = inputs[0][k];
    for (std::size_t i = 1; i < num_inputs; ++i) sum += inputs[i][k];
    out[k] = num_inputs == 1 ? inputs[0][k] * scale : sum * scale;
  };
  for (; k < end && reinterpret_cast<std::uintptr_t>(out + k) % 16 != 0; ++k) scalar(k);
  const auto factor = Splat(scale);
  for (; k + kLanes <= end; k += kLanes) {
    auto sum = Load(inputs[0] + k);
    for (std::size_t i = 1; i < num_inputs; ++i) sum = Add(sum, Load(inputs[i] + k));
    Stream(out + k, Mul(sum, factor));
  }
  for (; k < end; ++k) scalar(k);
  _mm_sfence();  // streaming stores are visible to other threads after this
}

template <typename T>
void SumScaledRange(const T* const* inputs, std::size_t num_inputs, std::size_t begin,
                    std::size_t end, T scale, T* out) {
  if ((end - begin) * sizeof(T) >= kStreamMinBytes)
    SumScaledStreaming(inputs, num_inputs, begin, end, scale, out);
  else
    SumScaledBlocked(inputs, num_inputs, begin, end, scale, out);
}

}  // namespace

template <typename T>
void SumScaled(const T* const* inputs, std::size_t num_inputs, std::size_t length,
               T scale, T* out, int max_threads) {
  if (num_inputs == 0 || length == 0) return;
  std::size_t threads = max_threads > 0 ? static_cast<std::size_t>(max_threads)
                                        : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, std::max<std::size_t>(1, length / kMinElementsPerThread));
  if (threads <= 1) {
    SumScaledRange(inputs, num_inputs, 0, length, scale, out);
    return;
  }
  // Blocks are multiples of 16 elements so no two threads share a cache line.
  std::size_t block = ((length + threads - 1) / threads + 15) / 16 * 16;
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (std::size_t begin = 0; begin < length; begin += block) {
    std::size_t end = std::min(length, begin + block);
    pool.emplace_back(SumScaledRange<T>, inputs, num_inputs, begin, end, scale, out);
  }
  for (auto& t : pool) t.join();
}

namespace {

void SumScaled16Range(const std::uint16_t* const* inputs, std::size_t num_inputs,
                      std::size_t begin, std::size_t end, float scale, std::uint16_t* out,
                      bool bfloat16) {
  auto widen = bfloat16 ? CastBF16ToF32 : CastF16ToF32;
  auto narrow = bfloat16 ? CastF32ToBF16 : CastF32ToF16;
  float sum[kBlockElements], next[kBlockElements];  // stay in L1 across the passes
  for (std::size_t b = begin; b < end; b += kBlockElements) {
    const std::size_t n = std::min(end, b + kBlockElements) - b;
    widen(inputs[0] + b, sum, n);
    for (std::size_t i = 1; i < num_inputs; ++i) {
      widen(inputs[i] + b, next, n);
      for (std::size_t k = 0; k < n; ++k) sum[k] += next[k];
    }
    for (std::size_t k = 0; k < n; ++k) sum[k] *= scale;
    narrow(sum, out + b, n);
  }
}

}  // namespace

void SumScaled16(const std::uint16_t* const* inputs, std::size_t num_inputs, std::size_t length,
                 float scale, std::uint16_t* out, bool bfloat16, int max_threads) {
  if (num_inputs == 0 || length == 0) return;
  std::size_t threads = max_threads > 0 ? static_cast<std::size_t>(max_threads)
                                        : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, std::max<std::size_t>(1, length / kMinElementsPerThread));
  if (threads <= 1) {
    SumScaled16Range(inputs, num_inputs, 0, length, scale, out, bfloat16);
    return;
  }
  std::size_t block = ((length + threads - 1) / threads + 31) / 32 * 32;  // whole cache lines
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (std::size_t begin = 0; begin < length; begin += block)
    pool.emplace_back(SumScaled16Range, inputs, num_inputs, begin, std::min(length, begin + block),
                      scale, out, bfloat16);
  for (auto& t : pool) t.join();
}

template void SumScaled<float>(const float* const*, std::size_t, std::size_t, float, float*, int);
template void SumScaled<double>(const double* const*, std::size_t, std::size_t, double, double*,
                                int);

}  // namespace dsgd
