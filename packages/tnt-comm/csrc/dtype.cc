#include "dtype.h"

#include <array>
#include <stdexcept>

namespace tnt {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  std::size_t size;
  bool is_float;
};

constexpr std::array<DTypeInfo, 6> kDTypes{{
    {DType::kFloat16, "float16", 2, true},
    {DType::kBFloat16, "bfloat16", 2, true},
    {DType::kFloat32, "float32", 4, true},
    {DType::kFloat64, "float64", 8, true},
    {DType::kInt32, "int32", 4, false},
    {DType::kInt64, "int64", 8, false},
}};

const DTypeInfo& info(DType d) { return kDTypes.at(static_cast<std::size_t>(d)); }

}  // namespace

std::size_t dtype_size(DType d) { return info(d).size; }
const char* dtype_name(DType d) { return info(d).name; }
bool dtype_is_float(DType d) { return info(d).is_float; }

std::vector<std::string> dtype_names() {
  std::vector<std::string> out;
  for (const auto& i : kDTypes) out.emplace_back(i.name);
  return out;
}

DType parse_dtype(std::string_view name) {
  for (const auto& i : kDTypes) {
    if (name == i.name) return i.dtype;
  }
  throw std::invalid_argument(
      "unsupported dtype '" + std::string(name) +
      "' for a reduction; supported: float16, bfloat16, float32, float64, int32, int64 "
      "(convert with array.astype(...))");
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
  }
  return "?";
}

}  // namespace tnt
