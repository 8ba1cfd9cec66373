#include "fused.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "arith.h"
#include "config.h"
#include "errors.h"
#include "spin.h"
#include "task.h"

namespace tnt {

struct FusedAllreduce::State {
  struct BucketState {
    std::shared_ptr<FusionBuffer> buffer;
    std::int64_t pending = 0;  // tensors still to be submitted this round
    bool buffer_armed = false;  // buffer chosen for this round (first tensor arrived)
    bool launched = false;
    bool done = false;
    bool taken = false;  // handed out by wait_bucket() this round
    std::exception_ptr error;
  };

  Engine* engine = nullptr;
  std::shared_ptr<Comm> comm;
  std::vector<TensorSpec> specs;
  Plan plan;
  FusionLayout layout;
  ReduceOp op = ReduceOp::kSum;

  std::mutex launch_mu;  // serialises cursor advance + enqueue: plan order is kept
  std::mutex mu;         // guards everything below
  std::condition_variable cv;
  std::vector<BucketState> buckets;
  std::vector<char> submitted;
  std::size_t next_bucket = 0;  // position in launch_order of the next bucket to launch
  std::vector<std::size_t> launch_order;  // Note [Large buckets first]
  std::size_t done_count = 0;
  std::atomic<std::size_t> finished{0};  // done_count, readable without mu (the caller's spin)
  std::unique_ptr<std::atomic<bool>[]> bucket_done;  // buckets[b].done, readable without mu
  std::size_t taken_count = 0;  // buckets handed out by wait_bucket() this round
  bool closed = false;
  std::string broken;

  std::string tensor_name(std::int64_t i) const {
    return "tensor " + std::to_string(i) + " ('" + specs[static_cast<std::size_t>(i)].name + "')";
  }

  void arm_round() {
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      auto& bs = buckets[b];
      bs.pending = static_cast<std::int64_t>(layout.buckets[b].tensors.size());
      bs.launched = bs.done = bs.buffer_armed = bs.taken = false;
      bs.error = nullptr;
      bucket_done[b].store(false, std::memory_order_relaxed);
    }
    taken_count = 0;
    std::fill(submitted.begin(), submitted.end(), 0);
    next_bucket = 0;
    done_count = 0;
    finished.store(0, std::memory_order_relaxed);
  }
};

namespace {

class BucketTask final : public Task {
 public:
  BucketTask(std::shared_ptr<FusedAllreduce::State> s, std::size_t b,
             std::shared_ptr<FusionBuffer> buf)
      : Task(s->comm), s_(std::move(s)), b_(b), buf_(std::move(buf)) {}

  std::string describe() const override {
    const BucketLayout& bl = s_->layout.buckets[b_];
    std::ostringstream m;
    m << "FusedAllreduce bucket " << b_ << " of " << s_->layout.buckets.size() << " ("
      << dtype_name(bl.dtype) << ", " << bl.count << " elements, " << op_name(s_->op)
      << "; tensors:";
    std::size_t shown = 0;
    for (const auto t : bl.tensors) {
      if (shown++ == 8) {
        m << " ... " << bl.tensors.size() - 8 << " more";
        break;
      }
      m << " " << t << " '" << s_->specs[static_cast<std::size_t>(t)].name << "'";
    }
    m << ")";
    return m.str();
  }

  bool more_collective_steps() const override { return !issued_; }
  bool thread_only() const override { return s_->layout.buckets[b_].nbytes() > kDriveMaxBytes; }

  std::unique_ptr<Request> next(DataPlane& t) override {
    if (issued_) return nullptr;
    issued_ = true;
    const BucketLayout& bl = s_->layout.buckets[b_];
    if (s_->op == ReduceOp::kAvg && avg_scales_first(bl.dtype)) {  // Note [AVG scaling]
      divide_inplace(buf_->data(), bl.count, bl.dtype, s_->comm->size);
      return t.iallreduce(buf_->data(), buf_->data(), bl.count, bl.dtype, ReduceOp::kSum);
    }
    return t.iallreduce(buf_->data(), buf_->data(), bl.count, bl.dtype, s_->op);
  }

