// TensorFlow kernels that hand tensors straight to tnt_comm (through its C interface,
// tnt_comm_c_api.h): no Python, no GIL, no numpy conversion on the step's path.
// Built against the installed TensorFlow on first use (tarantella/native/__init__.py);
// without a compiler tarantella falls back to tf.numpy_function ops with the same graph.
//
//   TntAllreduce      y = op over a communicator of x            (layer parallelism, sync BN)
//   TntAllgather      y[r] = x of rank r, stacked on a new axis 0 (layer parallelism)
//   TntFusedSubmit    copies a bucket's tensors into the fused engine, which starts the
//                     bucket's allreduce once it is complete       (data parallelism)
//   TntFusedWait      every bucket's reduced bytes, one flat tensor per bucket: the bucket's
//                     own memory, borrowed from the engine (no copy)
//   TntFusedWaitBucket one bucket's reduced bytes, borrowed, as soon as that bucket is
//                     reduced (Note [One wait per bucket])
//
// `after` inputs only order ops (see tensor_parallel/_collectives.py); their values are unused.
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tnt_comm_c_api.h"

namespace tnt_tf {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

std::atomic<const tnt_comm_c_api*> g_api{nullptr};

// Note [Tensors outlive a stalled call]: after a stall MPI may still read or write the
// buffers of the failed call; keep references to them forever (as tnt_comm's Python layer
// leaks its arrays' references).
void keep_forever(const std::vector<Tensor>& tensors) {
  static std::mutex mu;
  static std::vector<Tensor>* graveyard = new std::vector<Tensor>();  // never destroyed
  std::lock_guard<std::mutex> lock(mu);
  graveyard->insert(graveyard->end(), tensors.begin(), tensors.end());
}

const tnt_comm_c_api* api(OpKernelContext* ctx) {
  const tnt_comm_c_api* a = g_api.load(std::memory_order_acquire);
  if (a == nullptr) {
    ctx->CtxFailure(tensorflow::errors::FailedPrecondition(
        "tarantella's native ops were loaded without tnt_comm's C interface "
        "(load them through tarantella.native.ops())"));
  }
  return a;
}

// Reports a failed call; keeps the call's tensors alive after a stall.
void fail(OpKernelContext* ctx, int status, const char* err, const std::vector<Tensor>& tensors) {
  if (status == TNT_ERR_STALL || status == TNT_ERR_COMM) keep_forever(tensors);
  const std::string msg(err);
  if (status == TNT_ERR_ARG) {
    ctx->CtxFailure(tensorflow::errors::InvalidArgument(msg));
  } else if (status == TNT_ERR_STALL) {
    ctx->CtxFailure(tensorflow::errors::DeadlineExceeded(msg));
  } else {
    ctx->CtxFailure(tensorflow::errors::Internal(msg));
  }
}

const char* numpy_name(tensorflow::DataType t) {
  switch (t) {
    case tensorflow::DT_FLOAT: return "float32";
    case tensorflow::DT_DOUBLE: return "float64";
    case tensorflow::DT_HALF: return "float16";
    case tensorflow::DT_BFLOAT16: return "bfloat16";
    case tensorflow::DT_INT32: return "int32";
    case tensorflow::DT_INT64: return "int64";
    default: return nullptr;
  }
}

std::vector<int64_t> dims_of(const TensorShape& s) {
  std::vector<int64_t> d;
  for (int i = 0; i < s.dims(); ++i) d.push_back(s.dim_size(i));
  return d;
}

constexpr size_t kErrLen = 4096;

// A blocking collective of one input into one output on a communicator (attr "comm"):
// subclasses give the output shape and the C call.
class BlockingCollective : public OpKernel {
 public:
  explicit BlockingCollective(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("comm", &comm_));
  }
  void Compute(OpKernelContext* ctx) override {
    const tnt_comm_c_api* a = api(ctx);
    if (a == nullptr) return;
    const Tensor& x = ctx->input(0);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, output_shape(x.shape()), &y));
    char err[kErrLen] = {0};
    const int s = call(*a, x, const_cast<char*>(y->tensor_data().data()), err, sizeof err);
    if (s != TNT_OK) fail(ctx, s, err, {x, *y});
  }

 protected:
  virtual TensorShape output_shape(const TensorShape& in) const = 0;
  virtual int call(const tnt_comm_c_api& a, const Tensor& x, void* out, char* err, size_t len) const = 0;
  int64_t comm_ = 0;
};

