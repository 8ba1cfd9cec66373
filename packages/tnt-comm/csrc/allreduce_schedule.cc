#include "allreduce_schedule.h"

#include <stdexcept>
#include <string>

namespace tnt {

std::vector<AllreduceRound> recursive_doubling(int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw std::invalid_argument("recursive_doubling: rank " + std::to_string(rank) + " of " +
                                std::to_string(size));
  }
  int pow2 = 1;
  while (pow2 * 2 <= size) pow2 *= 2;
  const int extra = size - pow2;  // ranks 0, 2, ..., 2*extra-2 fold into their right neighbour
  std::vector<AllreduceRound> rounds;
  if (rank < 2 * extra && rank % 2 == 0) {
    rounds.push_back({rank + 1, -1, false, false});
    rounds.push_back({-1, rank + 1, true, false});
    return rounds;
  }
  if (rank < 2 * extra) rounds.push_back({-1, rank - 1, false, true});
  // Position among the pow2 ranks that take part in the doubling, and back.
  const int me = rank < 2 * extra ? rank / 2 : rank - extra;
  const auto actual = [extra](int pos) { return pos < extra ? 2 * pos + 1 : pos + extra; };
  for (int mask = 1; mask < pow2; mask <<= 1) {
    const int partner = me ^ mask;
    // The partner's partial covers ranks below ours iff its position is lower (the
    // positions keep the ranks' order, and each partial covers a contiguous range).
    rounds.push_back({actual(partner), actual(partner), false, partner < me});
  }
  if (rank < 2 * extra) rounds.push_back({rank - 1, -1, false, false});
  return rounds;
}

}  // namespace tnt