  void finish(std::exception_ptr error) noexcept override {
    // The reduction is over: let go of the bucket before reporting it done, so that once a
    // caller has seen the round finish only the engine and its holders count (a copy kept
    // here until the thread destroyed the task made reuse_or_allocate see a stale count and
    // allocate afresh: under load, on every round).
    buf_.reset();
    std::lock_guard<std::mutex> lock(s_->mu);
    auto& bs = s_->buckets[b_];
    bs.done = true;
    bs.error = error;
    ++s_->done_count;
    s_->bucket_done[b_].store(true, std::memory_order_release);
    s_->finished.store(s_->done_count, std::memory_order_release);
    s_->cv.notify_all();
  }

 private:
  std::shared_ptr<FusedAllreduce::State> s_;
  std::size_t b_;
  std::shared_ptr<FusionBuffer> buf_;
  bool issued_ = false;
};

std::uint64_t fnv1a(std::uint64_t h, std::int64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= static_cast<std::uint64_t>(v >> (8 * i)) & 0xffu;
    h *= 1099511628211ull;
  }
  return h;
}

// All ranks must agree on counts, dtypes, threshold and op (names may differ).
void verify_same_everywhere(Engine& engine, const std::shared_ptr<Comm>& comm,
                            const std::vector<TensorSpec>& specs, std::int64_t threshold,
                            ReduceOp op, std::int64_t align) {
  struct Sig {
    std::uint64_t hash;
    std::int64_t n;
    std::int64_t elements;
  };
  auto mine = std::make_shared<Sig>();
  auto all = std::make_shared<std::vector<Sig>>();
  std::uint64_t h = 14695981039346656037ull;
  h = fnv1a(h, threshold);
  h = fnv1a(h, static_cast<std::int64_t>(op));
  h = fnv1a(h, align);
  std::int64_t elements = 0;
  for (const auto& s : specs) {
    h = fnv1a(fnv1a(h, s.count), static_cast<std::int64_t>(s.dtype));
    elements += s.count;
  }
  *mine = {h, static_cast<std::int64_t>(specs.size()), elements};
  std::vector<StepTask::Step> steps;
  steps.push_back([mine, all](DataPlane& t) {
    all->resize(static_cast<std::size_t>(t.size()));
    return t.iallgather(mine.get(), sizeof(Sig), all->data());
  });
  steps.push_back([all](DataPlane&) -> std::unique_ptr<Request> {
    std::ostringstream differ;
    bool bad = false;
    for (std::size_t r = 0; r < all->size(); ++r) {
      if ((*all)[r].hash != all->front().hash) bad = true;
      differ << (r ? "; " : "") << "rank " << r << ": " << (*all)[r].n << " tensors, "
             << (*all)[r].elements << " elements";
    }
    if (bad) {
      throw std::invalid_argument(
          "FusedAllreduce: the tensor specs, threshold_bytes, op or slot_alignment differ across "
          "ranks (" +
          differ.str() +
          "). Every rank must build it from the same ordered list of (count, dtype), e.g. the "
          "model's trainable weights in the same order.");
    }
    return nullptr;
  });
  auto task = std::make_shared<StepTask>(comm, "FusedAllreduce construction (spec check)",
                                         std::move(steps));
  auto done = task->future();
  engine.run(std::move(task), done);
}

}  // namespace

