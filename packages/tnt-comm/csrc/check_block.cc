#include "check_block.h"

#include <algorithm>

#include "arith.h"

namespace tnt {

void combine_check_blocks(const CheckBlock& in, CheckBlock& inout) {
  for (int k = 0; k < 4; ++k) inout.marks[k] = std::max(in.marks[k], inout.marks[k]);
  const bool same = in.dtype == inout.dtype && in.op == inout.op && in.count == inout.count;
  if (!same || in.dtype < 0 || in.dtype > static_cast<std::int32_t>(DType::kInt64) || in.count < 0 ||
      in.op < 0 || in.op > static_cast<std::int32_t>(ReduceOp::kMax)) {
    return;
  }
  const auto dtype = static_cast<DType>(in.dtype);
  if (in.count * static_cast<std::int64_t>(dtype_size(dtype)) > kInlineBytes) return;
  reduce_ordered(in.data, inout.data, inout.data, in.count, dtype, static_cast<ReduceOp>(in.op));
}

}  // namespace tnt
