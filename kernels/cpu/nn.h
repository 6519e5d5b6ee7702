// Fused CPU kernels of the neural-network ops: row (log-)softmax, cross entropy, RMS and
// layer norm (the RMS norm also with a residual add in front), SwiGLU, rotary embedding
// (forward and backward each), embedding gather / scatter-add. Every kernel works
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
/// checked to be in [0, cols) or ignore_index. When `lse` (rows, stat_dtype) is not null it
/// receives logsumexp(logits[r]) of every counted row (0 where ignored), for the backward.
void cross_entropy_forward(DType dt, void* loss, const void* logits, DType target_dt, const void* target,
                           int64_t rows, int64_t cols, int64_t ignore_index, void* lse = nullptr);
/// grad_logits[r] (rows, cols) = scale[r] * (softmax(logits[r]) - onehot(target[r])), zero rows
/// where ignored; scale (rows, stat_dtype). With the forward's `lse` (rows, stat_dtype) each row
/// is one pass, exp(x - lse) * scale; without (null) the row's logsumexp is recomputed first.
void cross_entropy_backward(DType dt, void* grad_logits, const void* logits, DType target_dt, const void* target,
                            const void* scale, int64_t rows, int64_t cols, int64_t ignore_index,
                            const void* lse = nullptr);

/// y (rows, cols) = x * rstd * weight with rstd[r] = 1 / sqrt(mean(x[r]^2) + eps) written to
/// rstd (rows, stat_dtype); weight (cols) may be null (no scaling).
void rms_norm_forward(DType dt, void* y, void* rstd, const void* x, const void* weight, int64_t rows, int64_t cols,
                      double eps);
/// grad_x (rows, cols) and grad_weight (cols; null: not wanted) of rms_norm given g (rows, cols),
/// the forward's x, weight (may be null) and rstd. grad_weight sums rows in a fixed order.
void rms_norm_backward(DType dt, void* grad_x, void* grad_weight, const void* g, const void* x, const void* weight,
                       const void* rstd, int64_t rows, int64_t cols);

/// h = x + r, then y = rms_norm(h) as rms_norm_forward does, in one pass over the rows: x, r,
/// h, y (rows, cols); rstd (rows, stat_dtype); weight (cols) may be null. h is rounded to `dt`
/// before it is normalised, so y equals rms_norm_forward of the stored h.
void add_rms_norm_forward(DType dt, void* h, void* y, void* rstd, const void* x, const void* r, const void* weight,
                          int64_t rows, int64_t cols, double eps);
/// rms_norm_backward plus a second gradient that reaches h directly: grad_h = rms-norm
/// gradient of g (rows, cols) + g_h (rows, cols), one pass (the residual's gradient add fused).
void add_rms_norm_backward(DType dt, void* grad_h, void* grad_weight, const void* g, const void* g_h,
                           const void* h, const void* weight, const void* rstd, int64_t rows, int64_t cols);

/// y = (x - mean) * rstd * weight + bias per row (biased variance); writes mean and rstd
/// (rows, stat_dtype); weight and bias (cols) may be null.
void layer_norm_forward(DType dt, void* y, void* mean, void* rstd, const void* x, const void* weight,
                        const void* bias, int64_t rows, int64_t cols, double eps);
/// grad_x (rows, cols), grad_weight and grad_bias (cols; null: not wanted) of layer_norm.
void layer_norm_backward(DType dt, void* grad_x, void* grad_weight, void* grad_bias, const void* g, const void* x,
                         const void* weight, const void* mean, const void* rstd, int64_t rows, int64_t cols);

/// out (n) = silu(gate) * up = gate / (1 + exp(-gate)) * up; all contiguous of `dt`.
void swiglu_forward(DType dt, void* out, const void* gate, const void* up, int64_t n);
/// grad_gate = g * up * s * (1 + gate * (1 - s)) with s = sigmoid(gate), grad_up = g * silu(gate);
/// all (n) contiguous of `dt`.
void swiglu_backward(DType dt, void* grad_gate, void* grad_up, const void* g, const void* gate, const void* up,
                     int64_t n);

/// Where rotary_embedding's operands live. x is (lead..., D) with the last dim contiguous and
/// the leading dims strided (`x_strides`, elements); cos/sin tables are (lead..., D/2) of the
/// compute type with broadcast strides (`table_strides`, 0 along broadcast dims; last dim
/// contiguous). The output is contiguous (rows, D), rows = prod(lead).
struct RopeLayout {
  int ndim = 0;                    // leading dims
  int64_t lead[16] = {};           // outermost first
  int64_t x_strides[16] = {};
  int64_t table_strides[16] = {};
  int64_t d = 0;                   // last dim of x (even)
};
/// out[..., i] = x1 * cos - x2 * sin, out[..., i + D/2] = x2 * cos + x1 * sin per row
/// (x1 = x[..., :D/2], x2 = x[..., D/2:]); `inverse` rotates by -sin (the backward: R^T g).
/// cos/sin are of stat_dtype(dt).
void rope_forward(DType dt, void* out, const void* x, const void* cos, const void* sin, const RopeLayout& l,
                  bool inverse);

/// out (n, dim) = weight[index[i]] rows; weight (vocab, dim); index (n) of `index_dt`, already
/// checked to lie in [0, vocab).
void embedding_forward(DType dt, void* out, const void* weight, DType index_dt, const void* index, int64_t n,
                       int64_t dim);
/// grad_weight (vocab, dim) = sum over i with index[i] == v of grad_out[i] (n, dim), zero rows
/// elsewhere. Duplicates accumulate in f32 (f64) in the order of i, so results are deterministic.
void embedding_backward(DType dt, void* grad_weight, const void* grad_out, DType index_dt, const void* index,
                        int64_t n, int64_t vocab, int64_t dim);

}  // namespace quilt::kernels::cpu
