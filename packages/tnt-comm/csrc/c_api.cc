#include "c_api.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "errors.h"
#include "runtime.h"

namespace tnt {
namespace {

// Note [Handle registry]
// Native ops hold a plain integer (a graph attribute), not a pointer: the registry maps it
// to a weak reference, so an op that outlives its communicator or engine reports it
// instead of touching freed memory. Lookups take one uncontended lock (~20 ns).
struct Registry {
  std::mutex mu;
  std::int64_t next = 1;
  std::unordered_map<std::int64_t, std::weak_ptr<Comm>> comms;
  std::unordered_map<const Comm*, std::int64_t> comm_ids;
  std::unordered_map<std::int64_t, std::weak_ptr<FusedAllreduce>> engines;
  std::unordered_map<const FusedAllreduce*, std::int64_t> engine_ids;
};

Registry& registry() {
  static Registry r;
  return r;
}

template <class T>
std::int64_t enter(std::unordered_map<std::int64_t, std::weak_ptr<T>>& by_id,
                   std::unordered_map<const T*, std::int64_t>& ids, const std::shared_ptr<T>& obj) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = ids.find(obj.get());
  if (it != ids.end() && !by_id[it->second].expired()) return it->second;
  const std::int64_t id = r.next++;
  by_id[id] = obj;
  ids[obj.get()] = id;
  return id;
}

template <class T>
std::shared_ptr<T> lookup(std::unordered_map<std::int64_t, std::weak_ptr<T>>& by_id, std::int64_t id,
                          const char* kind) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = by_id.find(id);
  std::shared_ptr<T> obj = it == by_id.end() ? nullptr : it->second.lock();
  if (!obj) {
    throw std::invalid_argument(std::string("tnt_comm: no live ") + kind + " with native handle " +
                                std::to_string(id) + " (it was closed or never registered)");
  }
  return obj;
}

ArrayDesc describe(const std::int64_t* shape, std::int32_t ndim, const char* dtype) {
  if (ndim < 0 || (ndim > 0 && shape == nullptr) || dtype == nullptr) {
    throw std::invalid_argument("tnt_comm C API: bad shape or dtype arguments");
  }
  ArrayDesc d;
  d.dtype = dtype;
  d.itemsize = static_cast<std::int64_t>(dtype_size(parse_dtype(d.dtype)));
  d.shape.assign(shape, shape + ndim);
  return d;
}

// Runs fn; maps its exception to a status and a message (truncated to err_len).
template <class Fn>
int status_of(char* err, std::size_t err_len, Fn&& fn) noexcept {
  auto report = [&](int code, const char* cls, const char* what) {
    if (err != nullptr && err_len > 0) {
      std::snprintf(err, err_len, "%s: %s", cls, what);
    }
    return code;
  };
  try {
    fn();
    return TNT_OK;
  } catch (const StallError& e) {
    return report(TNT_ERR_STALL, "tnt_comm.StallError", e.what());
  } catch (const CommError& e) {
    return report(TNT_ERR_COMM, "tnt_comm.CommError", e.what());
  } catch (const std::invalid_argument& e) {
    return report(TNT_ERR_ARG, "ValueError", e.what());
  } catch (const std::exception& e) {
    return report(TNT_ERR_OTHER, "RuntimeError", e.what());
  } catch (...) {
    return report(TNT_ERR_OTHER, "RuntimeError", "unknown C++ exception in tnt_comm");
  }
}

int api_allreduce(std::int64_t comm, const void* in, void* out, const std::int64_t* shape,
                  std::int32_t ndim, const char* dtype, std::int32_t op, char* err,
                  std::size_t err_len) {
  return status_of(err, err_len, [&] {
    const CommPtr c = lookup(registry().comms, comm, "communicator");
    const ArrayDesc d = describe(shape, ndim, dtype);
    allreduce(runtime_engine(), c, in, out, d, static_cast<ReduceOp>(op));
  });
}

int api_allgather(std::int64_t comm, const void* in, void* out, const std::int64_t* shape,
                  std::int32_t ndim, const char* dtype, char* err, std::size_t err_len) {
  return status_of(err, err_len, [&] {
    const CommPtr c = lookup(registry().comms, comm, "communicator");
    const ArrayDesc d = describe(shape, ndim, dtype);
    if (ndim == 0) throw std::invalid_argument("allgather of a scalar: give it one dimension");
    const Gathered g = allgather(runtime_engine(), c, in, d);
    // tnt::allgather lets axis-0 lengths differ; this interface promises size * in.
    const bool same = std::all_of(g.bytes_per_rank.begin(), g.bytes_per_rank.end(),
                                  [&](std::int64_t b) { return b == d.nbytes(); });
    const std::int64_t got = d.nbytes() * c->size;
    if (!same) {
      throw std::invalid_argument("allgather: the ranks' arrays differ in length along axis 0 (this "
                                  "rank's " + d.str() + "); native allgather needs one shape on every rank");
    }
    std::memcpy(out, g.data->data(), static_cast<std::size_t>(got));
  });
}

