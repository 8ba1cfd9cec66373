// What every rank contributes to the description check before a plain collective (Note
// [Description check] in collectives.cc): marks that tell a check from other bytes and
// whether all descriptions agree, plus, for a small allreduce, its data (Note [Inline
// data]). Fixed size, so every check on every rank has the same MPI signature.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace tnt {

inline constexpr int kInlineBytes = 64;

struct CheckBlock {
  std::int64_t marks[4] = {};  // magic, -magic, hash, -hash: reduced by MAX
  std::int32_t dtype = -1;     // DType of the inline data, or -1: none
  std::int32_t op = 0;         // its ReduceOp
  std::int64_t count = 0;      // its elements
  unsigned char data[kInlineBytes] = {};
};

// inout = in (+) inout for the check's reduction, `in` holding the lower ranks' part:
// marks by MAX; the inline data by its op, in that operand order, when both blocks carry
// the same kind of data (else the marks already say the descriptions differ and the
// data is never read).
void combine_check_blocks(const CheckBlock& in, CheckBlock& inout);

}  // namespace tnt
