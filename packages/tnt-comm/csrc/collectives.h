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

void allreduce(Engine& engine, const void* in, void* out, const ArrayDesc& desc, ReduceOp op);
// In place on `buf`: the root's data everywhere.
void broadcast(Engine& engine, void* buf, const ArrayDesc& desc, int root);

struct Gathered {
  std::shared_ptr<FusionBuffer> data;
  std::vector<std::int64_t> shape;
};
// Concatenation along axis 0 in rank order; axis-0 lengths may differ.
Gathered allgather(Engine& engine, const void* in, const ArrayDesc& desc);
void barrier(Engine& engine);

}  // namespace tnt
