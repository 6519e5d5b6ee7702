// CPU kernels of the mixture-of-experts ops (engine/ops/moe.h): the grouped GEMM and its
// weight gradient, and the row permutation / weighted combine around them.
//
//   kernels::GroupedGemmArgs g = ...;             // built by engine/ops/moe.cpp
//   kernels::cpu::grouped_gemm(DType::f32, g);
//
// The grouped GEMMs split the work into items (group, row tile, column tile) whose sizes
// depend only on the shapes, run them in one OpenMP parallel region, and give each item a
// single-threaded GEMM of the library measured fastest for such tiles (kernels/cpu/gemm_libs.h):
// many small groups keep every thread busy, and the results are the same bits for any thread
// count. bf16/f16 tiles are widened to f32, multiplied and
// rounded once. The row kernels copy or sum whole rows, one output row per thread at a time
// (deterministic: a token's k rows are summed in slot order).
#pragma once

#include <cstdint>

#include "kernels/dtype.h"

namespace quilt::kernels {

/// out (m, n) = x (m, k) @ w[group of the row] where group e owns rows [offsets[e-1], offsets[e]).
/// A transposed operand is stored column-major: element (i, j) at p[j * ld + i].
struct GroupedGemmArgs {
  int64_t groups = 0;                // E
  const int64_t* offsets = nullptr;  // (E) non-decreasing cumulative row ends, offsets[E-1] == m
  int64_t m = 0, n = 0, k = 0;
  const void* x = nullptr;  // (m, k)
  bool trans_x = false;
  int64_t ldx = 0;
  const void* w = nullptr;  // (E, k, n): group e's matrix starts at w + e * w_group_stride
  bool trans_w = false;
  int64_t ldw = 0;
  int64_t w_group_stride = 0;
  void* out = nullptr;  // (m, n), row-major
  int64_t ldo = 0;
};

/// dw[e] (k, n) = x_e^T @ dy_e over group e's rows (zeros for an empty group).
struct GroupedGemmWeightGradArgs {
  int64_t groups = 0;                // E
  const int64_t* offsets = nullptr;  // (E) as in GroupedGemmArgs
  int64_t m = 0, n = 0, k = 0;
  const void* x = nullptr;  // (m, k)
  bool trans_x = false;
  int64_t ldx = 0;
  const void* dy = nullptr;  // (m, n)
  bool trans_dy = false;
  int64_t lddy = 0;
  void* dw = nullptr;  // (E, k, n), contiguous
};

}  // namespace quilt::kernels

namespace quilt::kernels::cpu {

/// The grouped GEMM (see GroupedGemmArgs); f32, f64, bf16, f16.
void grouped_gemm(DType dt, const kernels::GroupedGemmArgs& args);

/// The grouped weight gradient (see GroupedGemmWeightGradArgs); f32, f64, bf16, f16.
void grouped_gemm_weight_grad(DType dt, const kernels::GroupedGemmWeightGradArgs& args);

/// slot_row[order[p]] = p for p < n. Returns -1 when order is a permutation of [0, n), else the
/// first position p whose value is out of range or repeats an earlier one (slot_row is then
/// partly written).
int64_t moe_invert_order(int64_t n, const int64_t* order, int64_t* slot_row);

/// Routed rows: out[p] = w[order[p]] * x[order[p] / k] for p < n; out (n, h) contiguous, x rows
/// `ldx` apart (unit column stride), w (n) or null for ones. Products in f32 for 16-bit types.
void moe_permute(DType dt, int64_t n, int64_t h, int64_t k, const int64_t* order, const void* x, int64_t ldx,
                 const void* w, void* out);

/// The combine: out[t] = sum_{j < k} w[t*k+j] * y[slot_row[t*k+j]] for t < tokens, summed in
/// order j; out (tokens, h) contiguous, y rows `ldy` apart, w (tokens * k) or null for ones.
/// Accumulates in f32 for 16-bit types (rounded once).
void moe_unpermute(DType dt, int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const void* y,
                   int64_t ldy, const void* w, void* out);

/// Per-slot dot products: d[s] = dot(a[s / k], b[slot_row[s]]) for s < tokens * k; a (tokens, h)
/// rows `lda` apart, b rows `ldb` apart, d (tokens * k). Accumulates in f32 for 16-bit types
/// (f64 for f64) in a fixed order.
void moe_slot_dot(DType dt, int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const void* a,
                  int64_t lda, const void* b, int64_t ldb, void* d);

}  // namespace quilt::kernels::cpu
