// Note [Stall diagnosis]
// Every rank counts the collectives (tasks) its communication thread has started: its
// sequence number. When a collective waits past TNT_COMM_TIMEOUT, the stalled rank asks
// every other rank for its number over a private side communicator (non-blocking
// point-to-point; each communication thread keeps a receive posted and answers it while
// polling or, when idle, every kIdleServiceInterval). A rank whose number is lower has
// not arrived at this collective; a higher number means collectives were issued in a
// different order or count; no answer means the process is dead or stuck.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm.h"
#include "transport.h"

namespace tnt {

// The StallError message: collective, rank, limit, which ranks did not arrive, likely
// causes, and the variable that moves the limit.
// `progress` holds the answer of every member of `comm`, in its rank order; `seq` is the
// stalled collective's number on `comm`.
std::string stall_message(const std::string& what, const Comm& comm, double timeout_s,
                          std::uint64_t seq, const std::vector<std::optional<Progress>>& progress);

}  // namespace tnt
