// A communicator as the engine sees it: its data plane plus the bookkeeping that keeps
// every rank's collectives in one order and lets stalls be diagnosed on it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport.h"

namespace tnt {

// Note [Communicator ids]
// Each communicator has a 64-bit id, equal on all its members and different from every
// other communicator a member belongs to: the world is 1; a communicator derived from
// parent P (dup or split) gets hash(P's id, how many P had derived before, colour).
// Derivations are collective on P, so every member counts the same. The side channel
// names communicators by id when it asks other ranks about their progress.
std::uint64_t child_comm_id(std::uint64_t parent, std::uint64_t index, std::int64_t color);

struct Comm {
  std::uint64_t id = 1;
  std::string name = "world";  // for messages: "world", "split(color=1, key=0) of world"
  // Set once by the communication thread before the creating task completes; read-only
  // afterwards (callers see it through the task's future).
  int rank = 0, size = 1;
  std::vector<int> world_ranks;
  std::unique_ptr<DataPlane> data;
  // Communication thread only:
  std::uint64_t seq = 0;       // collectives started on it (Note [Stall diagnosis])
  std::uint64_t derived = 0;   // communicators derived from it so far
};

}  // namespace tnt
