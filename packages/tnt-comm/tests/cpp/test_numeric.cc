// 16-bit float conversions, AVG division and the TNT_* parser.
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>

#include "arith.h"
#include "check.h"
#include "config.h"
#include "half.h"

using namespace tnt;

TNT_TEST(half_known_bit_patterns) {
  CHECK(float_to_half(1.0f) == 0x3c00);
  CHECK(float_to_half(-2.0f) == 0xc000);
  CHECK(float_to_half(65504.0f) == 0x7bff);   // largest finite
  CHECK(float_to_half(65520.0f) == 0x7c00);   // ties to even -> Inf
  CHECK(float_to_half(5.9604645e-08f) == 0x0001);  // smallest subnormal
  CHECK(float_to_half(1.0f + 1.0f / 2048) == 0x3c00);  // tie rounds to even
  CHECK(float_to_half(1.0f + 3.0f / 2048) == 0x3c02);
  CHECK(half_to_float(0x3555) == 0.333251953125f);
  CHECK(half_to_float(0x0001) == 5.9604645e-08f);
  CHECK(std::isnan(half_to_float(float_to_half(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(half_to_float(float_to_half(-std::numeric_limits<float>::infinity())) < -1e30f);
}

TNT_TEST(half_roundtrip_all_finite) {
  int bad = 0;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto u = static_cast<std::uint16_t>(h);
    if ((u & 0x7c00) == 0x7c00) continue;  // Inf/NaN
    if (float_to_half(half_to_float(u)) != u) ++bad;
  }
  CHECK(bad == 0);
}

TNT_TEST(bfloat16) {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(bf16_to_float(0x4049) == 3.140625f);
  CHECK(float_to_bf16(1.0f + 1.0f / 256) == 0x3f80);  // tie to even
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
}

TNT_TEST(divide) {
  float f[3] = {3.0f, 6.0f, -9.0f};
  divide_inplace(f, 3, DType::kFloat32, 3);
  CHECK(f[0] == 1.0f && f[1] == 2.0f && f[2] == -3.0f);
  std::uint16_t h[2] = {float_to_half(5.0f), float_to_half(1.0f)};
  divide_inplace(h, 2, DType::kFloat16, 2);
  CHECK(half_to_float(h[0]) == 2.5f && half_to_float(h[1]) == 0.5f);
  int i[1] = {4};
  CHECK_THROWS(divide_inplace(i, 1, DType::kInt32, 2), std::invalid_argument, "Op.AVG");
}

TNT_TEST(env_parser) {
  ::setenv("TNT_TEST_X", "2.5", 1);
  CHECK(env_number("TNT_TEST_X", 1.0, "1") == 2.5);
  ::setenv("TNT_TEST_X", "7x", 1);
  CHECK_THROWS(env_number("TNT_TEST_X", 1.0, "1"), std::invalid_argument, "TNT_TEST_X='7x'");
  ::setenv("TNT_TEST_X", "7 ", 1);
  CHECK(env_number("TNT_TEST_X", 1.0, "1") == 7.0);
  ::setenv("TNT_TEST_X", "0", 1);
  CHECK_THROWS(env_number("TNT_TEST_X", 1.0, "1"), std::invalid_argument, "not a number > 0");
  CHECK(env_number("TNT_TEST_X", 1.0, "1", /*allow_zero=*/true) == 0.0);
  ::setenv("TNT_TEST_X", "nan", 1);
  CHECK_THROWS(env_number("TNT_TEST_X", 1.0, "1"), std::invalid_argument, "TNT_TEST_X");
  ::setenv("TNT_TEST_X", "", 1);
  CHECK(env_number("TNT_TEST_X", 4.0, "1") == 4.0);
  ::unsetenv("TNT_TEST_X");
  CHECK(env_number("TNT_TEST_X", 5.0, "1") == 5.0);
  ::unsetenv(kTimeoutEnv);
  CHECK(load_config().timeout_s == kDefaultTimeoutSeconds);
}

int main() { return tnt_test::run_all(); }
