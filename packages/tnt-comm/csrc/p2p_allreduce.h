// An allreduce made of point-to-point messages, for small messages (Note [Small
// allreduce] in p2p_allreduce.cc). DataPlane::iallreduce chooses it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "allreduce_schedule.h"

#include "dtype.h"
#include "transport.h"

namespace tnt {

// Messages up to this size are reduced point-to-point; larger ones by the transport's
// collective (bandwidth-optimal algorithms win there).
inline constexpr std::int64_t kPointToPointAllreduceMaxBytes = 64 * 1024;

// In place on `data` (count elements): the reduction over every rank of `plane`, equal
// bit for bit on every rank. `tag` must be the same on every rank for this call and
// differ from every other point-to-point allreduce still in flight on the plane.
// `rounds` (recursive_doubling(plane.rank(), plane.size())) must outlive the request.
std::unique_ptr<Request> point_to_point_allreduce(DataPlane& plane,
                                                  const std::vector<AllreduceRound>& rounds, void* data,
                                                  std::int64_t count, DType dtype, ReduceOp op, int tag);

}  // namespace tnt
