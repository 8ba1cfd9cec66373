#include "plan.h"

#include <algorithm>
#include <map>
#include <stdexcept>

namespace tnt {

Plan plan_buckets(const std::vector<TensorSpec>& specs, std::int64_t threshold_bytes) {
  if (threshold_bytes < 0) {
    throw std::invalid_argument("threshold_bytes must be >= 0 (0 = one tensor per bucket), got " +
                                std::to_string(threshold_bytes));
  }
  struct Open {
    Bucket tensors;
    std::int64_t bytes = 0;
  };
  Plan plan;
  std::map<DType, Open> open;  // one open bucket per dtype
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    if (s.count < 0) {
      throw std::invalid_argument("tensor " + std::to_string(i) + " ('" + s.name +
                                  "') has negative count " + std::to_string(s.count));
    }
    const std::int64_t bytes = s.nbytes();
    auto it = open.find(s.dtype);
    if (it != open.end() &&
        (threshold_bytes == 0 || it->second.bytes + bytes > threshold_bytes)) {
      plan.push_back(std::move(it->second.tensors));
      open.erase(it);
      it = open.end();
    }
    if (it == open.end()) it = open.emplace(s.dtype, Open{}).first;
    it->second.tensors.push_back(static_cast<std::int64_t>(i));
    it->second.bytes += bytes;
  }
  for (auto& [dtype, o] : open) plan.push_back(std::move(o.tensors));
  std::sort(plan.begin(), plan.end(),
            [](const Bucket& a, const Bucket& b) { return a.front() < b.front(); });
  return plan;
}

}  // namespace tnt
