// The C interface (include/tnt_comm_c_api.h in the Python package) and its handle
// registry: Python objects register their communicator or fused engine and hand out the
// id; native code calls through the table with that id.
#pragma once

#include <cstdint>
#include <memory>

#include "collectives.h"
#include "fused.h"
#include "tnt_comm_c_api.h"

namespace tnt {

// The id of `comm` in the registry (registered on first call; the registry holds a weak
// reference, so the id of a destroyed communicator fails cleanly).
std::int64_t c_api_register(const CommPtr& comm);
std::int64_t c_api_register(const std::shared_ptr<FusedAllreduce>& engine);
const tnt_comm_c_api* c_api_table();

}  // namespace tnt
