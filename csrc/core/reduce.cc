#include "core/reduce.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace dsgd {
namespace {

template <typename T>
void SumScaledRange(const T* const* inputs, std::size_t num_inputs, std::size_t begin,
                    std::size_t end, T scale, T* out) {
  // Two inputs at a time keeps the loop a single vectorisable pass per pair
  // while preserving the left-to-right summation order.
  const T* first = inputs[0];
  if (num_inputs == 1) {
    for (std::size_t k = begin; k < end; ++k) out[k] = first[k] * scale;
    return;
  }
  const T* second = inputs[1];
  for (std::size_t k = begin; k < end; ++k) out[k] = first[k] + second[k];
  for (std::size_t i = 2; i < num_inputs; ++i) {
    const T* in = inputs[i];
    for (std::size_t k = begin; k < end; ++k) out[k] += in[k];
  }
  for (std::size_t k = begin; k < end; ++k) out[k] *= scale;
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

template void SumScaled<float>(const float* const*, std::size_t, std::size_t, float, float*, int);
template void SumScaled<double>(const double* const*, std::size_t, std::size_t, double, double*,
                                int);

}  // namespace dsgd
