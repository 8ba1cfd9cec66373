// The rounds of a point-to-point allreduce (Note [Small allreduce] in p2p_allreduce.cc):
// recursive doubling, with the ranks beyond the largest power of two folded in before
// and served after. A pure function of (rank, size), the same table on every rank.
#pragma once

#include <vector>

namespace tnt {

struct AllreduceRound {
  int send_to = -1;    // rank this round sends its current partial result to, or -1
  int recv_from = -1;  // rank it receives from, or -1
  // What the received bytes are: a partial result to combine with ours, or the final
  // result (a folded-in rank gets it back from its partner).
  bool result = false;
  // Combine as op(received, ours) if the sender covers the lower ranks, else op(ours,
  // received): both partners then evaluate the same expression, bit for bit.
  bool received_first = false;
};

// Every round of `rank`'s part in an allreduce over `size` ranks (none for size 1).
std::vector<AllreduceRound> recursive_doubling(int rank, int size);

}  // namespace tnt
