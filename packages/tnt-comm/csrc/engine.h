// The communication thread. It owns the ControlPlane and every communicator's DataPlane
// (so MPI is initialised and finalised on one thread), starts queued tasks in order,
// keeps several in flight, and never spins a core while nobody waits. Callers enqueue
// tasks and wait on futures with the GIL released (Engine::await); a caller about to
// block drives the requests itself for a short while (Note [Waiter drives]), one driver
// at a time, so MPI is never called from two threads at once.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "comm.h"
#include "config.h"
#include "task.h"
#include "transport.h"

namespace tnt {

struct WorldInfo {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  std::string library;
};

using Clock = std::chrono::steady_clock;

class Engine {
 public:
  using ControlFactory = std::function<std::unique_ptr<ControlPlane>()>;

  // Starts the thread, which starts the transport (MPI_Init) and the world communicator.
  Engine(Config config, ControlFactory make_control);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Waits for the start-up; rethrows its error. If it takes longer than the timeout (a
  // rank never started, so MPI_Init or the world duplicate waits for it) throws
  // StallError: the thread stays stuck, so the caller must then leak the engine.
  void wait_started();

  // Queues a task. After shutdown, or once a stall broke the engine, the task fails at
  // once with CommError: no waiter is ever left hanging. `wake` = false leaves a task a
  // caller is about to wait for (and drive) to that caller, without waking the thread
  // (Note [Last bucket] in fused.cc); the thread still takes it within
  // kIdleServiceInterval if nobody does. Only tasks a driver may start qualify.
  void enqueue(std::shared_ptr<Task> task, bool wake = true);
  // True if a waiting caller drives (TNT_COMM_DRIVE_SPIN_US > 0).
  bool waiters_drive() const { return config_.drive_spin_us > 0.0; }
  // Waits for a task's future (GIL released by the caller). While a caller waits, the
  // thread completes requests without sleeping (Note [Polling]). Throws StallError if
  // the thread itself stops answering (stuck in a blocking MPI call) for the timeout.
  void await(std::future<void>& done, const std::string& what);
  // enqueue() + await(); the caller drives the task itself where it can (Note [Waiter
  // drives]), else one lock and one wake-up of the thread.
  // The task's describe() is called only if a message needs it (a stall).
  void run(std::shared_ptr<Task> task, std::future<void>& done);
  // Note [Waiter drives]: a caller about to block until `ready()` runs the thread's work
  // itself (queueing `task` first, if given and not null) for up to TNT_COMM_DRIVE_SPIN_US
  // after the last progress. True once `ready()`; false if it did not drive (disabled,
  // another caller drives, shutdown, broken, a thread_only() task) or stopped: then the
  // thread carries on, `task` is null if it was queued, and the caller waits as before.
  bool drive(std::shared_ptr<Task>& task, const std::function<bool()>& ready);

  // True when the thread has not looped for the timeout (stuck in a blocking MPI call).
  bool thread_stuck() const;

  // Runs every queued task, then destroys the communicators and the transport
  // (MPI_Finalize) and joins.
  void shutdown();
  // MPI_Abort through the communication thread; any thread may call it.
  [[noreturn]] void abort(int code);

  const WorldInfo& world() const { return world_; }
  const std::shared_ptr<Comm>& world_comm() const { return world_comm_; }
  const Config& config() const { return config_; }
  pid_t pid() const { return pid_; }
  // Non-empty once a stall made the engine unusable (the stall message).
  std::string broken() const;
  // Makes every later task fail at once with `why` (the collective sequence of the
  // ranks can no longer match, e.g. after a stall detected outside the engine).
  void mark_broken(const std::string& why);
  // A communicator derived on the communication thread (split, dup): served, announced
  // at leave, and destroyed before the transport. The driver only (drive_mu_ held).
  void adopt(const std::shared_ptr<Comm>& comm) { comms_.push_back(comm); }

  // Note [Long local work]: while > 0, this rank tells ranks waiting for it that it is
  // busy on purpose (e.g. the master writing a checkpoint), so they keep waiting.
  void begin_local_work();
  // A caller blocked on a result, for the lifetime of this object (Note [Polling]).
  class Waiting {
   public:
    explicit Waiting(Engine& e);
    Waiting(Engine& e, std::shared_ptr<Task> task);  // also enqueues `task`
    ~Waiting();
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;

   private:
    Engine& e_;
  };
  void end_local_work();

  // One in-flight task (public for the helpers in engine.cc).
  struct Active {
    std::shared_ptr<Task> task;
    std::unique_ptr<Request> request;
    std::chrono::steady_clock::time_point deadline;
    std::uint64_t seq = 0;  // its number on its communicator (collectives)
  };

 private:
  void loop();
  // Moves the tasks that may start now from queue_ to `out` (Note [Lanes]). Without
  // `with_thread_only`, a thread_only() task stays queued and sets *skipped.
  void take_startable(std::vector<std::shared_ptr<Task>>& out, bool with_thread_only = true,
                      bool* skipped = nullptr);
  // Starts `starting` and advances every active task: true if any made progress.
  bool step_active(std::vector<std::shared_ptr<Task>>& starting);
  // Fails or extends the tasks past their deadline; drops the ended ones.
  void check_deadlines(Clock::time_point now);
  void drop_ended();  // removes the tasks that ended (task == nullptr) from active_
  void start(std::shared_ptr<Task> task);
  bool advance(Active& a);  // true once the task is finished
  void fail_task(Active& a, std::exception_ptr error);
  void on_deadline(Active& a);
  void check_departures(const Active& a);
  void serve();
  Progress progress_of(std::uint64_t comm_id) const;
  void break_all(const std::string& why);
  void fail(Task& task, const std::string& why) noexcept;
  bool admit(std::shared_ptr<Task>& task, std::string& why, bool wake = true);  // with mu_ held
  void wait_for(std::future<void>& done, const std::function<std::string()>& what);
  // Spins (bounded) for work after a task a caller waited for completed; false if none came.
  bool spin_for_work(std::unique_lock<std::mutex>& lock, Clock::time_point until);
 public:
  // TNT_COMM_HANDOFF_SPIN_US if set; else 30 us where every rank on the host has a spare
  // core, 0 where not (Note [Hand-off]).
  double handoff_spin_us() const;

 private:
  void finish_shutdown();

  const Config config_;
  const pid_t pid_;
  WorldInfo world_;
  std::shared_ptr<Comm> world_comm_;
  std::future<void> started_;
  // Held by whoever drives the requests (Note [Waiter drives]): the thread, or a caller.
  std::mutex drive_mu_;
  std::atomic<int> drivers_{0};  // callers driving or about to (the thread then sleeps)
  // The driver's only (drive_mu_ held; abort excepted: hard_abort_ is set before the
  // thread publishes the start-up and never changes):
  std::unique_ptr<ControlPlane> control_;
  std::vector<std::shared_ptr<Comm>> comms_;
  std::vector<Active> active_;
  // Note [Buffers outlive requests]: tasks whose requests may still be posted after a
  // stall; never destroyed (their buffers stay valid while MPI may touch them).
  std::vector<Active> graveyard_;
  std::atomic<ControlPlane::HardAbort> hard_abort_{nullptr};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool stopping_ = false;
  std::string broken_;
  std::atomic<bool> is_broken_{false};  // broken_ is set (read without mu_)
  std::vector<const Comm*> blocked_;    // take_startable's scratch (mu_)
  int abort_code_ = -1;
  std::atomic<int> waiting_{0};  // callers blocked in await(); raised under mu_
  // Raised (under mu_) by everything that gives the thread work or a reason to look: a
  // new task, a new waiter, shutdown, abort. The idle spin watches it (Note [Hand-off]).
  std::atomic<std::uint64_t> pokes_{0};
  std::atomic<int> local_work_{0};
  std::atomic<std::int64_t> heartbeat_ns_{0};  // last loop iteration of the thread
  std::thread thread_;
};

}  // namespace tnt
