// Local element arithmetic after a reduction (AVG = SUM / size).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace tnt {

// data[i] /= divisor for a float dtype (16-bit floats via float, rounded back).
void divide_inplace(void* data, std::int64_t count, DType dtype, int divisor);

}  // namespace tnt
