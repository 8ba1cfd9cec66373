// Bucket memory: where each tensor lives inside its bucket's contiguous buffer, and the
// buffer itself. Layout is computed once per engine; buffers are reused across rounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "plan.h"

namespace tnt {

struct TensorSlot {
  std::int64_t bucket = 0;
  std::int64_t offset = 0;  // elements from the start of the bucket
  std::int64_t count = 0;
};

struct BucketLayout {
  DType dtype = DType::kFloat32;
  std::int64_t count = 0;  // total elements
  std::vector<std::int64_t> tensors;

  std::int64_t nbytes() const { return count * static_cast<std::int64_t>(dtype_size(dtype)); }
};

struct FusionLayout {
  std::vector<BucketLayout> buckets;
  std::vector<TensorSlot> slots;  // indexed by tensor
};

// Packs each bucket's tensors in plan order, each starting at a multiple of
// `align_bytes` from the bucket's start (1: back to back; a bucket holds one dtype, so
// every tensor stays aligned to its element size). Padding between slots is reduced
// with the rest (zeros). TensorFlow hands out a slice of a tensor without copying only
// when it starts 64-byte aligned: tnt-keras asks for 64.
FusionLayout make_layout(const std::vector<TensorSpec>& specs, const Plan& plan,
                         std::int64_t align_bytes = 1);

// Asks the kernel for transparent huge pages over [p, p + nbytes) if it spans at least
// 4 MiB (Note [Huge pages for large buffers] in buffer.cc); a hint, never an error.
void advise_huge_pages(void* p, std::size_t nbytes);

// One bucket's bytes, heap-allocated and 64-byte aligned. Shared so that arrays handed
// to Python can keep it alive after the engine moved on to a fresh buffer.
class FusionBuffer {
 public:
  enum class Fill { kZero, kNone };
  // kZero: a bucket's padding between slots must reduce as zeros. kNone: every byte is
  // written before it is read (a message's payload); zeroing 4 MiB cost 0.4 ms per message.
  explicit FusionBuffer(std::size_t nbytes, Fill fill = Fill::kZero);
  std::byte* data() { return data_.get(); }
  std::size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte, Free> data_;
  std::size_t size_;
};

// Returns `current` if nobody else holds it (results of the last round were dropped),
// else a fresh buffer of the same size: results handed out are never overwritten.
std::shared_ptr<FusionBuffer> reuse_or_allocate(const std::shared_ptr<FusionBuffer>& current,
                                                std::size_t nbytes);

}  // namespace tnt