int api_fused_submit(std::int64_t engine, std::int64_t n, const std::int64_t* indices,
                     const void* const* data, char* err, std::size_t err_len) {
  return status_of(err, err_len, [&] {
    const auto f = lookup(registry().engines, engine, "FusedAllreduce");
    const auto& specs = f->specs();
    std::vector<FusedAllreduce::Item> items;
    std::vector<std::vector<char>> zeros;  // for tensors a rank without data contributes
    items.reserve(static_cast<std::size_t>(n));
    for (std::int64_t k = 0; k < n; ++k) {
      const std::int64_t i = indices[k];
      if (i < 0 || i >= static_cast<std::int64_t>(specs.size())) {
        throw std::invalid_argument("FusedAllreduce submit: index " + std::to_string(i) +
                                    " is not a tensor index");
      }
      const TensorSpec& s = specs[static_cast<std::size_t>(i)];
      const void* p = data[k];
      if (p == nullptr) {
        zeros.emplace_back(static_cast<std::size_t>(s.count) * dtype_size(s.dtype), '\0');
        p = zeros.back().data();
      }
      items.push_back({i, p, s.count, s.dtype});
    }
    f->submit_many(items);
  });
}

int api_fused_wait_buckets(std::int64_t engine, std::int64_t n, void* const* out,
                           const std::int64_t* capacity, char* err, std::size_t err_len) {
  return status_of(err, err_len, [&] {
    const auto f = lookup(registry().engines, engine, "FusedAllreduce");
    const Plan& plan = f->plan();
    if (n != static_cast<std::int64_t>(plan.size())) {
      throw std::invalid_argument("FusedAllreduce wait: " + std::to_string(n) + " outputs for " +
                                  std::to_string(plan.size()) + " buckets");
    }
    const std::vector<FusedResult> results = f->wait_buckets();
    for (std::size_t b = 0; b < results.size(); ++b) {
      const FusedResult& r = results[b];
      const DType dt = f->specs()[static_cast<std::size_t>(plan[b].front())].dtype;
      const std::int64_t nbytes = r.count * static_cast<std::int64_t>(dtype_size(dt));
      if (nbytes != capacity[b]) {
        throw std::invalid_argument("FusedAllreduce wait: bucket " + std::to_string(b) + " has " +
                                    std::to_string(nbytes) + " bytes, its output " +
                                    std::to_string(capacity[b]));
      }
      std::memcpy(out[b], r.buffer->data() + r.offset_bytes, static_cast<std::size_t>(nbytes));
    }
  });
}

// Note [Borrowed buckets]
// A hold is a heap-allocated shared_ptr to the bucket's buffer: the engine reuses a buffer
// only while nobody else holds it (reuse_or_allocate), so a borrowed bucket is never
// written again while borrowed, whatever the caller's ordering. Native ops hand the bytes
// to TensorFlow as an output tensor without copying them (tarantella's TntFusedWait).
int api_fused_wait_buckets_borrow(std::int64_t engine, std::int64_t n, void** out, std::int64_t* nbytes,
                                  void** hold, char* err, std::size_t err_len) {
  return status_of(err, err_len, [&] {
    const auto f = lookup(registry().engines, engine, "FusedAllreduce");
    const Plan& plan = f->plan();
    if (n != static_cast<std::int64_t>(plan.size())) {
      throw std::invalid_argument("FusedAllreduce wait: " + std::to_string(n) + " outputs for " +
                                  std::to_string(plan.size()) + " buckets");
    }
    const std::vector<FusedResult> results = f->wait_buckets();
    std::vector<std::unique_ptr<std::shared_ptr<FusionBuffer>>> holds;  // all or nothing
    holds.reserve(results.size());
    for (const FusedResult& r : results) holds.push_back(std::make_unique<std::shared_ptr<FusionBuffer>>(r.buffer));
    for (std::size_t b = 0; b < results.size(); ++b) {
      const FusedResult& r = results[b];
      const DType dt = f->specs()[static_cast<std::size_t>(plan[b].front())].dtype;
      out[b] = r.buffer->data() + r.offset_bytes;
      nbytes[b] = r.count * static_cast<std::int64_t>(dtype_size(dt));
      hold[b] = holds[b].release();
    }
  });
}

int api_fused_wait_bucket_borrow(std::int64_t engine, std::int64_t bucket, void** out, std::int64_t* nbytes,
                                 void** hold, char* err, std::size_t err_len) {
  return status_of(err, err_len, [&] {
    const auto f = lookup(registry().engines, engine, "FusedAllreduce");
    const FusedResult r = f->wait_bucket(bucket);
    const DType dt = f->specs()[static_cast<std::size_t>(f->plan()[static_cast<std::size_t>(bucket)].front())].dtype;
    *out = r.buffer->data() + r.offset_bytes;
    *nbytes = r.count * static_cast<std::int64_t>(dtype_size(dt));
    *hold = new std::shared_ptr<FusionBuffer>(r.buffer);
  });
}

void api_fused_release(void* hold) { delete static_cast<std::shared_ptr<FusionBuffer>*>(hold); }

const tnt_comm_c_api kTable = {
    TNT_COMM_C_API_VERSION,        static_cast<std::int32_t>(sizeof(tnt_comm_c_api)),
    api_allreduce,                 api_allgather,
    api_fused_submit,              api_fused_wait_buckets,
    api_fused_wait_buckets_borrow, api_fused_release,
    api_fused_wait_bucket_borrow,
};

}  // namespace

std::int64_t c_api_register(const CommPtr& comm) {
  return enter(registry().comms, registry().comm_ids, comm);
}

std::int64_t c_api_register(const std::shared_ptr<FusedAllreduce>& engine) {
  return enter(registry().engines, registry().engine_ids, engine);
}

const tnt_comm_c_api* c_api_table() { return &kTable; }

}  // namespace tnt
