#include "p2p_allreduce.h"

#include <cstring>
#include <string>
#include <vector>

#include "allreduce_schedule.h"
#include "arith.h"
#include "errors.h"

namespace tnt {
namespace {

// Note [Small allreduce]
// Open MPI's non-blocking allreduce (libnbc) costs 1.4 us for 4 B and 9 us for 4 KiB on
// 2 ranks here, against 0.6 and 3.2 us for the blocking MPI_Allreduce and 0.55 and 3.0 us
// for an MPI_Isend/MPI_Irecv exchange plus the sum (measured side by side in C++; the
// engine needs non-blocking calls for stall detection, Note [Stall diagnosis]). So
// messages up to kPointToPointAllreduceMaxBytes are reduced by recursive doubling over
// point-to-point messages (allreduce_schedule.h): log2(N) exchanges of the whole message,
// which is what small messages want (latency-bound); larger ones use the transport's
// collective. Every pair of partners combines in rank order (lower ranks' partial first),
// so all ranks compute the same expressions and hold the same bits. The messages use
// tags from a range of their own (kFirstTag..), one per call in a cycle: the calls start
// in one order on every rank (they are collectives, Note [Lanes] in engine.cc), so a
// call's tag is the same everywhere and two calls in flight never match each other's
// messages (also when partners finish rounds in different orders). The description
// check before a plain collective stays an MPI collective (collectives.cc): MPI matching
// it against whatever collective another rank runs is how a rank out of step is named.
constexpr int kFirstTag = 16384;  // MPI guarantees tags up to 32767
constexpr int kTags = 16384;

class PointToPointAllreduce final : public Request {
 public:
  PointToPointAllreduce(DataPlane& plane, const std::vector<AllreduceRound>& rounds, void* data,
                        std::int64_t count, DType dtype, ReduceOp op, int tag)
      : plane_(plane),
        data_(data),
        count_(count),
        nbytes_(count * static_cast<std::int64_t>(dtype_size(dtype))),
        dtype_(dtype),
        op_(op),
        tag_(tag),
        rounds_(rounds),
        scratch_(static_cast<std::size_t>(nbytes_)) {}

  bool test() override {
    while (next_ < rounds_.size()) {
      const AllreduceRound& r = rounds_[next_];
      if (!posted_) post(r);
      if ((send_ && !send_->test()) || (recv_ && !recv_->test())) return false;
      if (r.recv_from >= 0) take(r);
      send_.reset();
      recv_.reset();
      posted_ = false;
      ++next_;
    }
    return true;
  }

 private:
  void post(const AllreduceRound& r) {
    // A folded-in rank receives the result straight into its data: it sends nothing then.
    if (r.recv_from >= 0) {
      void* into = r.result ? data_ : scratch_.data();
      recv_ = plane_.irecv(into, nbytes_, r.recv_from, tag_, &received_);
    }
    if (r.send_to >= 0) send_ = plane_.isend(data_, nbytes_, r.send_to, tag_);
    posted_ = true;
  }

  void take(const AllreduceRound& r) {
    if (received_ != nbytes_) {
      throw OutOfStepError("tnt_comm: allreduce of " + std::to_string(nbytes_) + " bytes: rank " +
                           std::to_string(r.recv_from) + " sent " +
                           (received_ < 0 ? "more" : std::to_string(received_)) +
                           " bytes, so the ranks ran different collectives at this point; every "
                           "rank must issue the same collectives in the same order.");
    }
    if (r.result) return;
    if (r.received_first) {
      reduce_ordered(scratch_.data(), data_, data_, count_, dtype_, op_);
    } else {
      reduce_ordered(data_, scratch_.data(), data_, count_, dtype_, op_);
    }
  }

  DataPlane& plane_;
  void* data_;
  std::int64_t count_, nbytes_;
  DType dtype_;
  ReduceOp op_;
  int tag_;
  const std::vector<AllreduceRound>& rounds_;  // the plane's (it outlives its requests' tasks)
  std::vector<char> scratch_;  // the partner's partial
  std::size_t next_ = 0;
  bool posted_ = false;
  std::unique_ptr<Request> send_, recv_;
  std::int64_t received_ = 0;
};

}  // namespace

std::unique_ptr<Request> point_to_point_allreduce(DataPlane& plane,
                                                  const std::vector<AllreduceRound>& rounds, void* data,
                                                  std::int64_t count, DType dtype, ReduceOp op, int tag) {
  return std::make_unique<PointToPointAllreduce>(plane, rounds, data, count, dtype, op, tag);
}

std::unique_ptr<Request> DataPlane::iallreduce(const void* send, void* recv, std::int64_t count,
                                               DType dtype, ReduceOp op) {
  const std::int64_t nbytes = count * static_cast<std::int64_t>(dtype_size(dtype));
  if (size() == 1 || nbytes > kPointToPointAllreduceMaxBytes) {
    return iallreduce_collective(send, recv, count, dtype, op);
  }
  if (send != recv) std::memcpy(recv, send, static_cast<std::size_t>(nbytes));
  const int tag = kFirstTag + static_cast<int>(small_allreduces_++ % kTags);
  if (rounds_.empty()) rounds_ = recursive_doubling(rank(), size());  // size > 1: never empty
  return point_to_point_allreduce(*this, rounds_, recv, count, dtype, op, tag);
}

}  // namespace tnt
