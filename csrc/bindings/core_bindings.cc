// pybind11 bindings over csrc/core for the PS actors. Only converts buffers to
// pointers; the math lives in core.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "core/copy.h"
#include "core/finite.h"
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

void SumScaled16(const std::vector<py::array>& inputs, py::array out, double scale,
                 const std::string& format, int max_threads) {
  if (format != "f16" && format != "bf16")
    throw py::value_error("sum_scaled_16: format must be f16 or bf16; got " + format);
  if (inputs.empty())
    throw py::value_error("sum_scaled_16: `inputs` is empty; pass at least one array");
  if (!out.writeable()) throw py::value_error("sum_scaled_16: `out` is read-only");
  auto check = [&](const py::array& a, const std::string& what) {
    if (!(a.flags() & py::array::c_style))
      throw py::value_error("sum_scaled_16: " + what + " is not C-contiguous");
    if (a.itemsize() != 2)
      throw py::type_error("sum_scaled_16: " + what + " has " + std::to_string(a.itemsize()) +
                           "-byte elements; pass float16 or uint16 (bfloat16 bits)");
    if (a.size() != out.size())
      throw py::value_error("sum_scaled_16: " + what + " has " + std::to_string(a.size()) +
                            " elements but `out` has " + std::to_string(out.size()));
  };
  check(out, "`out`");
  for (std::size_t i = 0; i < inputs.size(); ++i) check(inputs[i], "inputs[" + std::to_string(i) + "]");
  std::vector<const std::uint16_t*> pointers;
  for (const auto& a : inputs) pointers.push_back(static_cast<const std::uint16_t*>(a.data()));
  auto* out_ptr = static_cast<std::uint16_t*>(out.mutable_data());
  const std::size_t length = static_cast<std::size_t>(out.size());
  const bool bfloat16 = format == "bf16";
  py::gil_scoped_release release;
  dsgd::SumScaled16(pointers.data(), pointers.size(), length, static_cast<float>(scale), out_ptr,
                    bfloat16, max_threads);
}

void CheckContiguous(const py::array& a, const std::string& what) {
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(what + " is not C-contiguous");
}

void CheckWritable(const py::array& a, const std::string& what) {
  CheckContiguous(a, what);
  if (!a.writeable()) throw py::value_error(what + " is read-only");
}

void Fuse(const std::vector<py::array>& inputs, py::array out, int max_threads) {
  if (inputs.empty()) throw py::value_error("fuse: `inputs` is empty");
  CheckWritable(out, "fuse: `out`");
  std::vector<const void*> srcs;
  std::vector<std::size_t> bytes;
  std::size_t total = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    CheckContiguous(inputs[i], "fuse: inputs[" + std::to_string(i) + "]");
    srcs.push_back(inputs[i].data());
    bytes.push_back(static_cast<std::size_t>(inputs[i].nbytes()));
    total += bytes.back();
  }
  if (total != static_cast<std::size_t>(out.nbytes()))
    throw py::value_error("fuse: inputs hold " + std::to_string(total) + " bytes but `out` has " +
                          std::to_string(out.nbytes()));
  void* dst = out.mutable_data();
  py::gil_scoped_release release;
  dsgd::Fuse(srcs.data(), bytes.data(), srcs.size(), dst, max_threads);
}

void Split(const py::array& input, std::vector<py::array> outs, int max_threads) {
  if (outs.empty()) throw py::value_error("split: `outs` is empty");
  CheckContiguous(input, "split: `input`");
  std::vector<void*> dsts;
  std::vector<std::size_t> bytes;
  std::size_t total = 0;
  for (std::size_t i = 0; i < outs.size(); ++i) {
    CheckWritable(outs[i], "split: outs[" + std::to_string(i) + "]");
    dsts.push_back(outs[i].mutable_data());
    bytes.push_back(static_cast<std::size_t>(outs[i].nbytes()));
    total += bytes.back();
  }
  if (total != static_cast<std::size_t>(input.nbytes()))
    throw py::value_error("split: outs hold " + std::to_string(total) + " bytes but `input` has " +
                          std::to_string(input.nbytes()));
  const void* src = input.data();
  py::gil_scoped_release release;
  dsgd::Split(src, dsts.data(), bytes.data(), dsts.size(), max_threads);
}

