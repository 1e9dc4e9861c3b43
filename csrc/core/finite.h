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
// buffer, vectorised (a compare-and-or over each block's exponent bits; no
// per-element branch), stopping after the first block (16 K elements) that holds
// a non-finite element. Single-threaded; blocks until done.
bool AllFinite(const void* data, std::size_t n, FloatFormat format);

}  // namespace dsgd
