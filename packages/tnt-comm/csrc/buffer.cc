#include "buffer.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace tnt {

FusionLayout make_layout(const std::vector<TensorSpec>& specs, const Plan& plan,
                         std::int64_t align_bytes) {
  if (align_bytes < 1 || align_bytes > 4096 || (align_bytes & (align_bytes - 1)) != 0) {
    throw std::invalid_argument("slot alignment must be a power of two between 1 and 4096 bytes, got " +
                                std::to_string(align_bytes));
  }
  FusionLayout layout;
  layout.slots.assign(specs.size(), TensorSlot{-1, 0, 0});
  layout.buckets.reserve(plan.size());
  for (std::size_t b = 0; b < plan.size(); ++b) {
    BucketLayout bucket;
    if (plan[b].empty()) throw std::logic_error("empty bucket in plan");
    bucket.dtype = specs.at(static_cast<std::size_t>(plan[b].front())).dtype;
    const std::int64_t step =
        std::max<std::int64_t>(1, align_bytes / static_cast<std::int64_t>(dtype_size(bucket.dtype)));
    for (const std::int64_t t : plan[b]) {
      const TensorSpec& s = specs.at(static_cast<std::size_t>(t));
      if (s.dtype != bucket.dtype) throw std::logic_error("bucket mixes dtypes");
      if (layout.slots[static_cast<std::size_t>(t)].bucket != -1) {
        throw std::logic_error("tensor in two buckets");
      }
      bucket.count = (bucket.count + step - 1) / step * step;
      layout.slots[static_cast<std::size_t>(t)] = {static_cast<std::int64_t>(b), bucket.count, s.count};
      bucket.count += s.count;
      bucket.tensors.push_back(t);
    }
    layout.buckets.push_back(std::move(bucket));
  }
  for (std::size_t t = 0; t < specs.size(); ++t) {
    if (layout.slots[t].bucket == -1) throw std::logic_error("tensor missing from plan");
  }
  return layout;
}

void FusionBuffer::Free::operator()(std::byte* p) const { std::free(p); }

FusionBuffer::FusionBuffer(std::size_t nbytes, Fill fill) : size_(nbytes) {
  constexpr std::size_t kAlign = 64;
  const std::size_t rounded = ((nbytes + kAlign - 1) / kAlign) * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded == 0 ? kAlign : rounded);
  if (p == nullptr) throw std::bad_alloc();
  if (fill == Fill::kZero) std::memset(p, 0, rounded == 0 ? kAlign : rounded);
  data_.reset(static_cast<std::byte*>(p));
}

std::shared_ptr<FusionBuffer> reuse_or_allocate(const std::shared_ptr<FusionBuffer>& current,
                                                std::size_t nbytes) {
  // use_count() == 1: only the engine's slot holds it; a stale count can only be too
  // high (a holder dropping it concurrently), which merely allocates a fresh buffer.
  if (current && current->size() == nbytes && current.use_count() == 1) return current;
  return std::make_shared<FusionBuffer>(nbytes);
}

}  // namespace tnt
