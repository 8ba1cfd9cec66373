// Local element arithmetic after a reduction (AVG = SUM / size).
#pragma once

#include <cstdint>
#include <string>

#include "dtype.h"

namespace tnt {

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