// Note [Large buckets first]
// Buckets are launched in one order on every rank; that order used to be the plan's (by
// first tensor). But models interleave large tensors with small ones (a layer's kernel and
// its bias), and TensorFlow computes the small gradients last: measured on an MLP, every
// bucket holding a bias was submitted at the end of backprop, so no bucket could start
// before backprop ended and every bucket of the round was alive at once (tarantella's
// docs/memory.md). So buckets larger than the threshold (each one tensor) launch first,
// in plan order, then the others, in plan order: each large tensor goes on the wire as
// soon as it is submitted. Which tensors share a bucket is unchanged (the plan, Note
// [Bucket rule]), so every reduction sums the same bytes as before; only their order in
// time differs. A pure function of the layout and threshold: the same on every rank.
static std::vector<std::size_t> large_first_order(const FusionLayout& layout, const std::vector<TensorSpec>& specs,
                                                  std::int64_t threshold_bytes) {
  // Large: one tensor over the threshold (its own bucket by the bucket rule). Not the
  // bucket's size, which counts the alignment padding between small tensors.
  const auto large = [&](const BucketLayout& bl) {
    return bl.tensors.size() == 1 && specs[static_cast<std::size_t>(bl.tensors.front())].nbytes() > threshold_bytes;
  };
  std::vector<std::size_t> order;
  order.reserve(layout.buckets.size());
  for (const bool want : {true, false}) {
    for (std::size_t b = 0; b < layout.buckets.size(); ++b) {
      if (large(layout.buckets[b]) == want) order.push_back(b);
    }
  }
  return order;
}

// Note [One communicator per engine]
// Buckets of one engine start in plan order on every rank, but two engines used at once
// are submitted to in whatever order the caller's threads reach them: rank 0 may start
// engine A's bucket while rank 1 starts engine B's. On one communicator MPI would match
// those two collectives against each other and silently add the wrong buffers. So every
// engine reduces over its own communicator (by default a duplicate of the world made at
// construction), and engines can never cross.
FusedAllreduce::FusedAllreduce(Engine& engine, std::shared_ptr<Comm> comm,
                               std::vector<TensorSpec> specs, std::int64_t threshold_bytes,
                               ReduceOp op, std::int64_t slot_align_bytes)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.engine = &engine;
  s.comm = std::move(comm);
  s.plan = plan_buckets(specs, threshold_bytes);
  s.layout = make_layout(specs, s.plan, slot_align_bytes);
  s.specs = std::move(specs);
  s.launch_order = large_first_order(s.layout, s.specs, threshold_bytes);
  s.op = op;
  if (op == ReduceOp::kAvg) {
    for (const auto& b : s.layout.buckets) {
      check_avg(b.dtype, "FusedAllreduce: integer tensor '" +
                             s.specs[static_cast<std::size_t>(b.tensors.front())].name + "'");
    }
  }
  s.buckets.resize(s.plan.size());
  s.bucket_done = std::make_unique<std::atomic<bool>[]>(s.plan.size());
  s.submitted.assign(s.specs.size(), 0);
  s.arm_round();
  verify_same_everywhere(engine, s.comm, s.specs, threshold_bytes, op, slot_align_bytes);
}

FusedAllreduce::~FusedAllreduce() { close(); }

const Plan& FusedAllreduce::plan() const { return state_->plan; }
const std::vector<std::size_t>& FusedAllreduce::launch_order() const { return state_->launch_order; }
const FusionLayout& FusedAllreduce::layout() const { return state_->layout; }
const std::vector<TensorSpec>& FusedAllreduce::specs() const { return state_->specs; }

void FusedAllreduce::submit(std::int64_t index, const void* data, std::int64_t count, DType dtype) {
  submit_many({Item{index, data, count, dtype}});
}

