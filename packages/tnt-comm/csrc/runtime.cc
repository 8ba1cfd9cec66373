#include "runtime.h"

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include <pthread.h>
#include <unistd.h>

#include "errors.h"
#include "mpi_transport.h"

namespace tnt {
namespace {

std::mutex g_mu;
std::unique_ptr<Engine> g_engine;
bool g_finalized = false;

// Set in every child forked after start-up (pthread_atfork): getpid() is a system call
// (glibc no longer caches it), ~0.5 us per collective on a VM; this flag is a load.
std::atomic<bool> g_forked{false};
void on_fork_child() { g_forked.store(true, std::memory_order_relaxed); }

// Note [Fork]: a forked child inherits the engine's memory but not its thread, so any
// call would wait forever for a thread that does not exist; and MPI cannot be used in
// the child either. Every entry point checks the process id first (once a fork happened).
void check_not_forked(const Engine& engine) {
  if (g_forked.load(std::memory_order_relaxed) && engine.pid() != ::getpid()) {
    throw CommError(
        "tnt_comm was initialised in process " + std::to_string(engine.pid()) +
        " and this is a forked child (pid " + std::to_string(::getpid()) +
        "): MPI and tnt_comm's communication thread do not survive fork(). Communicate only "
        "from the parent process; for worker processes use multiprocessing's 'spawn' or "
        "'forkserver' start method, or fork before the first tnt_comm call.");
  }
}

}  // namespace

void runtime_init() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine) {
    check_not_forked(*g_engine);
    return;
  }
  if (g_finalized) {
    throw CommError("tnt_comm.finalize() was already called; MPI cannot be restarted in this process");
  }
  static const bool fork_watched = ::pthread_atfork(nullptr, nullptr, &on_fork_child) == 0;
  if (!fork_watched) g_forked.store(true);  // cannot watch: check the pid on every call
  auto engine = std::make_unique<Engine>(load_config(), &make_mpi_control);
  try {
    engine->wait_started();
  } catch (const StallError&) {
    (void)engine.release();  // its thread is stuck inside MPI start-up: never free it
    throw;
  }
  g_engine = std::move(engine);
}

Engine& runtime_engine() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_engine) {
      check_not_forked(*g_engine);
      return *g_engine;
    }
  }
  runtime_init();
  std::lock_guard<std::mutex> lock(g_mu);
  return *g_engine;
}

void runtime_finalize() {
  std::unique_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_engine) return;
    if (g_engine->pid() != ::getpid()) {  // a forked child: its copy has no thread to stop
      (void)g_engine.release();
      return;
    }
    engine = std::move(g_engine);
    g_finalized = true;
  }
  engine->shutdown();
  // Deliberately leaked: objects still referencing the engine (a FusedAllreduce kept
  // alive past finalize) then fail cleanly through its stopped queue instead of
  // touching freed memory.
  (void)engine.release();
}

bool runtime_is_initialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<bool>(g_engine);
}

void runtime_abort(int code) {
  Engine* engine = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    engine = g_engine.get();
  }
  if (engine != nullptr && engine->pid() == ::getpid()) engine->abort(code);
  std::_Exit(code);
}

}  // namespace tnt
