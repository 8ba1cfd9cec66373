// The engine end to end in one process (an MPI singleton, no mpirun needed): plain
// collectives, the fused engine with out-of-order submission, and errors as values.
#include <stdexcept>
#include <vector>

#include "check.h"
#include "collectives.h"
#include "errors.h"
#include "fused.h"
#include "mpi_transport.h"

using namespace tnt;

static Engine& engine() {
  static Engine e(Config{}, &make_mpi_control);
  static const bool started = (e.wait_started(), true);
  (void)started;
  return e;
}

static const CommPtr& world() { return engine().world_comm(); }

TNT_TEST(world_of_one) {
  CHECK(engine().world().size == 1);
  CHECK(engine().world().rank == 0);
  CHECK(!engine().world().library.empty());
}

TNT_TEST(allreduce_and_mismatch) {
  std::vector<float> in = {1, 2, 3}, out(3, 0);
  allreduce(engine(), world(), in.data(), out.data(), {"float32", 4, {3}}, ReduceOp::kSum);
  CHECK(out == in);
  CHECK_THROWS(allreduce(engine(), world(), in.data(), out.data(), {"uint8", 1, {3}}, ReduceOp::kSum),
               std::invalid_argument, "unsupported dtype 'uint8'");
  barrier(engine(), world());
}

TNT_TEST(broadcast_and_allgather) {
  std::vector<double> v = {4, 5};
  broadcast(engine(), world(), v.data(), {"float64", 8, {2}}, 0);
  CHECK(v[0] == 4 && v[1] == 5);
  CHECK_THROWS(broadcast(engine(), world(), v.data(), {"float64", 8, {2}}, 3), std::invalid_argument,
               "root=3 is not a rank");
  const Gathered g = allgather(engine(), world(), v.data(), {"float64", 8, {2}});
  CHECK(g.shape == std::vector<std::int64_t>{2});
  CHECK(reinterpret_cast<const double*>(g.data->data())[1] == 5);
}

TNT_TEST(fused_rounds_out_of_order) {
  const std::vector<TensorSpec> specs = {{"a", 3, DType::kFloat32}, {"b", 2, DType::kFloat32},
                                         {"c", 4, DType::kFloat64}};
  FusedAllreduce f(engine(), dup(engine(), world()), specs, 16, ReduceOp::kSum);
  CHECK((f.plan() == Plan{{0}, {1}, {2}}));
  for (int round = 0; round < 3; ++round) {
    const std::vector<float> a = {1, 2, 3}, b = {4, 5};
    const std::vector<double> c = {6, 7, 8, 9};
    f.submit(2, c.data(), 4, DType::kFloat64);
    f.submit(1, b.data(), 2, DType::kFloat32);
    CHECK_THROWS(f.submit(1, b.data(), 2, DType::kFloat32), std::invalid_argument, "'b'");
    CHECK_THROWS(f.submit(0, a.data(), 2, DType::kFloat32), std::invalid_argument, "expects 3");
    f.submit(0, a.data(), 3, DType::kFloat32);
    const auto r = f.wait();
    CHECK(r.size() == 3);
    CHECK(reinterpret_cast<const float*>(r[1].buffer->data() + r[1].offset_bytes)[1] == 5);
    CHECK(reinterpret_cast<const double*>(r[2].buffer->data() + r[2].offset_bytes)[3] == 9);
  }
  f.close();
  const float x = 1;
  CHECK_THROWS(f.submit(0, &x, 3, DType::kFloat32), CommError, "closed");
}

int main() {
  const int rc = tnt_test::run_all();
  engine().shutdown();
  return rc;
}
