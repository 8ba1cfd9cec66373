#include "mpi_transport.h"

#include <mpi.h>

#include <array>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <deque>
#include <stdexcept>
#include <string>
#include <thread>

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

int as_int_count(std::int64_t n, const char* what) {
  if (n < 0 || n > INT_MAX) {
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(n) +
                                " elements exceed MPI's int count limit (2^31-1); split the array");
  }
  return static_cast<int>(n);
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

// Owns a counts/displacements pair that must outlive an MPI_Iallgatherv.
class MpiVRequest final : public Request {
 public:
  std::vector<int> counts, displs;
  MpiRequest inner;
  bool test() override { return inner.test(); }
};

constexpr int kQueryTag = 7301;
constexpr int kReplyTag = 7302;
constexpr int kLeaveTag = 7303;
// How long announce_leaving() waits for its 8-byte notices to leave (they are eager
// sends and complete locally at once unless the peer's process is gone).
constexpr std::chrono::milliseconds kLeaveSendWait{1000};

class MpiTransport final : public Transport {
 public:
  MpiTransport() {
    int initialized = 0, finalized = 0;
    check(MPI_Finalized(&finalized), "MPI_Finalized");
    if (finalized) throw CommError("MPI was already finalized in this process; tnt_comm cannot start");
    check(MPI_Initialized(&initialized), "MPI_Initialized");
    if (!initialized) {
      // Note [libnbc ring]: Open MPI's non-blocking allreduce (coll/libnbc) picks a
      // latency-oriented algorithm by default; for the megabyte buckets of the fused
      // engine its ring algorithm is 1.5-2x faster here (benchmarks/allreduce.py). A
      // value set by the user (or the launcher) wins; other MPIs ignore the variable.
      ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", /*overwrite=*/0);
      int provided = 0;
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
      owns_mpi_ = true;
      // Only this thread calls MPI, so FUNNELED is enough for tnt_comm itself.
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
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    check(MPI_Comm_dup(MPI_COMM_WORLD, &side_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(side_, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local_),
          "MPI_Comm_split_type");
    check(MPI_Comm_rank(local_, &local_rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(local_, &local_size_), "MPI_Comm_size");
    create_ops();
    post_query_recv();
    departed_.resize(static_cast<std::size_t>(size_));
    post_leave_recv();
    std::array<char, MPI_MAX_LIBRARY_VERSION_STRING> v{};
    int len = 0;
    MPI_Get_library_version(v.data(), &len);
    library_.assign(v.data(), static_cast<std::size_t>(len));
    if (auto nl = library_.find('\n'); nl != std::string::npos) library_.resize(nl);
  }

  ~MpiTransport() override {
    if (unclean_) return;  // a collective is stuck: MPI_Finalize could hang forever
    for (MPI_Request* r : {&query_req_, &leave_req_}) {
      if (*r != MPI_REQUEST_NULL) {
        MPI_Cancel(r);
        MPI_Wait(r, MPI_STATUS_IGNORE);
      }
    }
    for (auto& r : replies_) MPI_Wait(&r.req, MPI_STATUS_IGNORE);
    for (MPI_Op* op : {&h_sum_, &h_min_, &h_max_, &b_sum_, &b_min_, &b_max_}) {
      if (*op != MPI_OP_NULL) MPI_Op_free(op);
    }
    MPI_Comm_free(&local_);
    MPI_Comm_free(&side_);
    MPI_Comm_free(&comm_);
    if (owns_mpi_) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  std::string library() const override { return library_; }

  std::unique_ptr<Request> iallreduce(const void* send, void* recv, std::int64_t count,
                                      DType dtype, ReduceOp op) override {
    auto r = std::make_unique<MpiRequest>();
    const void* s = (send == recv) ? MPI_IN_PLACE : send;
    check(MPI_Iallreduce(s, recv, as_int_count(count, "allreduce"), mpi_type(dtype),
                         mpi_op(dtype, op), comm_, r->handle()),
          "MPI_Iallreduce");
    return r;
  }

  std::unique_ptr<Request> ibcast(void* buf, std::int64_t nbytes, int root) override {
    auto r = std::make_unique<MpiRequest>();
    check(MPI_Ibcast(buf, as_int_count(nbytes, "broadcast (bytes)"), MPI_BYTE, root, comm_,
                     r->handle()),
          "MPI_Ibcast");
    return r;
  }

  std::unique_ptr<Request> iallgather(const void* send, std::int64_t nbytes, void* recv) override {
    auto r = std::make_unique<MpiRequest>();
    const int n = as_int_count(nbytes, "allgather (bytes)");
    check(MPI_Iallgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, r->handle()),
          "MPI_Iallgather");
    return r;
  }

  std::unique_ptr<Request> iallgatherv(const void* send, void* recv,
                                       const std::vector<std::int64_t>& counts) override {
    auto r = std::make_unique<MpiVRequest>();
    std::int64_t total = 0;
    for (const std::int64_t c : counts) {
      r->counts.push_back(as_int_count(c, "allgather (bytes)"));
      r->displs.push_back(as_int_count(total, "allgather (total bytes)"));
      total += c;
    }
    as_int_count(total, "allgather (total bytes)");
    check(MPI_Iallgatherv(send, r->counts.at(static_cast<std::size_t>(rank_)), MPI_BYTE, recv,
                          r->counts.data(), r->displs.data(), MPI_BYTE, comm_,
                          r->inner.handle()),
          "MPI_Iallgatherv");
    return r;
  }

  std::unique_ptr<Request> ibarrier() override {
    auto r = std::make_unique<MpiRequest>();
    check(MPI_Ibarrier(comm_, r->handle()), "MPI_Ibarrier");
    return r;
  }

  void serve_progress_queries(std::uint64_t my_seq) override {
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
      replies_.push_back(Reply{my_seq, MPI_REQUEST_NULL});
      Reply& rep = replies_.back();
      MPI_Isend(&rep.seq, 1, MPI_UINT64_T, st.MPI_SOURCE, kReplyTag, side_, &rep.req);
      post_query_recv();
    }
  }

  std::vector<std::optional<std::uint64_t>> query_progress(
      std::uint64_t my_seq, std::chrono::milliseconds wait) override {
    std::vector<std::optional<std::uint64_t>> out(static_cast<std::size_t>(size_));
    out[static_cast<std::size_t>(rank_)] = my_seq;
    std::vector<std::uint64_t> answers(static_cast<std::size_t>(size_), 0);
    std::vector<MPI_Request> sends, recvs;
    std::vector<int> peers;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      peers.push_back(r);
      sends.emplace_back(MPI_REQUEST_NULL);
      recvs.emplace_back(MPI_REQUEST_NULL);
    }
    for (std::size_t i = 0; i < peers.size(); ++i) {
      MPI_Isend(&my_seq, 1, MPI_UINT64_T, peers[i], kQueryTag, side_, &sends[i]);
      MPI_Irecv(&answers[static_cast<std::size_t>(peers[i])], 1, MPI_UINT64_T, peers[i],
                kReplyTag, side_, &recvs[i]);
    }
    const auto deadline = std::chrono::steady_clock::now() + wait;
    std::size_t pending = peers.size();
    while (pending > 0 && std::chrono::steady_clock::now() < deadline) {
      serve_progress_queries(my_seq);  // the others may be asking us at the same time
      for (std::size_t i = 0; i < peers.size(); ++i) {
        if (recvs[i] == MPI_REQUEST_NULL) continue;
        int done = 0;
        MPI_Test(&recvs[i], &done, MPI_STATUS_IGNORE);
        if (done) {
          out[static_cast<std::size_t>(peers[i])] = answers[static_cast<std::size_t>(peers[i])];
          --pending;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    // Withdraw unanswered receives (cancelling a receive is always allowed); the 8-byte
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

  void announce_leaving(std::uint64_t my_seq) override {
    leave_seq_ = my_seq;
    std::vector<MPI_Request> sends;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      sends.emplace_back(MPI_REQUEST_NULL);
      MPI_Isend(&leave_seq_, 1, MPI_UINT64_T, r, kLeaveTag, side_, &sends.back());
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
  }

  const std::vector<std::optional<std::uint64_t>>& poll_departures() override {
    for (int guard = 0; guard < size_ && leave_req_ != MPI_REQUEST_NULL; ++guard) {
      int done = 0;
      MPI_Status st;
      if (MPI_Test(&leave_req_, &done, &st) != MPI_SUCCESS || !done) break;
      if (st.MPI_SOURCE >= 0 && st.MPI_SOURCE < size_) {
        departed_[static_cast<std::size_t>(st.MPI_SOURCE)] = leave_buf_;
      }
      post_leave_recv();
    }
    return departed_;
  }

  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; this is for a broken MPI
  }

  void mark_unclean() override { unclean_ = true; }

 private:
  struct Reply {
    std::uint64_t seq;
    MPI_Request req;
  };

  void post_query_recv() {
    check(MPI_Irecv(&query_buf_, 1, MPI_UINT64_T, MPI_ANY_SOURCE, kQueryTag, side_, &query_req_),
          "MPI_Irecv");
  }

  void post_leave_recv() {
    check(MPI_Irecv(&leave_buf_, 1, MPI_UINT64_T, MPI_ANY_SOURCE, kLeaveTag, side_, &leave_req_),
          "MPI_Irecv");
  }

  void create_ops() {
    check(MPI_Op_create(&reduce16<Half, AddF>, 1, &h_sum_), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<Half, MinF>, 1, &h_min_), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<Half, MaxF>, 1, &h_max_), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<BFloat16, AddF>, 1, &b_sum_), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<BFloat16, MinF>, 1, &b_min_), "MPI_Op_create");
    check(MPI_Op_create(&reduce16<BFloat16, MaxF>, 1, &b_max_), "MPI_Op_create");
  }

