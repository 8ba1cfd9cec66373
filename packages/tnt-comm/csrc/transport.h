// The transport under the engine: non-blocking collectives plus a small side channel
// for stall diagnosis. MpiTransport implements it; another transport (GASPI, NCCL) can
// be added beside it without touching the engine or the fusion logic.
//
// Threading: a Transport is created, used and destroyed on the communication thread
// only (the engine guarantees it); abort() is the one call allowed from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtype.h"

namespace tnt {

// An in-flight operation. test() advances it and returns true once complete.
class Request {
 public:
  virtual ~Request() = default;
  virtual bool test() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;
  // Human-readable library name/version for diagnostics.
  virtual std::string library() const = 0;

  // All element counts are elements of `dtype` (raw-byte collectives use kBytes below).
  // `send == recv` means in place.
  virtual std::unique_ptr<Request> iallreduce(const void* send, void* recv, std::int64_t count,
                                              DType dtype, ReduceOp op) = 0;
  virtual std::unique_ptr<Request> ibcast(void* buf, std::int64_t nbytes, int root) = 0;
  // Every rank contributes `nbytes`; recv holds size() * nbytes in rank order.
  virtual std::unique_ptr<Request> iallgather(const void* send, std::int64_t nbytes,
                                              void* recv) = 0;
  // Rank r contributes counts[r] bytes; recv holds them back to back in rank order.
  virtual std::unique_ptr<Request> iallgatherv(const void* send, void* recv,
                                               const std::vector<std::int64_t>& counts) = 0;
  virtual std::unique_ptr<Request> ibarrier() = 0;

  // Side channel (see Note [Stall diagnosis] in stall.h): answer pending progress
  // queries of other ranks with `my_seq`, and ask every other rank for its sequence
  // number, waiting at most `wait`. Entry r is empty if rank r did not answer.
  virtual void serve_progress_queries(std::uint64_t my_seq) = 0;
  virtual std::vector<std::optional<std::uint64_t>> query_progress(
      std::uint64_t my_seq, std::chrono::milliseconds wait) = 0;

  // Leave notices (Note [Leaving] in engine.cc): tell every other rank that this rank
  // shuts down after starting `my_seq` collectives (once, just before the transport is
  // destroyed); and, for every rank that announced its end, how many collectives it had
  // started (entry r is empty while rank r has not left).
  virtual void announce_leaving(std::uint64_t my_seq) = 0;
  virtual const std::vector<std::optional<std::uint64_t>>& poll_departures() = 0;

  // Ends the whole job. Callable from any thread.
  [[noreturn]] virtual void abort(int code) = 0;
  // Called instead of a clean shutdown when a collective can never complete (after a
  // stall): the destructor must then not wait for it (no MPI_Finalize).
  virtual void mark_unclean() = 0;
};

}  // namespace tnt
