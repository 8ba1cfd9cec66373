// The transport under the engine, in two planes (MpiDataPlane / MpiControlPlane implement
// them; another transport, GASPI or NCCL, can be added beside them without touching the
// engine or the fusion logic):
//   DataPlane    - one communicator's traffic: non-blocking collectives, point-to-point,
//                  and deriving communicators from it (dup, split).
//   ControlPlane - the process: start-up, the private world DataPlane, the side channel
//                  for stall diagnosis and leave notices, and abort.
//
// Threading: both are created, used and destroyed on the communication thread only (the
// engine guarantees it); hard_abort() is the one call allowed from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "allreduce_schedule.h"
#include "check_block.h"
#include "dtype.h"

namespace tnt {

// An in-flight operation. test() advances it and returns true once complete. The
// memory it reads or writes must stay valid until then (the engine keeps the owning
// task alive, also after a stall: Note [Buffers outlive requests] in engine.cc).
class Request {
 public:
  virtual ~Request() = default;
  virtual bool test() = 0;
};

class DataPlane {
 public:
  virtual ~DataPlane() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // World rank of every member, in this communicator's rank order.
  virtual std::vector<int> world_ranks() const = 0;

  // All element counts are elements of `dtype` (raw-byte collectives count bytes).
  // Counts above 2^31-1 are split into chunks (Note [Large counts] in mpi_transport.cc).
  // `send == recv` means in place.
  //
  // The data of an allreduce: small messages point-to-point (Note [Small allreduce] in
  // p2p_allreduce.cc), larger ones through iallreduce_collective. Call it in one order
  // on every rank, as every collective.
  std::unique_ptr<Request> iallreduce(const void* send, void* recv, std::int64_t count,
                                      DType dtype, ReduceOp op);
  // The description check (Note [Description check] in collectives.cc): out = the
  // combine_check_blocks reduction of every rank's block, lower ranks first. One
  // collective of the transport's own, which it matches against whatever collective
  // another rank runs at this point: a rank out of step is named from what comes back.
  virtual std::unique_ptr<Request> icheck(const CheckBlock* in, CheckBlock* out) = 0;
  // Always the transport's own collective.
  virtual std::unique_ptr<Request> iallreduce_collective(const void* send, void* recv,
                                                         std::int64_t count, DType dtype,
                                                         ReduceOp op) = 0;
  virtual std::unique_ptr<Request> ibcast(void* buf, std::int64_t nbytes, int root) = 0;
  // Every rank contributes `nbytes`; recv holds size() * nbytes in rank order.
  virtual std::unique_ptr<Request> iallgather(const void* send, std::int64_t nbytes,
                                              void* recv) = 0;
  // Rank r contributes counts[r] bytes; recv holds them back to back in rank order.
  virtual std::unique_ptr<Request> iallgatherv(const void* send, void* recv,
                                               const std::vector<std::int64_t>& counts) = 0;
  // Rank r receives counts[r] elements of `dtype`: the reduction over ranks of the r-th
  // block of `send` (the blocks back to back in rank order, sum(counts) elements).
  virtual std::unique_ptr<Request> ireduce_scatter(const void* send, void* recv,
                                                   const std::vector<std::int64_t>& counts,
                                                   DType dtype, ReduceOp op) = 0;
  virtual std::unique_ptr<Request> ibarrier() = 0;

  // Point-to-point on `tag`: messages between two ranks on one tag arrive in send order.
  // A receive of a larger message than `capacity` completes with the first `capacity`
  // bytes; *received holds the sender's size (so a mismatch can be reported, never a
  // hang or an MPI error that would break the communicator).
  virtual std::unique_ptr<Request> isend(const void* buf, std::int64_t nbytes, int dest,
                                         int tag) = 0;
  virtual std::unique_ptr<Request> irecv(void* buf, std::int64_t capacity, int source, int tag,
                                         std::int64_t* received) = 0;

  // A private duplicate (MPI_Comm_dup). Blocking: call it only once every member is
  // known to have arrived (Note [Blocking dup]).
  virtual std::unique_ptr<DataPlane> dup() = 0;
  // MPI_Comm_split. Blocking: call it only once every member is known to have arrived.
  virtual std::unique_ptr<DataPlane> split(int color, int key) = 0;

 private:
  std::uint32_t small_allreduces_ = 0;  // picks each point-to-point allreduce's tag
  std::vector<AllreduceRound> rounds_;  // this rank's recursive doubling, made once
};

// A rank's answer to a progress query about one communicator.
struct Progress {
  std::uint64_t seq = 0;   // collectives it started on that communicator
  bool busy = false;       // inside long_local_work(): slow on purpose, not stuck
};

class ControlPlane {
 public:
  virtual ~ControlPlane() = default;

  virtual int world_rank() const = 0;
  virtual int world_size() const = 0;
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;
  // Human-readable library name/version for diagnostics.
  virtual std::string library() const = 0;
  // A private duplicate of the world for tnt_comm's own traffic (called once).
  virtual std::unique_ptr<DataPlane> make_world() = 0;

  // Side channel (see Note [Stall diagnosis] in stall.h). Communicators are named by
  // their id (same on every member). serve_progress_queries answers pending queries of
  // other ranks through `answer`; query_progress asks the world ranks `peers` about
  // communicator `comm_id`, waiting at most `wait`. Entry i is empty if peers[i] did not
  // answer.
  using Answer = std::function<Progress(std::uint64_t comm_id)>;
  virtual void serve_progress_queries(const Answer& answer) = 0;
  virtual std::vector<std::optional<Progress>> query_progress(
      std::uint64_t comm_id, const std::vector<int>& peers, const Answer& answer,
      std::chrono::milliseconds wait) = 0;

  // Leave notices (Note [Leaving] in engine.cc): tell the world ranks `peers` that this
  // rank shuts down after starting `seq` collectives on communicator `comm_id`; and,
  // per (communicator id, world rank) that announced its end, that number.
  struct Leaving {
    std::uint64_t comm_id;
    std::uint64_t seq;
    std::vector<int> peers;
  };
  virtual void announce_leaving(const std::vector<Leaving>& comms) = 0;
  using Departures = std::map<std::pair<std::uint64_t, int>, std::uint64_t>;
  virtual const Departures& poll_departures() = 0;

  // Called instead of a clean shutdown when a request can never complete (after a
  // stall): the destructor must then not wait for it (no MPI_Finalize).
  virtual void mark_unclean() = 0;
  // Ends the whole job; callable from any thread, also while the communication thread
  // is stuck inside the library.
  using HardAbort = void (*)(int code);
  virtual HardAbort hard_abort() const = 0;
};

}  // namespace tnt