  static MPI_Datatype mpi_type(DType d) {
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

  MPI_Op mpi_op(DType d, ReduceOp op) const {
    // AVG is a SUM here; the caller divides by size() afterwards.
    if (d == DType::kFloat16) return op == ReduceOp::kMin ? h_min_ : op == ReduceOp::kMax ? h_max_ : h_sum_;
    if (d == DType::kBFloat16) return op == ReduceOp::kMin ? b_min_ : op == ReduceOp::kMax ? b_max_ : b_sum_;
    return op == ReduceOp::kMin ? MPI_MIN : op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
  }

  bool owns_mpi_ = false;
  bool unclean_ = false;
  MPI_Comm comm_ = MPI_COMM_NULL, side_ = MPI_COMM_NULL, local_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  std::string library_;
  MPI_Op h_sum_ = MPI_OP_NULL, h_min_ = MPI_OP_NULL, h_max_ = MPI_OP_NULL;
  MPI_Op b_sum_ = MPI_OP_NULL, b_min_ = MPI_OP_NULL, b_max_ = MPI_OP_NULL;
  std::uint64_t query_buf_ = 0;
  MPI_Request query_req_ = MPI_REQUEST_NULL;
  std::deque<Reply> replies_;  // deque: stable addresses for in-flight Isend buffers
  std::uint64_t leave_buf_ = 0, leave_seq_ = 0;
  MPI_Request leave_req_ = MPI_REQUEST_NULL;
  std::vector<std::optional<std::uint64_t>> departed_;
};

}  // namespace

std::unique_ptr<Transport> make_mpi_transport() { return std::make_unique<MpiTransport>(); }

}  // namespace tnt
