// A unit of work for the communication thread: one logical operation (a collective, a
// send, a receive) on one communicator, made of one or more non-blocking steps (e.g. a
// metadata exchange, then the data). Tasks start in enqueue order; several may be in
// flight at once (Note [Lanes] in engine.cc).
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm.h"
#include "transport.h"

namespace tnt {

// Note [Waiter drives] in engine.cc: a waiting caller starts only tasks up to this size.
// MPI allocates temporary buffers of the message's size when a collective starts; above
// glibc's mmap threshold, on a caller's thread (main arena) they were mapped and unmapped
// on every call: measured on 2 ranks, a 1 MiB allreduce took 1.2-1.7 ms with 225 page
// faults per call, 0.3-0.4 ms started by the thread. Latency matters only below this.
inline constexpr std::int64_t kDriveMaxBytes = 64 * 1024;

enum class Lane {
  kCollective,  // started in one order on every member; counted in Comm::seq
  kPointToPoint,  // ordered only among this rank's own messages
};

class Task {
 public:
  explicit Task(std::shared_ptr<Comm> comm) : comm_(std::move(comm)) {}
  virtual ~Task() = default;
  // Names the operation in error messages, e.g. "allreduce(float32[1000], SUM)".
  virtual std::string describe() const = 0;
  virtual Lane lane() const { return Lane::kCollective; }
  // Issues the next non-blocking step; nullptr once the task is complete. May throw.
  virtual std::unique_ptr<Request> next(DataPlane& data) = 0;
  // True while next() may still start a collective on the communicator: later
  // collectives of that communicator wait until it is false.
  virtual bool more_collective_steps() const = 0;
  // Called exactly once, by the engine's complete(): nullptr on success.
  virtual void finish(std::exception_ptr error) noexcept = 0;
  // finish(), then a flag a driver polls instead of the future: future::wait_for(0) and
  // friends cost clock reads and, in some libstdc++ versions, a futex call per poll.
  void complete(std::exception_ptr error) noexcept {
    finish(std::move(error));
    completed_.store(true, std::memory_order_release);
  }
  bool completed() const { return completed_.load(std::memory_order_acquire); }
  // For stall messages about point-to-point tasks: the peer's rank, or -1.
  virtual int peer() const { return -1; }
  // True if only the communication thread may start it (Note [Waiter drives] in
  // engine.cc): a step makes a blocking MPI call (split), or it moves more than
  // kDriveMaxBytes.
  virtual bool thread_only() const { return false; }

  Comm& comm() const { return *comm_; }
  const std::shared_ptr<Comm>& comm_ptr() const { return comm_; }

 private:
  std::shared_ptr<Comm> comm_;
  std::atomic<bool> completed_{false};
};

// Two requests completed together (e.g. a message's envelope and its payload).
class BothRequest final : public Request {
 public:
  BothRequest(std::unique_ptr<Request> a, std::unique_ptr<Request> b)
      : a_(std::move(a)), b_(std::move(b)) {}
  bool test() override {
    const bool a = a_->test();
    const bool b = b_->test();
    return a && b;
  }

 private:
  std::unique_ptr<Request> a_, b_;
};

// A task given as a list of steps, completed through a future. A step returns the
// request it started, or nullptr if it did only local work.
class StepTask final : public Task {
 public:
  using Step = std::function<std::unique_ptr<Request>(DataPlane&)>;

  using Describe = std::function<std::string()>;

  StepTask(std::shared_ptr<Comm> comm, std::string what, std::vector<Step> steps)
      : Task(std::move(comm)), what_(std::move(what)), steps_(std::move(steps)) {}
  // The description built only when a message needs it (formatting shapes costs more
  // than a small collective).
  StepTask(std::shared_ptr<Comm> comm, Describe describe, std::vector<Step> steps)
      : Task(std::move(comm)), describe_(std::move(describe)), steps_(std::move(steps)) {}

  std::future<void> future() { return done_.get_future(); }
  std::string describe() const override { return describe_ ? describe_() : what_; }
  Lane lane() const override { return peer_ < 0 ? Lane::kCollective : Lane::kPointToPoint; }
  int peer() const override { return peer_; }
  // Makes it a point-to-point task with `peer` (its first step issues all its requests).
  void set_peer(int peer) { peer_ = peer; }
  bool thread_only() const override { return thread_only_; }
  void set_thread_only() { thread_only_ = true; }
  // Leaves it to the thread if it moves more than kDriveMaxBytes.
  void set_payload_bytes(std::int64_t nbytes) {
    if (nbytes > kDriveMaxBytes) thread_only_ = true;
  }

  std::unique_ptr<Request> next(DataPlane& data) override {
    while (next_step_ < steps_.size()) {
      if (auto r = steps_[next_step_++](data)) return r;
    }
    return nullptr;
  }
  bool more_collective_steps() const override { return next_step_ < steps_.size(); }

  void finish(std::exception_ptr error) noexcept override {
    if (error) {
      done_.set_exception(error);
    } else {
      done_.set_value();
    }
  }

 private:
  std::string what_;
  Describe describe_;
  std::vector<Step> steps_;
  std::size_t next_step_ = 0;
  int peer_ = -1;
  bool thread_only_ = false;
  std::promise<void> done_;
};

}  // namespace tnt
