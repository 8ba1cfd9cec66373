// Local element arithmetic after a reduction (AVG = SUM / size).
#pragma once

#include <cstdint>
#include <string>

#include "dtype.h"

namespace tnt {

// out[i] = first[i] (op) second[i], elementwise, in that operand order (out may alias
// either). AVG reduces as SUM (the caller scales: Note [AVG scaling]). 16-bit floats
// reduce in float and round back, as the MPI operators do. The fixed order is what makes
// every rank's result bitwise equal in Note [Small allreduce] (p2p_allreduce.cc), also for
// MIN/MAX with NaN or signed zeros, where swapping the operands changes the result.
void reduce_ordered(const void* first, const void* second, void* out, std::int64_t count,
                    DType dtype, ReduceOp op);

// data[i] /= divisor for a float dtype (16-bit floats via float, rounded back).
void divide_inplace(void* data, std::int64_t count, DType dtype, int divisor);

// Note [AVG scaling]
// AVG over n ranks is SUM(x / n) for 16-bit floats: their sum overflows (float16 above
// 65504) where the mean still fits, so every rank scales first. 32/64-bit floats sum
// first and divide after (exact whenever the sum is; their range makes overflow moot).
bool avg_scales_first(DType dtype);
// The one check that AVG is defined for `dtype`: std::invalid_argument naming `what`.
void check_avg(DType dtype, const std::string& what);

}  // namespace tnt
