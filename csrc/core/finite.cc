#include "core/finite.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace dsgd {
namespace {

// Elements per block: the granularity of the early exit.
constexpr std::size_t kFiniteBlockElements = std::size_t{1} << 14;

// Bits of one element as an unsigned integer U, and the exponent mask: an element
// is non-finite iff (bits & mask) == mask. `stride` and `first` pick the words
// that hold the exponent (binary64 is checked on its high 32-bit words). The
// compare-and-or loop vectorises with plain SSE2 (no max of unsigned lanes).
template <typename U>
bool AllFiniteBits(const unsigned char* data, std::size_t n, U mask, std::size_t stride = 1,
                   std::size_t first = 0) {
  for (std::size_t start = 0; start < n; start += kFiniteBlockElements) {
    const std::size_t end = std::min(n, start + kFiniteBlockElements);
    U found = 0;
    for (std::size_t i = start; i < end; ++i) {
      U bits;
      std::memcpy(&bits, data + (i * stride + first) * sizeof(U), sizeof(U));  // any alignment
      found |= static_cast<U>((bits & mask) == mask);
    }
    if (found) return false;
  }
  return true;
}

}  // namespace

std::size_t FormatBytes(FloatFormat format) {
  switch (format) {
    case FloatFormat::kF16:
    case FloatFormat::kBF16:
      return 2;
    case FloatFormat::kF32:
      return 4;
    case FloatFormat::kF64:
      return 8;
  }
  return 0;
}

bool AllFinite(const void* data, std::size_t n, FloatFormat format) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  switch (format) {
    case FloatFormat::kF16:
      return AllFiniteBits<std::uint16_t>(bytes, n, 0x7c00u);
    case FloatFormat::kBF16:
      return AllFiniteBits<std::uint16_t>(bytes, n, 0x7f80u);
    case FloatFormat::kF32:
      return AllFiniteBits<std::uint32_t>(bytes, n, 0x7f800000u);
    case FloatFormat::kF64:
      static_assert(sizeof(double) == 8, "binary64");
      // Little-endian: the sign and exponent live in the second 32-bit word.
      return AllFiniteBits<std::uint32_t>(bytes, n, 0x7ff00000u, 2, 1);
  }
  return false;
}

}  // namespace dsgd