template <typename In, typename Out>
void Cast(const py::array& input, py::array out, const char* name,
          void (*kernel)(const In*, Out*, std::size_t)) {
  CheckContiguous(input, std::string(name) + ": `input`");
  CheckWritable(out, std::string(name) + ": `out`");
  if (input.itemsize() != sizeof(In) || out.itemsize() != sizeof(Out) || input.size() != out.size())
    throw py::value_error(std::string(name) + ": expected " + std::to_string(sizeof(In)) + "-byte input and " +
                          std::to_string(sizeof(Out)) + "-byte output of the same length");
  const In* src = static_cast<const In*>(input.data());
  Out* dst = static_cast<Out*>(out.mutable_data());
  std::size_t n = static_cast<std::size_t>(input.size());
  py::gil_scoped_release release;
  kernel(src, dst, n);
}

bool AllFinite(const py::array& input, const std::string& format) {
  static const std::pair<const char*, dsgd::FloatFormat> kFormats[] = {
      {"f16", dsgd::FloatFormat::kF16}, {"bf16", dsgd::FloatFormat::kBF16},
      {"f32", dsgd::FloatFormat::kF32}, {"f64", dsgd::FloatFormat::kF64}};
  for (const auto& [name, f] : kFormats) {
    if (format != name) continue;
    CheckContiguous(input, "all_finite: `input`");
    if (static_cast<std::size_t>(input.itemsize()) != dsgd::FormatBytes(f))
      throw py::value_error("all_finite: format " + format + " needs " +
                            std::to_string(dsgd::FormatBytes(f)) + "-byte elements, `input` has " +
                            std::to_string(input.itemsize()));
    const void* data = input.data();
    std::size_t n = static_cast<std::size_t>(input.size());
    py::gil_scoped_release release;
    return dsgd::AllFinite(data, n, f);
  }
  throw py::value_error("all_finite: format must be one of f16, bf16, f32, f64; got " + format);
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
  m.attr("MIN_BYTES_PER_THREAD") = dsgd::kMinBytesPerThread;
  m.def("fuse", &Fuse, py::arg("inputs"), py::arg("out"), py::arg("max_threads") = 0,
        "out's bytes = inputs' bytes, concatenated in order. Blocks; releases the GIL.");
  m.def("split", &Split, py::arg("input"), py::arg("outs"), py::arg("max_threads") = 0,
        "Each of outs gets the next out.nbytes bytes of input. Blocks; releases the GIL.");
  m.def("cast_f32_to_f16", [](const py::array& input, py::array out) {
          Cast<float, std::uint16_t>(input, out, "cast_f32_to_f16", dsgd::CastF32ToF16);
        }, py::arg("input"), py::arg("out"),
        "float32 -> float16 (out: float16 or uint16), round-to-nearest-even like numpy.");
  m.def("cast_f16_to_f32", [](const py::array& input, py::array out) {
          Cast<std::uint16_t, float>(input, out, "cast_f16_to_f32", dsgd::CastF16ToF32);
        }, py::arg("input"), py::arg("out"), "float16 (or uint16 bits) -> float32, exact (signalling NaNs may come back quiet).");
  m.def("cast_f32_to_bf16", [](const py::array& input, py::array out) {
          Cast<float, std::uint16_t>(input, out, "cast_f32_to_bf16", dsgd::CastF32ToBF16);
        }, py::arg("input"), py::arg("out"),
        "float32 -> bfloat16 bits (out: uint16), round-to-nearest-even like ml_dtypes.");
  m.def("cast_bf16_to_f32", [](const py::array& input, py::array out) {
          Cast<std::uint16_t, float>(input, out, "cast_bf16_to_f32", dsgd::CastBF16ToF32);
        }, py::arg("input"), py::arg("out"), "bfloat16 bits (uint16) -> float32, exact.");
  m.def("sum_scaled_16", &SumScaled16, py::arg("inputs"), py::arg("out"), py::arg("scale"),
        py::arg("format"), py::arg("max_threads") = 0,
        R"doc(out[:] = 16-bit((f32(inputs[0]) + f32(inputs[1]) + ...) * f32(scale)).

For gradient compression: inputs and `out` hold 16-bit values (format "f16":
float16 arrays or their uint16 bits; "bf16": bfloat16 bits as uint16), widened
and summed left to right in float32, scaled once and rounded to nearest even.
Blocks until done and releases the GIL. Inputs may be read-only; `out` must be
writable and C-contiguous, of the same size. max_threads <= 0 uses every core.)doc");
  m.def("all_finite", &AllFinite, py::arg("input"), py::arg("format"),
        "True iff no element of `input` (C-contiguous; its bits read as `format`: f16, bf16, "
        "f32 or f64) is Inf or NaN. One single-threaded read; releases the GIL.");
}