void FusedAllreduce::submit_many(const std::vector<Item>& items) {
  State& s = *state_;
  const auto n_specs = static_cast<std::int64_t>(s.specs.size());
  for (const Item& it : items) {
    if (it.index < 0 || it.index >= n_specs) {
      throw std::out_of_range("FusedAllreduce.submit: index " + std::to_string(it.index) +
                              " is out of range for " + std::to_string(n_specs) + " tensors");
    }
    const TensorSpec& spec = s.specs[static_cast<std::size_t>(it.index)];
    if (it.count != spec.count || it.dtype != spec.dtype) {
      throw std::invalid_argument("FusedAllreduce.submit: " + s.tensor_name(it.index) + " expects " +
                                  std::to_string(spec.count) + " " + dtype_name(spec.dtype) +
                                  " values, got " + std::to_string(it.count) + " " +
                                  dtype_name(it.dtype));
    }
  }
  std::vector<std::byte*> targets(items.size());
  std::vector<std::shared_ptr<FusionBuffer>> keep_alive;  // buffers stay valid while copying
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.closed) throw CommError("FusedAllreduce.submit: the engine was closed");
    if (!s.broken.empty()) throw CommError("FusedAllreduce is unusable: " + s.broken);
    for (std::size_t k = 0; k < items.size(); ++k) {
      const auto i = static_cast<std::size_t>(items[k].index);
      if (s.submitted[i]) {
        for (std::size_t j = 0; j < k; ++j) s.submitted[static_cast<std::size_t>(items[j].index)] = 0;
        throw std::invalid_argument(
            "FusedAllreduce.submit: " + s.tensor_name(items[k].index) +
            " was already submitted in this round; submit each tensor once between wait() calls");
      }
      s.submitted[i] = 1;
    }
    for (std::size_t k = 0; k < items.size(); ++k) {
      const TensorSlot& slot = s.layout.slots[static_cast<std::size_t>(items[k].index)];
      const auto b = static_cast<std::size_t>(slot.bucket);
      auto& bs = s.buckets[b];
      if (!bs.buffer_armed) {  // first tensor of this bucket in this round
        bs.buffer = reuse_or_allocate(bs.buffer, static_cast<std::size_t>(s.layout.buckets[b].nbytes()));
        bs.buffer_armed = true;
      }
      if (keep_alive.empty() || keep_alive.back() != bs.buffer) keep_alive.push_back(bs.buffer);
      targets[k] = bs.buffer->data() + slot.offset * static_cast<std::int64_t>(dtype_size(items[k].dtype));
    }
  }
  for (std::size_t k = 0; k < items.size(); ++k) {
    if (items[k].count > 0) {
      std::memcpy(targets[k], items[k].data,
                  static_cast<std::size_t>(items[k].count) * dtype_size(items[k].dtype));
    }
  }
  // Launch every bucket that is complete and next in plan order.
  std::lock_guard<std::mutex> launch(s.launch_mu);
  std::vector<std::shared_ptr<Task>> ready;
  bool round_complete = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    for (const Item& it : items) {
      --s.buckets[static_cast<std::size_t>(s.layout.slots[static_cast<std::size_t>(it.index)].bucket)].pending;
    }
    while (s.next_bucket < s.buckets.size() && s.buckets[s.launch_order[s.next_bucket]].pending == 0) {
      const std::size_t b = s.launch_order[s.next_bucket];
      auto& nb = s.buckets[b];
      nb.launched = true;
      ready.push_back(std::make_shared<BucketTask>(state_, b, nb.buffer));
      ++s.next_bucket;
    }
    round_complete = s.next_bucket == s.buckets.size();
  }
  // Note [Last bucket]
  // The bucket that completes a round is almost always followed at once by wait() (the
  // end of backprop, or a round of small tensors): that caller drives it (Note [Waiter
  // drives] in engine.cc). Waking the thread for it as well cost two context switches
  // and a futex wake per round, and on a core shared with the caller the thread's turn
  // delayed the wait. So it is queued without a wake-up (if a caller may drive it; the
  // thread takes it within kIdleServiceInterval if nobody waits). Earlier buckets wake
  // the thread: they overlap with the rest of backprop.
  for (std::size_t k = 0; k < ready.size(); ++k) {
    s.engine->enqueue(std::move(ready[k]), !(round_complete && k + 1 == ready.size()));
  }
}

std::vector<FusedResult> FusedAllreduce::wait() { return wait_round(false); }

std::vector<FusedResult> FusedAllreduce::wait_buckets() { return wait_round(true); }

