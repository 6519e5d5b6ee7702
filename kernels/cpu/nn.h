// Fused CPU kernels of the neural-network ops: row (log-)softmax, cross entropy, RMS and
// layer norm (forward and backward each), embedding gather / scatter-add. Every kernel works
// on contiguous rows, runs rows in parallel (OpenMP) and widens bf16/f16 to f32 inside a row;
// per-row statistics and losses are f32 (f64 for f64 tensors): see stat_dtype().
//
//   // y (rows, cols) = softmax of x (rows, cols) along cols
//   kernels::cpu::softmax_forward(DType::f32, y, x, rows, cols, /*log=*/false);
#pragma once

#include <cstdint>

#include "kernels/dtype.h"

namespace quilt::kernels::cpu {

/// dtype of per-row statistics (mean, rstd), losses and loss scales for data of dtype `dt`.
constexpr DType stat_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

/// out (rows, cols) = softmax or log-softmax of in (rows, cols) along each row.
void softmax_forward(DType dt, void* out, const void* in, int64_t rows, int64_t cols, bool log);
/// grad_in = y * (g - sum(g * y)) (softmax) or g - exp(y) * sum(g) (log-softmax), per row;
/// `out` is the forward output y. All (rows, cols).
void softmax_backward(DType dt, void* grad_in, const void* grad_out, const void* out, int64_t rows, int64_t cols,
                      bool log);

/// loss (rows, stat_dtype) = logsumexp(logits[r]) - logits[r][target[r]], 0 where the target is
/// `ignore_index`. logits (rows, cols) of `dt`; target (rows) of `target_dt` (i32/i64), already
/// checked to be in [0, cols) or ignore_index.
void cross_entropy_forward(DType dt, void* loss, const void* logits, DType target_dt, const void* target,
                           int64_t rows, int64_t cols, int64_t ignore_index);
/// grad_logits[r] (rows, cols) = scale[r] * (softmax(logits[r]) - onehot(target[r])), zero rows
/// where ignored; scale (rows, stat_dtype).
void cross_entropy_backward(DType dt, void* grad_logits, const void* logits, DType target_dt, const void* target,
                            const void* scale, int64_t rows, int64_t cols, int64_t ignore_index);

/// y (rows, cols) = x * rstd * weight with rstd[r] = 1 / sqrt(mean(x[r]^2) + eps) written to
/// rstd (rows, stat_dtype); weight (cols) may be null (no scaling).
void rms_norm_forward(DType dt, void* y, void* rstd, const void* x, const void* weight, int64_t rows, int64_t cols,
                      double eps);
/// grad_x (rows, cols) and grad_weight (cols; null: not wanted) of rms_norm given g (rows, cols),
/// the forward's x, weight (may be null) and rstd. grad_weight sums rows in a fixed order.
void rms_norm_backward(DType dt, void* grad_x, void* grad_weight, const void* g, const void* x, const void* weight,
                       const void* rstd, int64_t rows, int64_t cols);

/// y = (x - mean) * rstd * weight + bias per row (biased variance); writes mean and rstd
/// (rows, stat_dtype); weight and bias (cols) may be null.
void layer_norm_forward(DType dt, void* y, void* mean, void* rstd, const void* x, const void* weight,
                        const void* bias, int64_t rows, int64_t cols, double eps);
/// grad_x (rows, cols), grad_weight and grad_bias (cols; null: not wanted) of layer_norm.
void layer_norm_backward(DType dt, void* grad_x, void* grad_weight, void* grad_bias, const void* g, const void* x,
                         const void* weight, const void* mean, const void* rstd, int64_t rows, int64_t cols);

/// out (n, dim) = weight[index[i]] rows; weight (vocab, dim); index (n) of `index_dt`, already
/// checked to lie in [0, vocab).
void embedding_forward(DType dt, void* out, const void* weight, DType index_dt, const void* index, int64_t n,
                       int64_t dim);
/// grad_weight (vocab, dim) = sum over i with index[i] == v of grad_out[i] (n, dim), zero rows
/// elsewhere. Duplicates accumulate in f32 (f64) in the order of i, so results are deterministic.
void embedding_backward(DType dt, void* grad_weight, const void* grad_out, DType index_dt, const void* index,
                        int64_t n, int64_t vocab, int64_t dim);

}  // namespace quilt::kernels::cpu
