// The communication thread. It owns the Transport (so MPI is initialised, used and
// finalised from one thread), runs queued tasks strictly in order, and never spins a
// core while idle. Callers enqueue tasks and wait on futures with the GIL released.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "config.h"
#include "task.h"
#include "transport.h"

namespace tnt {

struct WorldInfo {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  std::string library;
};

class Engine {
 public:
  using TransportFactory = std::function<std::unique_ptr<Transport>()>;

  // Starts the thread, which creates the transport; rethrows its construction error.
  Engine(Config config, TransportFactory make_transport);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a task. After shutdown, or once a stall broke the engine, the task fails at
  // once with CommError: no waiter is ever left hanging.
  void enqueue(std::shared_ptr<Task> task);

  // Runs every queued task, then destroys the transport (MPI_Finalize) and joins.
  void shutdown();
  // MPI_Abort through the communication thread; any thread may call it.
  [[noreturn]] void abort(int code);

  const WorldInfo& world() const { return world_; }
  const Config& config() const { return config_; }
  // Non-empty once a stall made the engine unusable (the stall message).
  std::string broken() const;
  // Makes every later task fail at once with `why` (the collective sequence of the
  // ranks can no longer match, e.g. after a stall detected outside the engine).
  void mark_broken(const std::string& why);

 private:
  void loop();
  void run(Task& task);
  void wait_request(Request& request, const Task& task,
                    std::chrono::steady_clock::time_point deadline);
  [[noreturn]] void stall(const Task& task);
  // Fails `task` if a rank that left (Note [Leaving]) never started it.
  void check_departures(const Task& task);
  void fail(Task& task, const std::string& why) noexcept;

  const Config config_;
  WorldInfo world_;
  std::unique_ptr<Transport> transport_;  // touched only by thread_ (abort excepted)
  std::uint64_t seq_ = 0;                 // collectives started (Note [Stall diagnosis])

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool stopping_ = false;
  std::string broken_;
  std::atomic<int> abort_code_{-1};
  std::thread thread_;
};

}  // namespace tnt
