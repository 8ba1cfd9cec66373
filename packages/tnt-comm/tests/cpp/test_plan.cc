// Plan and buffer-layout tables (Note [Bucket rule] in plan.h), index lists by hand.
#include <cstdlib>
#include <stdexcept>

#include "buffer.h"
#include "check.h"
#include "plan.h"

using namespace tnt;

static std::vector<TensorSpec> issue_specs() {
  // float32 tensors of 94, 17, 2, 81 elements = 376, 68, 8, 324 bytes.
  return {{"t0", 94, DType::kFloat32}, {"t1", 17, DType::kFloat32},
          {"t2", 2, DType::kFloat32}, {"t3", 81, DType::kFloat32}};
}

TNT_TEST(issue_table) {
  const auto s = issue_specs();
  CHECK((plan_buckets(s, 0) == Plan{{0}, {1}, {2}, {3}}));
  CHECK((plan_buckets(s, 8) == Plan{{0}, {1}, {2}, {3}}));
  CHECK((plan_buckets(s, 40) == Plan{{0}, {1}, {2}, {3}}));
  CHECK((plan_buckets(s, 400) == Plan{{0}, {1, 2, 3}}));
  CHECK((plan_buckets(s, 448) == Plan{{0, 1}, {2, 3}}));
  CHECK((plan_buckets(s, 800) == Plan{{0, 1, 2, 3}}));
}

TNT_TEST(dtypes_split_and_order) {
  const std::vector<TensorSpec> s = {{"a", 10, DType::kFloat32}, {"b", 10, DType::kFloat64},
                                     {"c", 10, DType::kFloat32}, {"d", 20, DType::kFloat64},
                                     {"e", 5, DType::kFloat16},  {"f", 30, DType::kFloat32}};
  CHECK((plan_buckets(s, 200) == Plan{{0, 2, 5}, {1}, {3}, {4}}));
  CHECK((plan_buckets(s, 1 << 30) == Plan{{0, 2, 5}, {1, 3}, {4}}));
}

TNT_TEST(zero_length_and_errors) {
  const std::vector<TensorSpec> s = {{"a", 0, DType::kInt64}, {"b", 0, DType::kInt64},
                                     {"c", 100, DType::kInt64}, {"d", 0, DType::kInt64},
                                     {"e", 1, DType::kInt64}};
  CHECK((plan_buckets(s, 0) == Plan{{0}, {1}, {2}, {3}, {4}}));
  CHECK((plan_buckets(s, 16) == Plan{{0, 1}, {2}, {3, 4}}));
  CHECK(plan_buckets({}, 10).empty());
  CHECK_THROWS(plan_buckets(s, -1), std::invalid_argument, "threshold_bytes must be >= 0");
  CHECK_THROWS(plan_buckets({{"neg", -2, DType::kInt32}}, 0), std::invalid_argument, "'neg'");
}

TNT_TEST(layout_offsets) {
  const auto s = issue_specs();
  const auto layout = make_layout(s, plan_buckets(s, 448));
  CHECK(layout.buckets.size() == 2);
  CHECK(layout.buckets[0].count == 94 + 17);
  CHECK(layout.buckets[0].nbytes() == 444);
  CHECK(layout.buckets[1].count == 2 + 81);
  CHECK(layout.slots[0].bucket == 0 && layout.slots[0].offset == 0);
  CHECK(layout.slots[1].bucket == 0 && layout.slots[1].offset == 94);
  CHECK(layout.slots[2].bucket == 1 && layout.slots[2].offset == 0);
  CHECK(layout.slots[3].bucket == 1 && layout.slots[3].offset == 2 && layout.slots[3].count == 81);
  CHECK_THROWS(make_layout(s, Plan{{0, 1}, {2}}), std::logic_error, "missing");
  CHECK_THROWS(make_layout(s, Plan{{0, 1}, {1, 2, 3}}), std::logic_error, "two buckets");
}

TNT_TEST(layout_aligned_slots) {
  // 64-byte slots: float32 tensors start at multiples of 16 elements.
  const auto s = issue_specs();
  const auto layout = make_layout(s, Plan{{0, 1, 2, 3}}, 64);
  CHECK(layout.slots[0].offset == 0);
  CHECK(layout.slots[1].offset == 96);   // 94 -> 96
  CHECK(layout.slots[2].offset == 128);  // 96 + 17 = 113 -> 128
  CHECK(layout.slots[3].offset == 144);  // 128 + 2 = 130 -> 144
  CHECK(layout.buckets[0].count == 144 + 81);
  CHECK(make_layout(s, Plan{{0, 1, 2, 3}}, 2).slots[1].offset == 94);  // below the element size
  CHECK_THROWS(make_layout(s, Plan{{0, 1, 2, 3}}, 48), std::invalid_argument, "power of two");
  CHECK_THROWS(make_layout(s, Plan{{0, 1, 2, 3}}, 0), std::invalid_argument, "power of two");
}

TNT_TEST(buffer_reuse_only_when_unshared) {
  auto a = std::make_shared<FusionBuffer>(100);
  CHECK(a->size() == 100);
  CHECK(reinterpret_cast<std::uintptr_t>(a->data()) % 64 == 0);
  CHECK(reuse_or_allocate(a, 100) == a);  // only the engine holds it
  auto held = a;                          // e.g. results still referenced from Python
  auto b = reuse_or_allocate(a, 100);
  CHECK(b != a && b->size() == 100);
  CHECK(reuse_or_allocate(nullptr, 8)->size() == 8);
  CHECK(reuse_or_allocate(b, 50)->size() == 50);  // size change: fresh buffer
  auto empty = std::make_shared<FusionBuffer>(0);
  CHECK(empty->data() != nullptr && empty->size() == 0);
}

int main() { return tnt_test::run_all(); }
