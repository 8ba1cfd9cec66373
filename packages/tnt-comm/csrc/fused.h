// The fused allreduce engine: tensors are copied into per-bucket buffers as they are
// submitted (from any thread); a bucket is launched when its last tensor arrived and
// every bucket before it in launch order was launched (the next-bucket cursor; buckets
// over the threshold first, Note [Large buckets first] in fused.cc), so all ranks issue the
// same collectives in the same order whatever the submission order. Reductions run on
// the communication thread while callers keep submitting: communication overlaps
// computation. wait() returns every reduced tensor and re-arms the engine.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "buffer.h"
#include "engine.h"
#include "plan.h"

namespace tnt {

struct FusedResult {
  std::shared_ptr<FusionBuffer> buffer;  // keeps the memory alive while Python holds it
  std::int64_t offset_bytes = 0;
  std::int64_t count = 0;
};

class FusedAllreduce {
 public:
  // Collective: every rank must construct it with the same specs, threshold and op (it
  // checks, and raises on every rank if they differ). Blocking: release the GIL.
  // `comm`: the communicator to reduce over; use one per engine (Note [One communicator
  // per engine] in fused.cc).
  // `slot_align_bytes`: each tensor starts at a multiple of it inside its bucket
  // (make_layout); 1 packs them back to back.
  FusedAllreduce(Engine& engine, std::shared_ptr<Comm> comm, std::vector<TensorSpec> specs,
                 std::int64_t threshold_bytes, ReduceOp op, std::int64_t slot_align_bytes = 1);
  ~FusedAllreduce();
  FusedAllreduce(const FusedAllreduce&) = delete;
  FusedAllreduce& operator=(const FusedAllreduce&) = delete;

  const Plan& plan() const;
  // Bucket indices (into plan()) in the order the buckets are launched on every rank.
  const std::vector<std::size_t>& launch_order() const;
  const FusionLayout& layout() const;
  const std::vector<TensorSpec>& specs() const;

  // Copies `data` (count elements of dtype) into the tensor's bucket slot; launches the
  // buckets that became ready. Errors name the tensor. Call with the GIL released.
  void submit(std::int64_t index, const void* data, std::int64_t count, DType dtype);

  // One tensor of a batched submit: a view of the caller's memory, copied at once.
  struct Item {
    std::int64_t index = 0;
    const void* data = nullptr;
    std::int64_t count = 0;
    DType dtype = DType::kFloat32;
  };
  // submit() for several tensors with one lock round trip: many small tensors cost a
  // copy each, not a call each. All-or-nothing: an invalid item (index out of range,
  // wrong count/dtype, submitted twice) throws before any tensor is taken.
  void submit_many(const std::vector<Item>& items);
  // Blocks until every bucket is reduced; results in spec order. Call with the GIL released.
  std::vector<FusedResult> wait();
  // As wait(), but one result per bucket (plan order): the bucket's tensors back to back
  // in plan order. The cheap form for many small tensors: the caller splits views.
  std::vector<FusedResult> wait_buckets();
  // Blocks until bucket `bucket` (plan order) is reduced; its buffer, the bucket's tensors
  // back to back. Each bucket once per round, in any order; the round re-arms once all were
  // taken (Note [One bucket at a time] in fused.cc). Call with the GIL released.
  FusedResult wait_bucket(std::int64_t bucket);
  // Further calls fail; a pending wait() fails with CommError. In-flight buckets finish.
  void close();

  struct State;

 private:
  std::vector<FusedResult> wait_round(bool per_bucket);
  std::shared_ptr<State> state_;
};

}  // namespace tnt
