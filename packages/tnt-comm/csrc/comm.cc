#include "comm.h"

namespace tnt {

std::uint64_t child_comm_id(std::uint64_t parent, std::uint64_t index, std::int64_t color) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a over the three numbers
  for (const std::uint64_t v : {parent, index, static_cast<std::uint64_t>(color)}) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return h == 1 ? 2 : h;  // 1 is the world
}

}  // namespace tnt
