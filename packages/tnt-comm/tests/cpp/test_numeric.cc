// 16-bit float conversions, AVG division and the TNT_* parser.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "allreduce_schedule.h"
#include "check_block.h"
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

// Note [Small allreduce]: every rank's rounds, run against each other in one process
// (a mailbox per (from, to) pair in send order), for 1..9 ranks: each rank must end
// with the reduction over all ranks, bitwise equal on all, for SUM and for MIN with a
// NaN and signed zeros (where the operand order decides the bits).
namespace {
std::vector<std::vector<float>> run_schedules(std::vector<std::vector<float>> data, ReduceOp op) {
  const int n = static_cast<int>(data.size());
  std::vector<std::vector<AllreduceRound>> rounds;
  for (int r = 0; r < n; ++r) rounds.push_back(recursive_doubling(r, n));
  std::map<std::pair<int, int>, std::deque<std::vector<float>>> box;
  std::vector<std::size_t> next(static_cast<std::size_t>(n), 0);
  std::vector<bool> sent(static_cast<std::size_t>(n), false);
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < n; ++r) {
      auto& i = next[static_cast<std::size_t>(r)];
      if (i == rounds[static_cast<std::size_t>(r)].size()) continue;
      const AllreduceRound& round = rounds[static_cast<std::size_t>(r)][i];
      auto& mine = data[static_cast<std::size_t>(r)];
      if (round.send_to >= 0 && !sent[static_cast<std::size_t>(r)]) {
        box[{r, round.send_to}].push_back(mine);
        sent[static_cast<std::size_t>(r)] = true;
        moved = true;
      }
      if (round.recv_from >= 0) {
        auto& q = box[{round.recv_from, r}];
        if (q.empty()) continue;
        const std::vector<float> got = q.front();
        q.pop_front();
        if (round.result) {
          mine = got;
        } else if (round.received_first) {
          reduce_ordered(got.data(), mine.data(), mine.data(), 1, DType::kFloat32, op);
        } else {
          reduce_ordered(mine.data(), got.data(), mine.data(), 1, DType::kFloat32, op);
        }
      }
      sent[static_cast<std::size_t>(r)] = false;
      ++i;
      moved = true;
    }
  }
  for (int r = 0; r < n; ++r) CHECK(next[static_cast<std::size_t>(r)] == rounds[static_cast<std::size_t>(r)].size());
  return data;
}
}  // namespace

TNT_TEST(recursive_doubling_reduces_everything_bitwise_equal_on_every_rank) {
  for (int n = 1; n <= 9; ++n) {
    std::vector<std::vector<float>> ones, mins;
    for (int r = 0; r < n; ++r) {
      ones.push_back({static_cast<float>(1 << r) + 0.1f * static_cast<float>(r)});
      // rank 1 contributes a NaN, the others signed zeros: the result's bits depend on order
      mins.push_back({r == 1 ? std::nanf("") : (r % 2 ? -0.0f : 0.0f)});
    }
    const auto sums = run_schedules(ones, ReduceOp::kSum);
    const auto minimum = run_schedules(mins, ReduceOp::kMin);
    float want = 0;  // every term is exact in float, so any order gives this sum
    for (int r = 0; r < n; ++r) want += ones[static_cast<std::size_t>(r)][0];
    for (int r = 0; r < n; ++r) {
      CHECK(std::fabs(sums[static_cast<std::size_t>(r)][0] - want) <= 1e-3f * want);
      CHECK(float_bits(sums[static_cast<std::size_t>(r)][0]) == float_bits(sums[0][0]));
      CHECK(float_bits(minimum[static_cast<std::size_t>(r)][0]) == float_bits(minimum[0][0]));
    }
  }
  CHECK(recursive_doubling(0, 1).empty());
  CHECK(recursive_doubling(2, 3).size() == 1);  // 3 ranks: rank 2 only exchanges with rank 1
  CHECK(recursive_doubling(0, 3).size() == 2);  // rank 0 folds into rank 1 and gets the result back
}

// Note [Inline data]: the check's operator reduces the marks by MAX and the inline data by
// its op, lower ranks' part first; blocks that describe different data leave it alone.
TNT_TEST(check_blocks_combine_marks_and_inline_data) {
  CheckBlock lo, hi;
  lo.marks[0] = 5; hi.marks[0] = 7; lo.marks[2] = -3; hi.marks[2] = -9;
  lo.dtype = hi.dtype = static_cast<std::int32_t>(DType::kFloat32);
  lo.op = hi.op = static_cast<std::int32_t>(ReduceOp::kMin);
  lo.count = hi.count = 2;
  const float a[2] = {std::nanf(""), -0.0f}, b[2] = {1.0f, 0.0f};
  std::memcpy(lo.data, a, sizeof a);
  std::memcpy(hi.data, b, sizeof b);
  combine_check_blocks(lo, hi);
  CHECK(hi.marks[0] == 7 && hi.marks[2] == -3);
  float got[2];
  std::memcpy(got, hi.data, sizeof got);
  float first[2];  // the same as reduce_ordered(lower, higher)
  reduce_ordered(a, b, first, 2, DType::kFloat32, ReduceOp::kMin);
  CHECK(float_bits(got[0]) == float_bits(first[0]) && float_bits(got[1]) == float_bits(first[1]));
  CheckBlock other = lo;
  other.dtype = static_cast<std::int32_t>(DType::kInt32);  // different data: left alone
  CheckBlock keep = other;
  combine_check_blocks(hi, other);
  CHECK(std::memcmp(other.data, keep.data, sizeof keep.data) == 0);
  CheckBlock big = lo;
  big.count = 1000;  // more than fits: never read past the block
  combine_check_blocks(big, big);
  CHECK(big.count == 1000);
}
