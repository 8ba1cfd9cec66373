#include "runtime.h"

#include <cstdlib>
#include <memory>
#include <mutex>

#include "errors.h"
#include "mpi_transport.h"

namespace tnt {
namespace {

std::mutex g_mu;
std::unique_ptr<Engine> g_engine;
bool g_finalized = false;

}  // namespace

void runtime_init() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine) return;
  if (g_finalized) {
    throw CommError("tnt_comm.finalize() was already called; MPI cannot be restarted in this process");
  }
  g_engine = std::make_unique<Engine>(load_config(), &make_mpi_transport);
}

Engine& runtime_engine() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_engine) return *g_engine;
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
  if (engine != nullptr) engine->abort(code);
  std::_Exit(code);
}

}  // namespace tnt
