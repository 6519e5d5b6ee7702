// CPU reductions (sum, max, min, argmax, sum of squares) over arbitrary strided dims.
#pragma once

#include "kernels/dtype.h"
#include "kernels/loop.h"

namespace quilt::kernels::cpu {

/// Reduces `loop.in` (dtype `in_dt`) into `loop.out` (dtype `out_dt`: i64 for argmax).
/// argmax expects a single reduced dim and returns the first index of the maximum.
void reduce(ReduceOp op, DType in_dt, DType out_dt, const ReduceLoop& loop);

}  // namespace quilt::kernels::cpu