class AllreduceOp : public BlockingCollective {
 public:
  explicit AllreduceOp(OpKernelConstruction* c) : BlockingCollective(c) {
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op_));
  }

 private:
  TensorShape output_shape(const TensorShape& in) const override { return in; }
  int call(const tnt_comm_c_api& a, const Tensor& x, void* out, char* err, size_t len) const override {
    const std::vector<int64_t> dims = dims_of(x.shape());
    return a.allreduce(comm_, x.tensor_data().data(), out, dims.data(), static_cast<int32_t>(dims.size()),
                       numpy_name(x.dtype()), op_, err, len);
  }
  int32_t op_ = 0;
};

class AllgatherOp : public BlockingCollective {
 public:
  explicit AllgatherOp(OpKernelConstruction* c) : BlockingCollective(c) {
    OP_REQUIRES_OK(c, c->GetAttr("group_size", &size_));
  }

 private:
  TensorShape output_shape(const TensorShape& in) const override {
    TensorShape out({size_});
    out.AppendShape(in);
    return out;
  }
  int call(const tnt_comm_c_api& a, const Tensor& x, void* out, char* err, size_t len) const override {
    // Gathered along axis 0 of a [1, *shape] view: every rank's x, stacked.
    std::vector<int64_t> dims = dims_of(x.shape());
    dims.insert(dims.begin(), 1);
    return a.allgather(comm_, x.tensor_data().data(), out, dims.data(), static_cast<int32_t>(dims.size()),
                       numpy_name(x.dtype()), err, len);
  }
  int64_t size_ = 1;
};

class FusedSubmitOp : public OpKernel {
 public:
  explicit FusedSubmitOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("engine", &engine_));
    OP_REQUIRES_OK(c, c->GetAttr("members", &members_));
    OP_REQUIRES_OK(c, c->GetAttr("keep_from", &keep_from_));
  }
  void Compute(OpKernelContext* ctx) override {
    const tnt_comm_c_api* a = api(ctx);
    if (a == nullptr) return;
    const bool keep = ctx->input(1).scalar<bool>()();
    const int n = static_cast<int>(members_.size());
    OP_REQUIRES(ctx, ctx->num_inputs() == n + 2,
                tensorflow::errors::InvalidArgument("TntFusedSubmit: ", ctx->num_inputs() - 2,
                                                    " values for ", n, " members"));
    std::vector<const void*> data(n);
    for (int k = 0; k < n; ++k) {
      // A rank without data contributes zeros for the masked slots (NULL: the engine fills).
      data[k] = (!keep && members_[k] >= keep_from_) ? nullptr : ctx->input(k + 2).tensor_data().data();
    }
    char err[kErrLen] = {0};
    const int s = a->fused_submit(engine_, n, members_.data(), data.data(), err, sizeof err);
    if (s != TNT_OK) {
      fail(ctx, s, err, {});
      return;
    }
    Tensor* token = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &token));
    token->scalar<int32_t>()() = 0;
  }

 private:
  int64_t engine_ = 0;
  std::vector<int64_t> members_;
  int64_t keep_from_ = 0;
};

// Note [Wait outputs borrow the buckets]
// The wait op's outputs are the engine's bucket buffers themselves, not copies of them:
// a copy was a second full gradient set alive during every update (docs/memory.md). Each
// output holds the engine's reference to its bucket (fused_wait_buckets_borrow), dropped
// when TensorFlow frees the tensor and every slice of it. The engine writes a bucket only
// while nobody else holds it, and otherwise reduces the next round in a fresh buffer
// (tnt_comm's Note [Borrowed buckets]): an output kept past the next submit (a fetched
// gradient, a second reduction in the same step) costs memory, never its values. In the
// step graph nothing keeps them: the gradients die with the step, so the next step's
// submits find the buckets free and reuse them. OwnsMemory() is false, so TensorFlow never
// forwards an output's buffer to an op that would write into it (Tensor::RefCountIsOne):
// a bucket's bytes are only ever written by the engine.
class BorrowedBucket : public tensorflow::TensorBuffer {
 public:
  BorrowedBucket(void* data, size_t size, void* hold, void (*release)(void*))
      : TensorBuffer(data), size_(size), hold_(hold), release_(release) {}
  ~BorrowedBucket() override { release_(hold_); }
  size_t size() const override { return size_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(size_));
    proto->set_allocator_name("tnt_comm_fused_bucket");
  }
  bool OwnsMemory() const override { return false; }

 private:
  size_t size_;
  void* hold_;
  void (*release_)(void*);
};

