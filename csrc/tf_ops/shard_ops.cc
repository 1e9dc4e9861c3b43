// Op registration: shapes and docs only; the kernel is in shard_kernels.cc.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {

REGISTER_OP("DsgdReadShards")
    .Input("addresses: int64")
    .Input("byte_sizes: int64")
    .Output("outputs: num_outputs * T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("wire: {half, bfloat16, float, double}")
    .Attr("num_outputs: int >= 1")
    .Attr("shapes: list(shape)")
    .Attr("shard_elements: list(int)")
    .Attr("pieces: list(int)")
    .SetIsStateful()  // reads memory that its inputs only point to: never fold or merge it
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      std::vector<int64_t> shard_elements;
      TF_RETURN_IF_ERROR(c->GetAttr("shard_elements", &shard_elements));
      const int64_t num_shards = static_cast<int64_t>(shard_elements.size());
      for (int i = 0; i < 2; ++i) {
        shape_inference::ShapeHandle input;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &input));
        shape_inference::DimensionHandle unused;
        TF_RETURN_IF_ERROR(c->WithValue(c->Dim(input, 0), num_shards, &unused));
      }
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      if (static_cast<int>(shapes.size()) != c->num_outputs())
        return errors::InvalidArgument("DsgdReadShards: ", shapes.size(), " shapes for ",
                                       c->num_outputs(), " outputs");
      for (int i = 0; i < c->num_outputs(); ++i) {
        shape_inference::ShapeHandle out;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &out));
        c->set_output(i, out);
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Turns buffers that hold gradient shards (e.g. object-store memory) into tensors.

Shard s is `byte_sizes[s]` bytes at address `addresses[s]` and must hold exactly
`shard_elements[s]` elements of type `wire`: T itself, or half/bfloat16 for a
float T (compressed gradients), widened to float exactly while they are copied. `pieces` lists 5 integers per piece:
(output, output_offset, length, shard, shard_offset), in elements; the pieces of
each output must cover it exactly once, in order of output_offset.

When wire == T, an output held by one piece whose address is 64-byte aligned ALIASES the buffer:
no copy. Such a tensor never owns or frees the memory, and TensorFlow never
writes into it (it is never forwarded to another op's output). Every other output
is a new tensor the pieces are copied into. The caller must keep every buffer
alive and unchanged for as long as TensorFlow uses the outputs.

addresses: base address of each shard buffer.
byte_sizes: size of each shard buffer in bytes.
outputs: one tensor per entry of `shapes`.
)doc");

}  // namespace tensorflow
