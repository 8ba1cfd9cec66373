#include "arith.h"

#include <stdexcept>
#include <string>

#include "half.h"

namespace tnt {
namespace {

template <class T>
void divide(T* p, std::int64_t n, T d) {
  for (std::int64_t i = 0; i < n; ++i) p[i] /= d;
}

template <class Fmt>
void divide16(std::uint16_t* p, std::int64_t n, float d) {
  for (std::int64_t i = 0; i < n; ++i) p[i] = Fmt::from(Fmt::to(p[i]) / d);
}

}  // namespace

bool avg_scales_first(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

void check_avg(DType dtype, const std::string& what) {
  if (dtype_is_float(dtype)) return;
  throw std::invalid_argument(what + ": Op.AVG is not defined for integer dtype " + dtype_name(dtype) +
                              " (the mean is not an integer); use Op.SUM and divide yourself, "
                              "or convert to a float dtype");
}

void divide_inplace(void* data, std::int64_t count, DType dtype, int divisor) {
  switch (dtype) {
    case DType::kFloat16: return divide16<Half>(static_cast<std::uint16_t*>(data), count, static_cast<float>(divisor));
    case DType::kBFloat16: return divide16<BFloat16>(static_cast<std::uint16_t*>(data), count, static_cast<float>(divisor));
    case DType::kFloat32: return divide(static_cast<float*>(data), count, static_cast<float>(divisor));
    case DType::kFloat64: return divide(static_cast<double*>(data), count, static_cast<double>(divisor));
    case DType::kInt32:
    case DType::kInt64: break;
  }
  check_avg(dtype, "divide");
}

}  // namespace tnt