class FusedWaitOp : public OpKernel {
 public:
  explicit FusedWaitOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("engine", &engine_));
    OP_REQUIRES_OK(c, c->GetAttr("counts", &counts_));
  }
  void Compute(OpKernelContext* ctx) override {
    const tnt_comm_c_api* a = api(ctx);
    if (a == nullptr) return;
    const int n = static_cast<int>(counts_.size());
    std::vector<void*> data(n, nullptr);
    std::vector<void*> hold(n, nullptr);
    std::vector<int64_t> nbytes(n, 0);
    char err[kErrLen] = {0};
    const int s = a->fused_wait_buckets_borrow(engine_, n, data.data(), nbytes.data(), hold.data(), err, sizeof err);
    if (s != TNT_OK) {
      fail(ctx, s, err, {});  // nothing is held after a failed call
      return;
    }
    // Every hold is wrapped before anything can fail, so each is released exactly once.
    std::vector<Tensor> out;
    out.reserve(n);
    int bad = -1;
    int64_t bad_want = 0;
    for (int b = 0; b < n; ++b) {
      auto* buf = new BorrowedBucket(data[b], static_cast<size_t>(nbytes[b]), hold[b], a->fused_release);
      const int64_t want = counts_[b] * static_cast<int64_t>(tensorflow::DataTypeSize(output_type(b)));
      if (nbytes[b] != want && bad < 0) {
        bad = b;
        bad_want = want;
      }
      // A bucket whose size the graph got wrong gets an empty view (never read: the op fails).
      out.emplace_back(output_type(b), TensorShape({nbytes[b] == want ? counts_[b] : 0}), buf);
      buf->Unref();  // the tensor holds its own reference
    }
    OP_REQUIRES(ctx, bad < 0,
                tensorflow::errors::InvalidArgument("TntFusedWait: bucket ", bad, " has ",
                                                    bad < 0 ? 0 : nbytes[bad], " bytes, its output ", bad_want));
    for (int b = 0; b < n; ++b) ctx->set_output(b, out[b]);
  }

 private:
  int64_t engine_ = 0;
  std::vector<int64_t> counts_;
};

// Note [One wait per bucket]
// TntFusedWait returns when the last bucket is reduced, so every bucket is alive at once when
// the optimizer starts: a full gradient set beside the optimizer's own temporaries, which is
// what DATA's peak had over serial Keras (docs/memory.md). One TntFusedWaitBucket per bucket
// hands bucket b to the graph as soon as it is reduced; the optimizer updates its variables
// (same values, same ops) and TensorFlow frees it while later buckets are still on the wire,
// as serial Keras frees each gradient once its variable is updated. Each op waits for its
// own bucket's submit and the previous bucket's wait (its `after` token), so at most one
// executor thread blocks in a wait, and only once its bucket has been launched.
class FusedWaitBucketOp : public OpKernel {
 public:
  explicit FusedWaitBucketOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("engine", &engine_));
    OP_REQUIRES_OK(c, c->GetAttr("bucket", &bucket_));
    OP_REQUIRES_OK(c, c->GetAttr("count", &count_));
  }
  void Compute(OpKernelContext* ctx) override {
    const tnt_comm_c_api* a = api(ctx);
    if (a == nullptr) return;
    void* data = nullptr;
    void* hold = nullptr;
    int64_t nbytes = 0;
    char err[kErrLen] = {0};
    const int s = a->fused_wait_bucket_borrow(engine_, bucket_, &data, &nbytes, &hold, err, sizeof err);
    if (s != TNT_OK) {
      fail(ctx, s, err, {});  // nothing is held after a failed call
      return;
    }
    auto* buf = new BorrowedBucket(data, static_cast<size_t>(nbytes), hold, a->fused_release);
    const int64_t want = count_ * static_cast<int64_t>(tensorflow::DataTypeSize(output_type(0)));
    Tensor out(output_type(0), TensorShape({nbytes == want ? count_ : 0}), buf);
    buf->Unref();  // the tensor holds its own reference
    OP_REQUIRES(ctx, nbytes == want,
                tensorflow::errors::InvalidArgument("TntFusedWaitBucket: bucket ", bucket_, " has ", nbytes,
                                                    " bytes, its output ", want));
    ctx->set_output(0, out);
    Tensor* token = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &token));
    token->scalar<int32_t>()() = 0;
  }

 private:
  int64_t engine_ = 0;
  int64_t bucket_ = 0;
  int64_t count_ = 0;
};

}  // namespace tnt_tf

