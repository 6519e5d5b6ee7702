// CPU elementwise kernels over strided loops (Eigen-vectorised on contiguous runs, OpenMP
// across chunks). Operand 0 is the output.
#pragma once

#include "kernels/dtype.h"
#include "kernels/loop.h"

namespace quilt::kernels::cpu {

/// out = op(in); out has in's dtype (bool for logical_not).
void unary(UnaryOp op, DType dt, const Loop<2>& loop);
/// out = op(a, b); a and b share `dt`; out is `dt` or bool for predicates.
void binary(BinaryOp op, DType dt, const Loop<3>& loop);
/// out = cond ? a : b; cond is bool, a/b/out are `dt`.
void where(DType dt, const Loop<4>& loop);
/// out = cast(in), any dtype pair.
void copy(DType out_dt, DType in_dt, const Loop<2>& loop);
/// out = value.
void fill(DType dt, double value, const Loop<1>& loop);
/// Uniform [a, b) into contiguous `out` of dtype `dt`.
void random_uniform(DType dt, void* out, const RandomArgs& args);
/// Normal(a, b) into contiguous `out` of dtype `dt`.
void random_normal(DType dt, void* out, const RandomArgs& args);
/// Integers uniform in [low, high) into contiguous `out` (i32/i64/float dtypes).
void random_int(DType dt, void* out, int64_t n, int64_t low, int64_t high, uint64_t seed, uint64_t key);
/// out = x * (keep ? 1/(1-p) : 0) with keep drawn per element from (seed, key); contiguous.
void dropout(DType dt, void* out, const void* x, int64_t n, double p, uint64_t seed, uint64_t key);

}  // namespace quilt::kernels::cpu
