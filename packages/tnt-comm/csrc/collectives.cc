#include "collectives.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>
#include <stdexcept>

#include "arith.h"
#include "errors.h"

namespace tnt {
namespace {

// Gathers every rank's Meta; `check` then runs on the gathered table (same on all ranks).
struct MetaExchange {
  Meta mine{};
  std::vector<Meta> all;
  CheckBlock check_in, check_out;  // Note [Description check]; carries small data too
  bool differ = false;
};


StepTask::Step exchange_step(const std::shared_ptr<MetaExchange>& x) {
  return [x](DataPlane& t) {
    x->all.resize(static_cast<std::size_t>(t.size()));
    return t.iallgather(&x->mine, sizeof(Meta), x->all.data());
  };
}

// When another rank runs a different collective, MPI may match it against this exchange
// and hand us bytes that are no Meta: say so (never decode them).
StepTask::Step in_step_check(const std::shared_ptr<MetaExchange>& x, const char* what) {
  return [x, what](DataPlane&) -> std::unique_ptr<Request> {
    std::string ranks;
    for (std::size_t r = 0; r < x->all.size(); ++r) {
      if (!meta_valid(x->all[r])) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    }
    if (!ranks.empty()) {
      throw OutOfStepError(
          std::string("tnt_comm: ") + what + ": rank(s) " + ranks +
          " ran a different collective at this point (what they sent does not describe "
          "arguments of " + what + "), so the ranks ran different collectives: a rank skipped a "
          "collective or ran an extra one (e.g. a collective inside `if rank == 0:`); every "
          "rank must issue the same collectives in the same order.");
    }
    return nullptr;
  };
}

std::string table(const std::vector<Meta>& all, bool with_op, const char* op_label) {
  std::ostringstream s;
  for (std::size_t r = 0; r < all.size(); ++r) {
    s << (r ? "; " : "") << "rank " << r << ": " << from_meta(all[r]).str();
    if (with_op) s << " " << op_label << "=" << op_name(static_cast<ReduceOp>(all[r].op));
  }
  return s.str();
}

// Note [Description check]
// Before a plain allreduce or broadcast every rank must agree on dtype, shape and op or
// root, or the data collective would hang or mix garbage. Exchanging the full
// descriptions costs ~300 B x ranks before every call (a 4 B allreduce took 20x MPI's
// time); instead one MAX-allreduce of four int64 carries (magic, -magic, hash, -hash):
// afterwards max == -max(-x) == min, so every rank knows at once whether all sent the
// magic (else another rank runs a different collective here: out of step, never
// decoded) and whether all hashes agree. Only on disagreement are the full
// descriptions gathered, to name every rank's arguments in the error. All ranks see
// the same reduced values, so they take the same branch. The check is one element of a
// fixed-size block (check_block.h) under a user-defined operator, so every check on every
// rank has the same MPI signature whatever it describes.
//
// Note [Inline data]
// An allreduce of at most kInlineBytes rides in the check's block: the operator reduces
// it (lower ranks first) along with the marks, and there is no second collective. A 4 B
// allreduce was the check (~1.4 us in libnbc) plus the data's point-to-point exchange
// (~0.6 us) and a second round of the engine; the data adds nothing measurable to the
// check. If the descriptions differ the data is never used: the verdict throws.
// The hash mixes the fields that describe the call, a 64-bit word at a time (a byte-wise
// hash of the whole 304-byte Meta cost ~0.4 us, a tenth of a small allreduce).
std::int64_t description_hash(const Meta& m) {
  std::uint64_t h = 0x9e3779b97f4a7c15ull;
  const auto mix = [&h](std::uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
  };
  std::uint64_t name[sizeof(Meta::dtype) / 8 + 1] = {};
  std::memcpy(name, m.dtype, sizeof(Meta::dtype));
  for (const std::uint64_t w : name) mix(w);
  mix(static_cast<std::uint64_t>(static_cast<std::uint32_t>(m.op)) << 32 | static_cast<std::uint32_t>(m.ndim));
  mix(static_cast<std::uint64_t>(m.itemsize));
  const int dims = m.ndim >= 0 && m.ndim <= kMaxDims ? m.ndim : kMaxDims;
  for (int i = 0; i < dims; ++i) mix(static_cast<std::uint64_t>(m.shape[i]));
  return static_cast<std::int64_t>(h >> 2);  // 62 bits: its negation cannot overflow
}

// The steps of the check; `verdict` runs on the gathered table (only when hashes differ)
// and throws the error naming every rank's arguments.
void add_description_check(std::vector<StepTask::Step>& steps, const std::shared_ptr<MetaExchange>& x,
                           const char* what, std::function<void(const std::vector<Meta>&)> verdict) {
  steps.push_back([x](DataPlane& t) {
    const std::int64_t h = description_hash(x->mine);
    const std::int64_t in[4] = {kMetaMagic, -static_cast<std::int64_t>(kMetaMagic), h, -h};
    std::copy(in, in + 4, x->check_in.marks);
    return t.icheck(&x->check_in, &x->check_out);
  });
  steps.push_back([x, what](DataPlane& t) -> std::unique_ptr<Request> {
    const std::int64_t* o = x->check_out.marks;
    if (o[0] != kMetaMagic || -o[1] != kMetaMagic) {
      throw OutOfStepError(
          std::string("tnt_comm: ") + what + ": another rank ran a different collective at this "
          "point (what it sent does not describe arguments of " + what + "), so the ranks ran "
          "different collectives: a rank skipped a collective or ran an extra one (e.g. a "
          "collective inside `if rank == 0:`); every rank must issue the same collectives in the "
          "same order.");
    }
    x->differ = o[2] != -o[3];
    return x->differ ? exchange_step(x)(t) : nullptr;
  });
  steps.push_back([x, what, verdict = std::move(verdict)](DataPlane& t) -> std::unique_ptr<Request> {
    if (!x->differ) return nullptr;
    in_step_check(x, what)(t);
    verdict(x->all);
    throw std::logic_error(std::string(what) + ": descriptions hash differently but compare equal");
  });
}

void run_blocking(Engine& engine, std::shared_ptr<StepTask> task) {
  auto done = task->future();
  engine.run(std::move(task), done);  // rethrows the task's error
}

}  // namespace

Meta to_meta(const ArrayDesc& d, std::int32_t op) {
  if (d.shape.size() > static_cast<std::size_t>(kMaxDims)) {
    throw std::invalid_argument("arrays with more than " + std::to_string(kMaxDims) +
                                " dimensions are not supported; reshape it first");
  }
  if (d.dtype.size() >= sizeof(Meta::dtype)) {
    throw std::invalid_argument("dtype name too long: " + d.dtype);
  }
  Meta m{};
  m.magic = kMetaMagic;
  std::memcpy(m.dtype, d.dtype.data(), d.dtype.size());
  m.op = op;
  m.ndim = static_cast<std::int32_t>(d.shape.size());
  m.itemsize = d.itemsize;
  for (std::size_t i = 0; i < d.shape.size(); ++i) m.shape[i] = d.shape[i];
  return m;
}

ArrayDesc from_meta(const Meta& m) {
  ArrayDesc d;
  d.dtype = std::string(m.dtype, strnlen(m.dtype, sizeof m.dtype));
  d.itemsize = m.itemsize;
  d.shape.assign(m.shape, m.shape + m.ndim);
  return d;
}

bool meta_valid(const Meta& m) {
  return m.magic == kMetaMagic && m.ndim >= 0 && m.ndim <= kMaxDims &&
         strnlen(m.dtype, sizeof m.dtype) < sizeof m.dtype;
}

std::int64_t ArrayDesc::count() const {
  std::int64_t n = 1;
  for (const auto s : shape) n *= s;
  return n;
}

std::string ArrayDesc::str() const {
  std::ostringstream s;
  s << dtype << " (";
  for (std::size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << (shape.size() == 1 ? ",)" : ")");
  return s.str();
}

void allreduce(Engine& engine, const CommPtr& comm, const void* in, void* out,
               const ArrayDesc& desc, ReduceOp op) {
  const DType dtype = parse_dtype(desc.dtype);
  if (op == ReduceOp::kAvg) check_avg(dtype, "allreduce");
  auto x = std::make_shared<MetaExchange>();
  x->mine = to_meta(desc, static_cast<std::int32_t>(op));
  const std::int64_t count = desc.count();
  const int size = comm->size;
  const std::int64_t nbytes = desc.nbytes();
  const bool scale_first = op == ReduceOp::kAvg && avg_scales_first(dtype);
  std::vector<StepTask::Step> steps;
  steps.reserve(5);
  add_description_check(steps, x, "allreduce", [](const std::vector<Meta>& all) {
    throw std::invalid_argument(
        "allreduce: the arrays or ops differ across ranks (" + table(all, true, "op") +
        "). Every rank must pass an array of the same shape and dtype, with the same op.");
  });
  if (nbytes <= kInlineBytes) {  // Note [Inline data]: reduced by the check itself
    CheckBlock& b = x->check_in;
    if (nbytes > 0) std::memcpy(b.data, in, static_cast<std::size_t>(nbytes));
    if (scale_first) divide_inplace(b.data, count, dtype, size);  // Note [AVG scaling]
    b.dtype = static_cast<std::int32_t>(dtype);
    b.op = static_cast<std::int32_t>(op == ReduceOp::kAvg ? ReduceOp::kSum : op);
    b.count = count;
    steps.push_back([=](DataPlane&) -> std::unique_ptr<Request> {
      if (nbytes > 0) std::memcpy(out, x->check_out.data, static_cast<std::size_t>(nbytes));
      if (op == ReduceOp::kAvg && !scale_first) divide_inplace(out, count, dtype, size);
      return nullptr;
    });
  } else if (scale_first) {  // Note [AVG scaling]: out = in / size, then summed in place
    steps.push_back([=](DataPlane& t) {
      std::memcpy(out, in, static_cast<std::size_t>(nbytes));
      divide_inplace(out, count, dtype, size);
      return t.iallreduce(out, out, count, dtype, ReduceOp::kSum);
    });
  } else {
    steps.push_back([=](DataPlane& t) { return t.iallreduce(in, out, count, dtype, op); });
  }
  if (op == ReduceOp::kAvg && !scale_first && nbytes > kInlineBytes) {
    steps.push_back([=](DataPlane&) -> std::unique_ptr<Request> {
      divide_inplace(out, count, dtype, size);
      return nullptr;
    });
  }
  auto task = std::make_shared<StepTask>(  // described from the Meta: no copy of desc per call
      comm, StepTask::Describe([x] { return "allreduce(" + from_meta(x->mine).str() + ", " +
                                            op_name(static_cast<ReduceOp>(x->mine.op)) + ")"; }),
      std::move(steps));
  task->set_payload_bytes(nbytes);
  run_blocking(engine, std::move(task));
}

void reduce_scatter(Engine& engine, const CommPtr& comm, const void* in, void* out,
                    const ArrayDesc& desc, const std::vector<std::int64_t>& counts, ReduceOp op) {
  const DType dtype = parse_dtype(desc.dtype);
  if (op == ReduceOp::kAvg) check_avg(dtype, "reduce_scatter");
  auto x = std::make_shared<MetaExchange>();
  x->mine = to_meta(desc, static_cast<std::int32_t>(op));
  // The counts join the description: the last (unused) shape entries carry their number
  // and a hash of them, so ranks that split differently fail the check together.
  std::uint64_t h = 0x9e3779b97f4a7c15ull;
  for (const std::int64_t c : counts) {
    h ^= static_cast<std::uint64_t>(c) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
  }
  const bool room = x->mine.ndim <= kMaxDims - 2;
  if (room) {
    x->mine.shape[kMaxDims - 1] = static_cast<std::int64_t>(counts.size());
    x->mine.shape[kMaxDims - 2] = static_cast<std::int64_t>(h >> 2);
  }
  const int saved_ndim = x->mine.ndim;
  if (room) x->mine.ndim = kMaxDims;  // hashed up to kMaxDims; restored before any decode
  std::vector<StepTask::Step> steps;
  add_description_check(steps, x, "reduce_scatter", [saved_ndim](const std::vector<Meta>& all) {
    std::vector<Meta> shown = all;
    for (Meta& m : shown) m.ndim = std::min(m.ndim, saved_ndim);
    throw std::invalid_argument(
        "reduce_scatter: the arrays, ops or counts differ across ranks (" + table(shown, true, "op") +
        "). Every rank must pass an array of the same shape and dtype, the same op and the same "
        "counts.");
  });
  const std::int64_t count = desc.count();
  steps.push_back([counts, count](DataPlane& t) -> std::unique_ptr<Request> {
    // Same description and counts everywhere now: the same verdict on every rank.
    std::int64_t total = 0;
    bool negative = false;
    for (const std::int64_t c : counts) {
      total += c;
      negative = negative || c < 0;
    }
    if (static_cast<int>(counts.size()) != t.size() || negative || total != count) {
      throw std::invalid_argument(
          "reduce_scatter: counts must hold one non-negative element count per rank (" +
          std::to_string(t.size()) + " here) summing to the array's " + std::to_string(count) +
          " elements; got " + std::to_string(counts.size()) + " counts summing to " +
          std::to_string(total));
    }
    return nullptr;
  });
  steps.push_back([=](DataPlane& t) {
    return t.ireduce_scatter(in, out, counts, dtype, op == ReduceOp::kAvg ? ReduceOp::kSum : op);
  });
  if (op == ReduceOp::kAvg) {
    steps.push_back([=](DataPlane& t) -> std::unique_ptr<Request> {
      divide_inplace(out, counts[static_cast<std::size_t>(t.rank())], dtype, t.size());
      return nullptr;
    });
  }
  auto task = std::make_shared<StepTask>(
      comm, StepTask::Describe([desc, op] { return "reduce_scatter(" + desc.str() + ", " + op_name(op) + ")"; }),
      std::move(steps));
  task->set_payload_bytes(desc.nbytes());
  run_blocking(engine, std::move(task));
}

void broadcast(Engine& engine, const CommPtr& comm, void* buf, const ArrayDesc& desc, int root) {
  auto x = std::make_shared<MetaExchange>();
  x->mine = to_meta(desc, root);
  const std::int64_t nbytes = desc.nbytes();
  std::vector<StepTask::Step> steps;
  add_description_check(steps, x, "broadcast", [root](const std::vector<Meta>& all) {
    for (const Meta& m : all) {
      if (m.op != root) {
        std::string roots;
        for (std::size_t r = 0; r < all.size(); ++r) {
          roots += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + ": root=" +
                   std::to_string(all[r].op);
        }
        throw std::invalid_argument("broadcast: ranks disagree on the root (" + roots +
                                    "). Pass the same root on every rank.");
      }
    }
    throw std::invalid_argument(
        "broadcast(root=" + std::to_string(root) + "): shape/dtype differ across ranks (" +
        table(all, false, "") +
        "). Every rank must pass an array of the root's shape and dtype, e.g. "
        "np.empty(shape, dtype) on the non-root ranks.");
  });
  // Same root everywhere now (it is part of the description): the same verdict everywhere.
  steps.push_back([root](DataPlane& t) -> std::unique_ptr<Request> {
    if (root < 0 || root >= t.size()) {
      throw std::invalid_argument("broadcast: root=" + std::to_string(root) +
                                  " is not a rank (ranks are 0.." + std::to_string(t.size() - 1) + ")");
    }
    return nullptr;
  });
  steps.push_back([=](DataPlane& t) { return t.ibcast(buf, nbytes, root); });
  auto task = std::make_shared<StepTask>(
      comm, StepTask::Describe([desc, root] { return "broadcast(" + desc.str() + ", root=" + std::to_string(root) + ")"; }),
      std::move(steps));
  task->set_payload_bytes(nbytes);
  run_blocking(engine, std::move(task));
}

Gathered allgather(Engine& engine, const CommPtr& comm, const void* in, const ArrayDesc& desc) {
  if (desc.shape.empty()) {
    throw std::invalid_argument(
        "allgather needs an array with at least one dimension (it concatenates along axis 0); "
        "use array.reshape(1)");
  }
  auto x = std::make_shared<MetaExchange>();
  x->mine = to_meta(desc, -1);
  auto out = std::make_shared<Gathered>();
  auto counts = std::make_shared<std::vector<std::int64_t>>();
  std::vector<StepTask::Step> steps;
  steps.push_back(exchange_step(x));
  steps.push_back(in_step_check(x, "allgather"));
  steps.push_back([x, out, counts](DataPlane& t) -> std::unique_ptr<Request> {
    const ArrayDesc first = from_meta(x->all.front());
    std::int64_t rows = 0;
    for (const Meta& m : x->all) {
      const ArrayDesc d = from_meta(m);
      const bool same = d.dtype == first.dtype && d.itemsize == first.itemsize &&
                        d.shape.size() == first.shape.size() &&
                        std::equal(d.shape.begin() + 1, d.shape.end(), first.shape.begin() + 1);
      if (!same) {
        throw std::invalid_argument(
            "allgather: dtype or trailing dimensions differ across ranks (" +
            table(x->all, false, "") +
            "). Only the length of axis 0 may differ; everything else must agree.");
      }
      counts->push_back(d.nbytes());
      rows += d.shape.front();
    }
    out->shape = first.shape;
    out->shape.front() = rows;
    out->bytes_per_rank = *counts;
    std::int64_t total = 0;
    for (const auto c : *counts) total += c;
    out->data = std::make_shared<FusionBuffer>(static_cast<std::size_t>(total), FusionBuffer::Fill::kNone);
    (void)t;
    return nullptr;
  });
  steps.push_back([in, out, counts](DataPlane& t) {
    return t.iallgatherv(in, out->data->data(), *counts);
  });
  auto task = std::make_shared<StepTask>(
      comm, StepTask::Describe([desc] { return "allgather(" + desc.str() + ")"; }), std::move(steps));
  task->set_payload_bytes(desc.nbytes() * comm->size);  // about what it receives
  run_blocking(engine, std::move(task));
  return std::move(*out);
}

void barrier(Engine& engine, const CommPtr& comm) {
  std::vector<StepTask::Step> steps;
  steps.push_back([](DataPlane& t) { return t.ibarrier(); });
  run_blocking(engine, std::make_shared<StepTask>(comm, "barrier()", std::move(steps)));
}

CommPtr split(Engine& engine, const CommPtr& parent, int color, int key) {
  if (color < 0) {
    throw std::invalid_argument("split: color=" + std::to_string(color) +
                                " must be >= 0 (every rank must belong to one new communicator)");
  }
  auto child = std::make_shared<Comm>();
  child->name = "split(color=" + std::to_string(color) + ", key=" + std::to_string(key) + ") of " +
                parent->name;
  struct Arrival {
    std::int32_t color, key;
  };
  auto mine = std::make_shared<Arrival>(Arrival{color, key});
  auto all = std::make_shared<std::vector<Arrival>>();
  std::vector<StepTask::Step> steps;
  steps.push_back([mine, all](DataPlane& t) {  // timed: every member has arrived after it
    all->resize(static_cast<std::size_t>(t.size()));
    return t.iallgather(mine.get(), sizeof(Arrival), all->data());
  });
  steps.push_back([&engine, parent, child, color, key](DataPlane& t) -> std::unique_ptr<Request> {
    child->id = child_comm_id(parent->id, parent->derived++, color);
    child->data = t.split(color, key);
    child->rank = child->data->rank();
    child->size = child->data->size();
    child->world_ranks = child->data->world_ranks();
    engine.adopt(child);
    return nullptr;
  });
  auto task = std::make_shared<StepTask>(parent,
                                         "split(color=" + std::to_string(color) + ", key=" +
                                             std::to_string(key) + ") of " + parent->name,
                                         std::move(steps));
  task->set_thread_only();  // MPI_Comm_split blocks
  run_blocking(engine, std::move(task));
  return child;
}

// Note [Blocking dup]: MPI_Comm_idup's non-blocking context-id agreement hung once in
// CI (Open MPI 5, 4 ranks on 2 cores: every rank had posted it, none completed in 120 s;
// Open MPI has a history of such idup hangs, e.g. ompi issues #778, #2025). So a dup
// is made like a split: a timed barrier shows every member has arrived (a missing rank
// is reported by the stall check as for any collective), then the communication thread
// calls the blocking MPI_Comm_dup, which returns promptly once all members are in it.
CommPtr dup(Engine& engine, const CommPtr& parent) {
  auto child = std::make_shared<Comm>();
  child->name = "dup of " + parent->name;
  std::vector<StepTask::Step> steps;
  steps.push_back([](DataPlane& t) { return t.ibarrier(); });  // timed: every member arrived
  steps.push_back([&engine, parent, child](DataPlane& t) -> std::unique_ptr<Request> {
    child->id = child_comm_id(parent->id, parent->derived++, -1);
    child->data = t.dup();
    child->rank = child->data->rank();
    child->size = child->data->size();
    child->world_ranks = child->data->world_ranks();
    engine.adopt(child);
    return nullptr;
  });
  auto task = std::make_shared<StepTask>(parent, "dup of " + parent->name, std::move(steps));
  task->set_thread_only();  // MPI_Comm_dup blocks
  run_blocking(engine, std::move(task));
  return child;
}

}  // namespace tnt
