// pybind11 bindings over csrc/core for the PS actors. Only converts buffers to
// pointers; the math lives in core.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "core/reduce.h"

namespace py = pybind11;

namespace {

template <typename T>
void SumScaledInto(const std::vector<py::array>& inputs, py::array& out, double scale,
                   int max_threads) {
  // Read-only inputs (object-store views) are fine: we only read them.
  std::vector<const T*> pointers;
  pointers.reserve(inputs.size());
  for (const auto& a : inputs) pointers.push_back(static_cast<const T*>(a.data()));
  T* out_ptr = static_cast<T*>(out.mutable_data());
  std::size_t length = static_cast<std::size_t>(out.size());
  py::gil_scoped_release release;
  dsgd::SumScaled<T>(pointers.data(), pointers.size(), length, static_cast<T>(scale), out_ptr,
                     max_threads);
}

void SumScaled(const std::vector<py::array>& inputs, py::array out, double scale,
               int max_threads) {
  if (inputs.empty()) throw py::value_error("sum_scaled: `inputs` is empty; pass at least one array");
  if (!out.writeable()) throw py::value_error("sum_scaled: `out` is read-only");
  auto check = [&](const py::array& a, const std::string& what) {
    if (!(a.flags() & py::array::c_style))
      throw py::value_error("sum_scaled: " + what + " is not C-contiguous");
    if (a.dtype().num() != out.dtype().num())
      throw py::type_error("sum_scaled: " + what + " has dtype " +
                           std::string(py::str(a.dtype())) + " but `out` has dtype " +
                           std::string(py::str(out.dtype())));
    if (a.size() != out.size())
      throw py::value_error("sum_scaled: " + what + " has " + std::to_string(a.size()) +
                            " elements but `out` has " + std::to_string(out.size()));
  };
  check(out, "`out`");
  for (std::size_t i = 0; i < inputs.size(); ++i) check(inputs[i], "inputs[" + std::to_string(i) + "]");
  if (out.dtype().num() == py::dtype::of<float>().num()) {
    SumScaledInto<float>(inputs, out, scale, max_threads);
  } else if (out.dtype().num() == py::dtype::of<double>().num()) {
    SumScaledInto<double>(inputs, out, scale, max_threads);
  } else {
    throw py::type_error("sum_scaled: dtype " + std::string(py::str(out.dtype())) +
                         " is not supported; use float32 or float64");
  }
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "dsgd native kernels (csrc/core) for parameter-server actors.";
  m.def("sum_scaled", &SumScaled, py::arg("inputs"), py::arg("out"), py::arg("scale"),
        py::arg("max_threads") = 0,
        R"doc(out[:] = (inputs[0] + inputs[1] + ... ) * scale, summed left to right.

Blocks until done and releases the GIL meanwhile. Inputs may be read-only
(object-store views); they are only read and not retained. `out` must be a
writable, C-contiguous array of the same dtype (float32 or float64) and size;
it may be inputs[0] only if that is writable. max_threads <= 0 uses every core.)doc");
  m.attr("MIN_ELEMENTS_PER_THREAD") = dsgd::kMinElementsPerThread;
}
