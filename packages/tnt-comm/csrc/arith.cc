#include "arith.h"

#include <stdexcept>
#include <string>
#include <type_traits>

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

struct Add {
  template <class T>
  T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {  // wraps like MPI_SUM (signed overflow is UB)
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
struct Min {
  template <class T>
  T operator()(T a, T b) const { return b < a ? b : a; }
};
struct Max {
  template <class T>
  T operator()(T a, T b) const { return b > a ? b : a; }
};

template <class T, class Fn>
void reduce(const void* first, const void* second, void* out, std::int64_t n) {
  const auto* a = static_cast<const T*>(first);
  const auto* b = static_cast<const T*>(second);
  auto* o = static_cast<T*>(out);
  const Fn fn{};
  for (std::int64_t i = 0; i < n; ++i) o[i] = fn(a[i], b[i]);
}

template <class Fmt, class Fn>
void reduce16(const void* first, const void* second, void* out, std::int64_t n) {
  const auto* a = static_cast<const std::uint16_t*>(first);
  const auto* b = static_cast<const std::uint16_t*>(second);
  auto* o = static_cast<std::uint16_t*>(out);
  const Fn fn{};
  for (std::int64_t i = 0; i < n; ++i) o[i] = Fmt::from(fn(Fmt::to(a[i]), Fmt::to(b[i])));
}

template <class Fn>
void reduce_as(const void* first, const void* second, void* out, std::int64_t n, DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return reduce16<Half, Fn>(first, second, out, n);
    case DType::kBFloat16: return reduce16<BFloat16, Fn>(first, second, out, n);
    case DType::kFloat32: return reduce<float, Fn>(first, second, out, n);
    case DType::kFloat64: return reduce<double, Fn>(first, second, out, n);
    case DType::kInt32: return reduce<std::int32_t, Fn>(first, second, out, n);
    case DType::kInt64: return reduce<std::int64_t, Fn>(first, second, out, n);
  }
}

}  // namespace

void reduce_ordered(const void* first, const void* second, void* out, std::int64_t count,
                    DType dtype, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return reduce_as<Add>(first, second, out, count, dtype);
    case ReduceOp::kMin: return reduce_as<Min>(first, second, out, count, dtype);
    case ReduceOp::kMax: return reduce_as<Max>(first, second, out, count, dtype);
  }
}

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
