// Element types the reducing collectives understand, and the reduction operators.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tnt {

enum class DType : std::uint8_t { kFloat16, kBFloat16, kFloat32, kFloat64, kInt32, kInt64 };
enum class ReduceOp : std::uint8_t { kSum, kAvg, kMin, kMax };

std::size_t dtype_size(DType d);
// numpy's name of the type ("float32", "bfloat16", ...).
const char* dtype_name(DType d);
bool dtype_is_float(DType d);
// Parses numpy's dtype name; throws std::invalid_argument listing the supported names.
DType parse_dtype(std::string_view name);
const char* op_name(ReduceOp op);
// numpy's names of every DType, the one list (the Python layer asks the core for it).
std::vector<std::string> dtype_names();

}  // namespace tnt
