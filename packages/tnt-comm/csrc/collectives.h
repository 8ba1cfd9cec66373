// The plain collectives behind tnt_comm.allreduce/broadcast/allgather/barrier. Each
// first exchanges every rank's array description (one small allgather), so a shape,
// dtype or op that differs across ranks is a clear error on every rank at once rather
// than a hang or garbage. Blocking: call with the GIL released.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "buffer.h"
#include "dtype.h"
#include "engine.h"

namespace tnt {

inline constexpr int kMaxDims = 32;

struct ArrayDesc {
  std::string dtype;  // numpy dtype name
  std::int64_t itemsize = 0;
  std::vector<std::int64_t> shape;

  std::int64_t count() const;
  std::int64_t nbytes() const { return count() * itemsize; }
  std::string str() const;  // "float32 (4, 3)"
};

// An array description as it travels between ranks (fixed size, no pointers).
inline constexpr std::uint32_t kMetaMagic = 0x746E7431;  // "tnt1": tells a Meta from other bytes
struct Meta {
  std::uint32_t magic;
  char dtype[24];
  std::int32_t op;  // ReduceOp, root, or -1
  std::int32_t ndim;
  std::int64_t itemsize;
  std::int64_t shape[kMaxDims];
};
// Throws std::invalid_argument for more than kMaxDims dimensions or a long dtype name.
Meta to_meta(const ArrayDesc& d, std::int32_t op);
ArrayDesc from_meta(const Meta& m);
// False for bytes that are no Meta (never decode them).
bool meta_valid(const Meta& m);

using CommPtr = std::shared_ptr<Comm>;

void allreduce(Engine& engine, const CommPtr& comm, const void* in, void* out,
               const ArrayDesc& desc, ReduceOp op);
// In place on `buf`: the root's data everywhere.
void broadcast(Engine& engine, const CommPtr& comm, void* buf, const ArrayDesc& desc, int root);

struct Gathered {
  std::shared_ptr<FusionBuffer> data;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> bytes_per_rank;  // in rank order
};
// Concatenation along axis 0 in rank order; axis-0 lengths may differ.
Gathered allgather(Engine& engine, const CommPtr& comm, const void* in, const ArrayDesc& desc);
void barrier(Engine& engine, const CommPtr& comm);

// Rank r receives in `out` counts[r] elements: the element-wise reduction over ranks of the
// r-th block of `in` (blocks back to back in rank order; sum(counts) == desc.count()). Every
// rank passes the same description, op and counts: checked together (a hash of the counts
// rides in the description check), so a mismatch is an error on every rank, never a hang.
void reduce_scatter(Engine& engine, const CommPtr& comm, const void* in, void* out,
                    const ArrayDesc& desc, const std::vector<std::int64_t>& counts, ReduceOp op);

// New communicators, collective over `parent` (every member calls, in the same order
// as its other collectives). split: MPI_Comm_split semantics (colour >= 0, order by
// key then parent rank); the members' arrival is checked first with a timed exchange,
// so a member that never calls is a StallError, not a hang.
CommPtr split(Engine& engine, const CommPtr& parent, int color, int key);
CommPtr dup(Engine& engine, const CommPtr& parent);

}  // namespace tnt
