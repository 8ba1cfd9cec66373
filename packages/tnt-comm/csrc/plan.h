// The fusion plan: which tensors share a bucket. A pure function of the ordered specs
// and the threshold, so every rank computes the same plan without talking.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtype.h"

namespace tnt {

struct TensorSpec {
  std::string name;
  std::int64_t count = 0;  // elements
  DType dtype = DType::kFloat32;

  std::int64_t nbytes() const { return count * static_cast<std::int64_t>(dtype_size(dtype)); }
};

using Bucket = std::vector<std::int64_t>;  // tensor indices, ascending
using Plan = std::vector<Bucket>;

// Note [Bucket rule]
// Walk the specs in order, keeping one open bucket per dtype. A tensor joins the open
// bucket of its dtype unless that would make the bucket exceed `threshold_bytes`; then
// the open bucket closes and the tensor starts a new one. Consequences: a tensor larger
// than the threshold gets a bucket of its own; tensors of different dtypes never share
// a bucket; threshold 0 means one tensor per bucket (zero-length tensors included).
// Buckets are ordered by their first (lowest) tensor index. Throws std::invalid_argument
// for a negative threshold or count.
Plan plan_buckets(const std::vector<TensorSpec>& specs, std::int64_t threshold_bytes);

}  // namespace tnt