// Blocks until `ready_fast()` (read without the lock) and `ready_locked()` (under s.mu) hold
// for the buckets up to `last` (plan order), or the engine breaks, is closed or stalls;
// returns holding s.mu. The stall report names the tensors of buckets 0..last never submitted.
static std::unique_lock<std::mutex> block_until(FusedAllreduce::State& s, std::size_t last,
                                         const std::function<bool()>& ready_fast,
                                         const std::function<bool()>& ready_locked) {
  const double timeout_s = s.engine->config().timeout_s;
  auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  const auto& all_done = ready_fast;
  std::shared_ptr<Task> no_task;
  std::optional<Engine::Waiting> waiting;
  if (!s.engine->drive(no_task, all_done)) {  // Note [Waiter drives] in engine.cc
    waiting.emplace(*s.engine);  // the thread completes buckets without sleeping
    // Note [Hand-off] in engine.cc: the last bucket of a short round lands within the spin.
    spin_until(all_done, std::chrono::steady_clock::now() +
                             std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double, std::micro>(s.engine->handoff_spin_us())));
  }
  std::unique_lock<std::mutex> lock(s.mu);
  while (!ready_locked() && !s.closed && s.broken.empty()) {
    if (s.cv.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() +
                                                     std::chrono::milliseconds(100))) ==
        std::cv_status::no_timeout) {
      continue;
    }
    if (s.engine->broken().size() && s.next_bucket < s.buckets.size()) {
      s.broken = s.engine->broken();
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::vector<std::string> missing;
      for (std::size_t i = 0; i < s.specs.size(); ++i) {
        if (!s.submitted[i] && static_cast<std::size_t>(s.layout.slots[i].bucket) <= last) {
          missing.push_back("'" + s.specs[i].name + "'");
        }
      }
      // Everything submitted: the buckets in flight are under the engine's own timeout,
      // which ends them with a StallError naming the bucket. Keep waiting for that,
      // unless the thread itself is stuck inside MPI and can no longer end them.
      if (missing.empty()) {
        if (s.engine->thread_stuck()) {
          s.broken = "FusedAllreduce.wait: the communication thread is blocked inside MPI";
          s.engine->mark_broken(s.broken);
          throw StallError(s.broken + " for more than " + std::to_string(timeout_s) + " s; raise " +
                           kTimeoutEnv + "=<seconds> if the job is only slow");
        }
        deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        continue;
      }
      std::ostringstream m;
      m << "FusedAllreduce.wait: not complete after " << timeout_s << " s on rank "
        << s.engine->world().rank << ": ";
      if (!missing.empty()) {
        m << missing.size() << " tensors were never submitted on this rank (";
        for (std::size_t i = 0; i < missing.size() && i < 10; ++i) m << (i ? ", " : "") << missing[i];
        m << (missing.size() > 10 ? ", ...)" : ")")
          << ". Submit every tensor once per round before wait() returns.";
      }
      m << " If the job is only slow, raise " << kTimeoutEnv << "=<seconds>.";
      s.broken = m.str();
      // The ranks now disagree on the collective sequence: nothing may run any more.
      s.engine->mark_broken(s.broken);
      throw StallError(s.broken);
    }
  }
  return lock;
}

