// DsgdAllFinite: one read of a list of tensors -> are they all finite? dsgd's
// non-finite gradient check; TensorFlow's reduce_all(is_finite(g)) writes a
// bool tensor the size of each gradient and reads it again.
#include "core/finite.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {

REGISTER_OP("DsgdAllFinite")
    .Input("tensors: T")
    .Output("all_finite: bool")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
True iff no element of any input is +-Inf or NaN.

Reads every input once, on the calling thread (stopping early once a
non-finite element is found). Writes nothing but the scalar output. To check
many tensors in parallel, use one op per tensor.

tensors: the tensors to check, of any shapes and floating types.
all_finite: scalar bool.
)doc");

namespace {

class AllFiniteOp : public OpKernel {
 public:
  explicit AllFiniteOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    // Inline, on the executor's thread: dsgd checks each gradient with its own op,
    // and the executor runs those alongside the backward pass. (ParallelFor here
    // queued its blocks behind the backward ops in the busy intra-op pool and
    // stalled: measured slower than TensorFlow's is_finite.)
    bool finite = true;
    for (int i = 0; i < tensors.size() && finite; ++i) {
      const Tensor& t = tensors[i];
      dsgd::FloatFormat format;
      switch (t.dtype()) {
        case DT_HALF: format = dsgd::FloatFormat::kF16; break;
        case DT_BFLOAT16: format = dsgd::FloatFormat::kBF16; break;
        case DT_FLOAT: format = dsgd::FloatFormat::kF32; break;
        case DT_DOUBLE: format = dsgd::FloatFormat::kF64; break;
        default:
          ctx->CtxFailure(errors::InvalidArgument("DsgdAllFinite: input ", i, " has dtype ",
                                                  DataTypeString(t.dtype()),
                                                  "; accepted: half, bfloat16, float, double"));
          return;
      }
      finite = dsgd::AllFinite(t.tensor_data().data(), static_cast<std::size_t>(t.NumElements()),
                               format);
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<bool>()() = finite;
  }
};

REGISTER_KERNEL_BUILDER(Name("DsgdAllFinite").Device(DEVICE_CPU), AllFiniteOp);

}  // namespace
}  // namespace tensorflow