// Called once after loading, with tnt_comm.c_api_address(); 0 on success, else the
// table's version (this library is older or newer than the installed tnt_comm).
extern "C" int tnt_tf_ops_set_api(const void* table) {
  const auto* t = static_cast<const tnt_comm_c_api*>(table);
  if (t == nullptr || t->version != TNT_COMM_C_API_VERSION ||
      t->struct_size < static_cast<int32_t>(sizeof(tnt_comm_c_api))) {
    return t == nullptr ? -1 : t->version;
  }
  tnt_tf::g_api.store(t, std::memory_order_release);
  return 0;
}

#define TNT_TYPES "{float, double, half, bfloat16, int32, int64}"

REGISTER_OP("TntAllreduce")
    .Input("x: T")
    .Input("after: Tafter")
    .Output("y: T")
    .Attr("T: " TNT_TYPES)
    .Attr("Tafter: list(type) >= 0")
    .Attr("comm: int")
    .Attr("reduce_op: int")
    .SetIsStateful()  // a collective: never pruned, folded or merged
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    });

REGISTER_OP("TntAllgather")
    .Input("x: T")
    .Input("after: Tafter")
    .Output("y: T")
    .Attr("T: " TNT_TYPES)
    .Attr("Tafter: list(type) >= 0")
    .Attr("comm: int")
    .Attr("group_size: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t size = 1;
      TF_RETURN_IF_ERROR(c->GetAttr("group_size", &size));
      tensorflow::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(size), c->input(0), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    });

// Not stateful on purpose (cf. tarantella/_reducer.py): a stateful op would be chained
// after every earlier side-effecting op of the step, so no bucket could start before
// backprop ends. The start token input keeps Grappler from constant-folding it.
REGISTER_OP("TntFusedSubmit")
    .Input("start: Tstart")  // any run-time tensor (a variable read, an earlier result)
    .Input("keep: bool")
    .Input("values: Tvalues")
    .Output("token: int32")
    .Attr("Tstart: type")
    .Attr("Tvalues: list(type) >= 1")
    .Attr("engine: int")
    .Attr("members: list(int)")
    .Attr("keep_from: int")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

REGISTER_OP("TntFusedWait")
    .Input("tokens: N * int32")
    .Output("buckets: Tout")
    .Attr("N: int >= 1")
    .Attr("Tout: list(type) >= 1")
    .Attr("engine: int")
    .Attr("counts: list(int)")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      std::vector<int64_t> counts;
      TF_RETURN_IF_ERROR(c->GetAttr("counts", &counts));
      for (size_t b = 0; b < counts.size(); ++b) c->set_output(static_cast<int>(b), c->Vector(counts[b]));
      return absl::OkStatus();
    });

// Stateful, so never pruned even where a bucket's values go unused (every bucket must be
// taken for the engine's round to re-arm); tarantella runs it outside tf.function's chain
// of side effects (_core/reducer.py), ordered by its `after` inputs only.
REGISTER_OP("TntFusedWaitBucket")
    .Input("after: N * int32")  // the bucket's submit token and the previous bucket's wait token
    .Output("reduced: T")
    .Output("token: int32")
    .Attr("N: int >= 1")
    .Attr("T: " TNT_TYPES)
    .Attr("engine: int")
    .Attr("bucket: int >= 0")
    .Attr("count: int >= 0")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t count = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("count", &count));
      c->set_output(0, c->Vector(count));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TntAllreduce").Device(tensorflow::DEVICE_CPU), tnt_tf::AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("TntAllgather").Device(tensorflow::DEVICE_CPU), tnt_tf::AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("TntFusedSubmit").Device(tensorflow::DEVICE_CPU), tnt_tf::FusedSubmitOp);
REGISTER_KERNEL_BUILDER(Name("TntFusedWait").Device(tensorflow::DEVICE_CPU), tnt_tf::FusedWaitOp);
REGISTER_KERNEL_BUILDER(Name("TntFusedWaitBucket").Device(tensorflow::DEVICE_CPU), tnt_tf::FusedWaitBucketOp);