std::vector<FusedResult> FusedAllreduce::wait_round(bool per_bucket) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock = block_until(
      s, s.buckets.size() - 1,
      [&s] { return s.finished.load(std::memory_order_acquire) >= s.buckets.size(); },
      [&s] { return s.done_count >= s.buckets.size(); });
  if (s.closed) throw CommError("FusedAllreduce.wait: the engine was closed");
  if (!s.broken.empty()) throw CommError("FusedAllreduce is unusable: " + s.broken);
  for (const auto& bs : s.buckets) {
    if (bs.error) {
      const auto err = bs.error;
      s.arm_round();
      std::rethrow_exception(err);
    }
  }
  std::vector<FusedResult> out;
  if (per_bucket) {
    out.reserve(s.buckets.size());
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {
      out.push_back({s.buckets[b].buffer, 0, s.layout.buckets[b].count});
    }
  } else {
    out.reserve(s.specs.size());
    for (std::size_t t = 0; t < s.specs.size(); ++t) {
      const TensorSlot& slot = s.layout.slots[t];
      const std::size_t esize = dtype_size(s.specs[t].dtype);
      out.push_back({s.buckets[static_cast<std::size_t>(slot.bucket)].buffer,
                     slot.offset * static_cast<std::int64_t>(esize), slot.count});
    }
  }
  std::vector<std::pair<std::shared_ptr<FusionBuffer>, const BucketLayout*>> to_scale;
  if (s.op == ReduceOp::kAvg) {
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {
      if (!avg_scales_first(s.layout.buckets[b].dtype)) {
        to_scale.emplace_back(s.buckets[b].buffer, &s.layout.buckets[b]);
      }
    }
  }
  // Note [Transient buckets]: the results (and to_scale) hold the buffers now; dropping
  // the engine's own reference frees each one with its last holder, and the next round's
  // first tensor of a bucket allocates afresh (reuse_or_allocate of nullptr).
  if (s.engine->config().transient_buckets) {
    for (auto& bs : s.buckets) bs.buffer.reset();
  }
  s.arm_round();
  lock.unlock();
  for (auto& [buf, bl] : to_scale) divide_inplace(buf->data(), bl->count, bl->dtype, s.comm->size);
  return out;
}

// Note [One bucket at a time]: wait_bucket(b) hands out bucket b as soon as it is reduced,
// while later buckets are still being submitted or on the wire, so a caller can consume
// (and free) each bucket before the next arrives: with one wait for the whole round every
// bucket is alive at once when the optimizer starts (docs/memory.md). The round re-arms
// when every bucket has been handed out; wait()/wait_buckets() and wait_bucket() are not
// mixed within a round.
FusedResult FusedAllreduce::wait_bucket(std::int64_t bucket) {
  State& s = *state_;
  if (bucket < 0 || bucket >= static_cast<std::int64_t>(s.buckets.size())) {
    throw std::invalid_argument("FusedAllreduce.wait_bucket: bucket " + std::to_string(bucket) +
                            " is out of range for " + std::to_string(s.buckets.size()) + " buckets");
  }
  const auto b = static_cast<std::size_t>(bucket);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.buckets[b].taken) {
      throw std::invalid_argument("FusedAllreduce.wait_bucket: bucket " + std::to_string(b) +
                                  " was already handed out in this round; wait for each bucket once "
                                  "per round, after its tensors were submitted");
    }
  }
  std::unique_lock<std::mutex> lock = block_until(
      s, b, [&s, b] { return s.bucket_done[b].load(std::memory_order_acquire); },
      [&s, b] { return s.buckets[b].done; });
  if (s.closed) throw CommError("FusedAllreduce.wait: the engine was closed");
  if (!s.broken.empty()) throw CommError("FusedAllreduce is unusable: " + s.broken);
  auto& bs = s.buckets[b];
  if (bs.error) {
    const auto err = bs.error;
    s.arm_round();
    std::rethrow_exception(err);
  }
  const BucketLayout& bl = s.layout.buckets[b];
  FusedResult out{bs.buffer, 0, bl.count};
  const bool scale = s.op == ReduceOp::kAvg && !avg_scales_first(bl.dtype);
  bs.taken = true;
  if (s.engine->config().transient_buckets) bs.buffer.reset();  // Note [Transient buckets]
  if (++s.taken_count == s.buckets.size()) s.arm_round();
  lock.unlock();
  if (scale) divide_inplace(out.buffer->data(), bl.count, bl.dtype, s.comm->size);
  return out;
}

void FusedAllreduce::close() {
  if (!state_) return;
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->closed = true;
  state_->cv.notify_all();
}

}  // namespace tnt
