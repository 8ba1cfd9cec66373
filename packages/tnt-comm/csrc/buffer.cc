#include "buffer.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

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

// Note [Huge pages for large buffers]
// A large buffer is fresh memory each time (glibc maps allocations above its mmap
// threshold, and tarantella fixes that at 4 MiB: docs/memory.md), so its first touch costs
// one page fault per 4 KiB page. numpy asks the kernel for transparent huge pages on its
// arrays of 4 MiB and more (madvise(MADV_HUGEPAGE); the kernel's default here is
// "madvise"); our buffers did not, so an allgather's result (a FusionBuffer handed to numpy)
// cost several times an allreduce's result (a numpy array) of the same size. Measured on
// this 2-core VM under load: first touch of 50.4 MB 93-189 ms with 4 KiB pages, 30-50 ms
// with the advice. So buffers of at least 4 MiB get the same advice, over the whole pages
// inside them (as numpy: the advice is only a hint, and an error is ignored).
void advise_huge_pages(void* p, std::size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::size_t kMinBytes = std::size_t{4} << 20;
  constexpr std::uintptr_t kPage = 4096;
  if (nbytes < kMinBytes) return;
  const auto start = (reinterpret_cast<std::uintptr_t>(p) + kPage - 1) & ~(kPage - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(p) + nbytes) & ~(kPage - 1);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
#else
  (void)p;
  (void)nbytes;
#endif
}

void FusionBuffer::Free::operator()(std::byte* p) const { std::free(p); }

FusionBuffer::FusionBuffer(std::size_t nbytes, Fill fill) : size_(nbytes) {
  constexpr std::size_t kAlign = 64;
  const std::size_t rounded = ((nbytes + kAlign - 1) / kAlign) * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded == 0 ? kAlign : rounded);
  if (p == nullptr) throw std::bad_alloc();
  data_.reset(static_cast<std::byte*>(p));
  advise_huge_pages(p, rounded);
  if (fill == Fill::kZero) std::memset(p, 0, rounded == 0 ? kAlign : rounded);
}

std::shared_ptr<FusionBuffer> reuse_or_allocate(const std::shared_ptr<FusionBuffer>& current,
                                                std::size_t nbytes) {
  // use_count() == 1: only the engine's slot holds it; a stale count can only be too
  // high (a holder dropping it concurrently), which merely allocates a fresh buffer.
  if (current && current->size() == nbytes && current.use_count() == 1) return current;
  return std::make_shared<FusionBuffer>(nbytes);
}

}  // namespace tnt
