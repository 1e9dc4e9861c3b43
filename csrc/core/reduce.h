// Plain C++17 reductions over raw buffers. No Python or TensorFlow headers:
// csrc/bindings and csrc/tf_ops call these with pointers and lengths.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsgd {

// out[k] = (inputs[0][k] + inputs[1][k] + ... + inputs[n-1][k]) * scale
//
// The sum runs left to right over the inputs, in the element type, and is
// scaled once at the end, so the result is bit-identical to numpy's
// `functools.reduce(np.add, inputs) * scale` for the same type. `out` may
// alias inputs[0]. Work is split over up to `max_threads` threads in blocks
// of at least kMinElementsPerThread elements; max_threads <= 0 means
// hardware_concurrency(). A thread's range of 1 MiB or more is computed in one
// pass and written with streaming (non-temporal) stores; a smaller one in
// cache-sized blocks. Blocks until done.
template <typename T>
void SumScaled(const T* const* inputs, std::size_t num_inputs, std::size_t length,
               T scale, T* out, int max_threads);

// The same for 16-bit inputs and output (binary16 if `bfloat16` is false, else
// bfloat16; passed as their bits): every input widened to float32, summed left
// to right in float32, scaled once, rounded to nearest even. Bit-identical to
// numpy's `(a.astype(f32) + b.astype(f32) + ...) * f32(scale)` then `.astype`
// to the 16-bit type. `out` may alias inputs[0]. Blocks until done.
void SumScaled16(const std::uint16_t* const* inputs, std::size_t num_inputs, std::size_t length,
                 float scale, std::uint16_t* out, bool bfloat16, int max_threads);

// Threads are only worth starting for large buffers.
constexpr std::size_t kMinElementsPerThread = 1 << 18;

}  // namespace dsgd
