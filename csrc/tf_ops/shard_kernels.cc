// Kernel of DsgdReadShards: turns addresses into tensors, then calls core to copy
// the pieces that cannot be aliased (or to widen 16-bit wire values to float).
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/copy.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace {

constexpr std::uintptr_t kAlignBytes = 64;  // EIGEN_MAX_ALIGN_BYTES

// A view of memory that someone else owns. OwnsMemory() == false makes
// Tensor::RefCountIsOne() false, so TensorFlow never reuses it as an output.
class BorrowedBuffer : public TensorBuffer {
 public:
  BorrowedBuffer(void* data, size_t bytes) : TensorBuffer(data), bytes_(bytes) {}
  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(bytes_));
    proto->set_allocator_name("dsgd_borrowed");
  }
  bool OwnsMemory() const override { return false; }

 private:
  size_t bytes_;
};

struct Piece {
  int64_t output, output_offset, length, shard, shard_offset;
};

// Wire: the element type in the shard buffers; T: the outputs'. Either the same,
// or Wire is a 16-bit float (compressed gradients) and T is float.
template <typename Wire, typename T>
class ReadShardsOp : public OpKernel {
  static constexpr bool kWiden = !std::is_same_v<Wire, T>;
  static_assert(!kWiden || (std::is_same_v<T, float> && sizeof(Wire) == 2));

 public:
  explicit ReadShardsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::vector<int64_t> flat;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shard_elements", &shard_elements_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shapes", &shapes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("pieces", &flat));
    OP_REQUIRES(ctx, flat.size() % 5 == 0,
                errors::InvalidArgument("pieces must hold 5 integers per piece, got ", flat.size()));
    pieces_.resize(shapes_.size());
    for (size_t i = 0; i < flat.size(); i += 5) {
      Piece p{flat[i], flat[i + 1], flat[i + 2], flat[i + 3], flat[i + 4]};
      OP_REQUIRES(ctx, p.output >= 0 && p.output < static_cast<int64_t>(shapes_.size()),
                  errors::InvalidArgument("piece ", i / 5, " names output ", p.output));
      OP_REQUIRES(ctx, p.shard >= 0 && p.shard < static_cast<int64_t>(shard_elements_.size()),
                  errors::InvalidArgument("piece ", i / 5, " names shard ", p.shard));
      OP_REQUIRES(ctx, p.length > 0 && p.shard_offset >= 0 &&
                           p.shard_offset + p.length <= shard_elements_[p.shard],
                  errors::InvalidArgument("piece ", i / 5, " runs past shard ", p.shard));
      pieces_[p.output].push_back(p);
    }
    for (size_t o = 0; o < shapes_.size(); ++o) {
      int64_t covered = 0;
      for (const Piece& p : pieces_[o]) {
        OP_REQUIRES(ctx, p.output_offset == covered,
                    errors::InvalidArgument("output ", o, ": pieces must be in order and "
                                            "contiguous; gap or overlap at element ", covered));
        covered += p.length;
      }
      OP_REQUIRES(ctx, covered == shapes_[o].num_elements(),
                  errors::InvalidArgument("output ", o, " has ", shapes_[o].num_elements(),
                                          " elements but its pieces cover ", covered));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& addresses = ctx->input(0);
    const Tensor& byte_sizes = ctx->input(1);
    const int64_t num_shards = static_cast<int64_t>(shard_elements_.size());
    OP_REQUIRES(ctx, addresses.NumElements() == num_shards && byte_sizes.NumElements() == num_shards,
                errors::InvalidArgument("expected ", num_shards, " addresses and byte sizes, got ",
                                        addresses.NumElements(), " and ", byte_sizes.NumElements()));
    auto address = addresses.flat<int64_t>();
    auto bytes = byte_sizes.flat<int64_t>();
    for (int64_t s = 0; s < num_shards; ++s) {
      const int64_t expected = shard_elements_[s] * static_cast<int64_t>(sizeof(Wire));
      OP_REQUIRES(ctx, bytes(s) == expected,
                  errors::InvalidArgument("shard ", s, " holds ", bytes(s), " bytes but the plan "
                                          "expects ", shard_elements_[s], " elements of ",
                                          DataTypeString(DataTypeToEnum<Wire>::value), " (", expected,
                                          " bytes)"));
      OP_REQUIRES(ctx, address(s) != 0, errors::InvalidArgument("shard ", s, " has address 0"));
    }
    std::vector<dsgd::Span> copies;
    for (size_t o = 0; o < shapes_.size(); ++o) {
      const std::vector<Piece>& pieces = pieces_[o];
      auto at = [&](const Piece& p) {
        return reinterpret_cast<char*>(address(p.shard)) + p.shard_offset * sizeof(Wire);
      };
      if (!kWiden && pieces.size() == 1 &&
          reinterpret_cast<std::uintptr_t>(at(pieces[0])) % kAlignBytes == 0) {
        core::RefCountPtr<TensorBuffer> buffer(
            new BorrowedBuffer(at(pieces[0]), pieces[0].length * sizeof(T)));
        ctx->set_output(o, Tensor(DataTypeToEnum<T>::value, shapes_[o], std::move(buffer)));
        continue;
      }
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(o, shapes_[o], &out));
      char* dst = reinterpret_cast<char*>(out->flat<T>().data());
      for (const Piece& p : pieces) {
        if constexpr (kWiden) {
          dsgd::WidenToF32(reinterpret_cast<const std::uint16_t*>(at(p)),
                           reinterpret_cast<float*>(dst) + p.output_offset,
                           static_cast<std::size_t>(p.length), std::is_same_v<Wire, bfloat16>,
                           /*max_threads=*/0);
        } else {
          copies.push_back({at(p), dst + p.output_offset * sizeof(T), p.length * sizeof(T)});
        }
      }
    }
    dsgd::CopySpans(copies.data(), copies.size(), /*max_threads=*/0);
  }

 private:
  std::vector<int64_t> shard_elements_;
  std::vector<TensorShape> shapes_;
  std::vector<std::vector<Piece>> pieces_;
};

#define REGISTER(Wire, T)                                                      \
  REGISTER_KERNEL_BUILDER(Name("DsgdReadShards")                               \
                              .Device(DEVICE_CPU)                              \
                              .TypeConstraint<Wire>("wire")                    \
                              .TypeConstraint<T>("T"),                         \
                          ReadShardsOp<Wire, T>);
REGISTER(Eigen::half, Eigen::half)
REGISTER(bfloat16, bfloat16)
REGISTER(float, float)
REGISTER(double, double)
REGISTER(Eigen::half, float)
REGISTER(bfloat16, float)
#undef REGISTER

}  // namespace
}  // namespace tensorflow
