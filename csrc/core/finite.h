// Is every element of a floating-point buffer finite? Plain C++17 on pointers
// and lengths; no Python or TensorFlow headers.
#pragma once

#include <cstddef>

namespace dsgd {

// The IEEE 754 formats the check understands: binary16, bfloat16, binary32,
// binary64. Their exponent masks are what tell Inf/NaN (all exponent bits set).
enum class FloatFormat { kF16, kBF16, kF32, kF64 };

// Bytes per element of `format`.
std::size_t FormatBytes(FloatFormat format);

// True iff none of the `n` elements at `data` is +-Inf or NaN. One read of the
// buffer, vectorised (the exponent bits of a block are max-reduced; no
// per-element branch), stopping at the first block that holds a non-finite
// element. Single-threaded: callers split large buffers themselves.
bool AllFinite(const void* data, std::size_t n, FloatFormat format);

// Elements per block: the granularity of the early exit and of callers' splits.
constexpr std::size_t kFiniteBlockElements = std::size_t{1} << 14;

}  // namespace dsgd
