#include "core/copy.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DSGD_X86 1
#endif

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace dsgd {

void CopySpans(const Span* spans, std::size_t num_spans, int max_threads) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < num_spans; ++i) total += spans[i].bytes;
  std::size_t threads = max_threads > 0 ? static_cast<std::size_t>(max_threads)
                                        : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, std::max<std::size_t>(1, total / kMinBytesPerThread));
  if (threads <= 1) {
    for (std::size_t i = 0; i < num_spans; ++i)
      if (spans[i].bytes) std::memcpy(spans[i].dst, spans[i].src, spans[i].bytes);
    return;
  }
  // Cut the concatenation of all spans into `threads` equal byte ranges (64-byte
  // multiples), so one huge span and many small ones balance alike.
  const std::size_t share = ((total + threads - 1) / threads + 63) / 64 * 64;
  auto run = [&](std::size_t begin, std::size_t end) {
    std::size_t offset = 0;
    for (std::size_t i = 0; i < num_spans && offset < end; ++i) {
      const std::size_t a = std::max(begin, offset), b = std::min(end, offset + spans[i].bytes);
      if (a < b)
        std::memcpy(static_cast<char*>(spans[i].dst) + (a - offset),
                    static_cast<const char*>(spans[i].src) + (a - offset), b - a);
      offset += spans[i].bytes;
    }
  };
  std::vector<std::thread> pool;
  for (std::size_t begin = share; begin < total; begin += share)
    pool.emplace_back(run, begin, std::min(total, begin + share));
  run(0, std::min(total, share));
  for (auto& t : pool) t.join();
}

void Fuse(const void* const* srcs, const std::size_t* bytes, std::size_t n, void* dst,
          int max_threads) {
  std::vector<Span> spans(n);
  char* out = static_cast<char*>(dst);
  for (std::size_t i = 0; i < n; ++i) {
    spans[i] = {srcs[i], out, bytes[i]};
    out += bytes[i];
  }
  CopySpans(spans.data(), n, max_threads);
}

void Split(const void* src, void* const* dsts, const std::size_t* bytes, std::size_t n,
           int max_threads) {
  std::vector<Span> spans(n);
  const char* in = static_cast<const char*>(src);
  for (std::size_t i = 0; i < n; ++i) {
    spans[i] = {in, dsts[i], bytes[i]};
    in += bytes[i];
  }
  CopySpans(spans.data(), n, max_threads);
}

namespace {

std::uint32_t Bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::uint16_t ToHalf(float value) {
  const std::uint32_t x = Bits(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)  // inf or NaN (keep NaN quiet and non-zero)
    return sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u | ((abs >> 13) & 0x3ffu) : 0u);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {                        // below 2^-14: subnormal half or zero
    // Scale so that the half's subnormal unit (2^-24) becomes 1, then round to
    // nearest even in float arithmetic (exact: the magic-number trick).
    const float scaled = FromBits(abs) + FromBits(0x3f000000u);  // + 0.5
    return sign | static_cast<std::uint16_t>(Bits(scaled) - 0x3f000000u);
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits to even.
  const std::uint32_t rounded = abs + 0x0fffu + ((abs >> 13) & 1u);
  return sign | static_cast<std::uint16_t>((rounded - 0x38000000u) >> 13);
}

float FromHalf(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return FromBits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * FromBits(0x33800000u);
    return FromBits(sign | Bits(magnitude));
  }
  return FromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

std::uint16_t ToBFloat16(float value) {
  const std::uint32_t x = Bits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u)  // NaN: truncate, keep it quiet (never rounds to inf)
    return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  // Round the 16 dropped bits to nearest even; a carry into the exponent is correct
  // (it rounds up to the next binade, or to inf past the largest bfloat16).
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

float FromBFloat16(std::uint16_t b) { return FromBits(static_cast<std::uint32_t>(b) << 16); }

#ifdef DSGD_X86
// F16C (with AVX: Ivy Bridge and later, every x86-64 CPU TensorFlow's wheels run on):
// 8 conversions per instruction, IEEE round-to-nearest-even with subnormals, as the
// scalar code above. Chosen at run time, so the library still runs without it.
__attribute__((target("avx,f16c"))) void CastF32ToF16Vector(const float* src, std::uint16_t* dst,
                                                          std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = ToHalf(src[i]);
}

__attribute__((target("avx,f16c"))) void CastF16ToF32Vector(const std::uint16_t* src, float* dst,
                                                          std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = FromHalf(src[i]);
}

bool HasF16C() {
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

}  // namespace

void CastF32ToBF16(const float* src, std::uint16_t* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = ToBFloat16(src[i]);
}

void CastBF16ToF32(const std::uint16_t* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = FromBFloat16(src[i]);
}

void WidenToF32(const std::uint16_t* src, float* dst, std::size_t n, bool bfloat16,
                int max_threads) {
  auto run = [=](std::size_t begin, std::size_t end) {
    if (bfloat16)
      CastBF16ToF32(src + begin, dst + begin, end - begin);
    else
      CastF16ToF32(src + begin, dst + begin, end - begin);
  };
  std::size_t threads = max_threads > 0 ? static_cast<std::size_t>(max_threads)
                                        : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, std::max<std::size_t>(1, n * sizeof(float) / kMinBytesPerThread));
  if (threads <= 1) {
    run(0, n);
    return;
  }
  const std::size_t share = ((n + threads - 1) / threads + 15) / 16 * 16;  // whole cache lines
  std::vector<std::thread> pool;
  for (std::size_t begin = share; begin < n; begin += share)
    pool.emplace_back(run, begin, std::min(n, begin + share));
  run(0, std::min(n, share));
  for (auto& t : pool) t.join();
}

void CastF32ToF16(const float* src, std::uint16_t* dst, std::size_t n) {
#ifdef DSGD_X86
  if (HasF16C()) return CastF32ToF16Vector(src, dst, n);
#endif
  for (std::size_t i = 0; i < n; ++i) dst[i] = ToHalf(src[i]);
}

void CastF16ToF32(const std::uint16_t* src, float* dst, std::size_t n) {
#ifdef DSGD_X86
  if (HasF16C()) return CastF16ToF32Vector(src, dst, n);
#endif
  for (std::size_t i = 0; i < n; ++i) dst[i] = FromHalf(src[i]);
}

}  // namespace dsgd
