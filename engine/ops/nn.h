// Neural-network ops: softmax family, cross entropy, embedding, norms, rotary embedding,
// attention, swiglu, dropout.
//
// softmax, log_softmax, cross_entropy, rms_norm, add_rms_norm, layer_norm, embedding, swiglu
// and rotary_embedding are primitives with fused CPU kernels (kernels/cpu/nn.h), forward and
// backward; softmax and cross_entropy also run on CUDA. bf16/f16 inputs are computed in f32
// inside the kernels and rounded once. swiglu, add_rms_norm and rotary_embedding take their
// composite form (other ops) for distributed or CUDA tensors, rotary_embedding also when a
// table needs a gradient; scaled_dot_product_attention is a primitive with a flash-style CPU
// kernel (kernels/cpu/attention.h: tiled, online softmax, backward from the row log-sum-exp)
// and its composite form for a bool mask or CUDA tensors; the CUDA path of dropout is a
// composite, so it runs wherever those ops do. Ops without a CUDA kernel throw
// "[op] has no CUDA implementation in this build" for CUDA tensors. The backward of
// softmax, log_softmax, cross_entropy, embedding and dropout is itself differentiable in the
// incoming gradient; that of the norms is not (it throws "[rms_norm_backward] is not differentiable").
//
//   Tensor h = rms_norm(embedding(wte, tokens), norm_w);           // (B, T, D)
//   Tensor a = scaled_dot_product_attention(q, k, v, {}, /*causal=*/true);
//   Tensor loss = cross_entropy(logits.view({-1, V}), targets.view({-1}));
#pragma once

#include <optional>
#include <utility>

#include "engine/random.h"
#include "engine/tensor.h"

namespace quilt {

/// exp(x) / sum(exp(x)) along `dim` (max-subtracted). A row of all -inf gives NaN, as in PyTorch.
Tensor softmax(const Tensor& x, int64_t dim = -1);
/// x - logsumexp(x) along `dim` (max-subtracted).
Tensor log_softmax(const Tensor& x, int64_t dim = -1);

enum class Reduction { mean, sum, none };
/// Cross entropy of logits (*, C) against class indices (*) (i32/i64); usually (N, C) and (N).
/// Targets equal to `ignore_index` contribute 0 and no gradient. `mean` divides the sum by the
/// number of counted targets; when there are none (all ignored, or no rows) the mean is NaN, as
/// in PyTorch. `none` returns the per-target losses (shape *). Losses are computed and reduced
/// in f32 (f64 for f64 logits); the result has the logits' dtype. Throws naming the first
/// target outside [0, C) that is not ignore_index.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::mean);
/// Rows of `weight` (V, D) picked by integer `indices` (any shape, i32/i64) -> indices.shape + (D).
/// Throws naming the first index outside [0, V). The weight gradient sums duplicates deterministically.
Tensor embedding(const Tensor& weight, const Tensor& indices);
/// x / sqrt(mean(x^2, -1) + eps) * weight (weight (D) over the last dim; may be undefined).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
/// (h, y) with h = x + residual and y = rms_norm(h, weight, eps), in one pass (the residual
/// add of a pre-norm block fused into the norm that follows it); both carry gradients, and
/// the backward adds h's own gradient to the norm's in the same pass. residual: x's shape and dtype.
std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                       double eps = 1e-6);
/// (x - mean) / sqrt(var + eps) * weight + bias over the last dim, biased variance
/// (weight/bias (D) may be undefined).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
/// Rotary embedding of x (..., T, D) with cos/sin tables broadcastable to (..., T, D/2) — usually
/// x (B, H, T, D) and tables (T, D/2) — rotating pairs (x[..., i], x[..., i + D/2]) as HF Llama's
/// rotate_half does. The tables are cast to x's dtype (then computed in f32 for bf16/f16 x).
/// Returns a contiguous tensor of x's shape.
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin);
/// What scaled_dot_product_attention masks and how it scales. Causal and document masks combine:
/// a query sees a key only when both allow it.
struct AttentionOptions {
  bool causal = false;
  std::optional<double> scale{};           // default 1/sqrt(D)
  std::optional<int64_t> causal_offset{};  // causal: query i sees key j iff j <= i + offset; default S - T
  Tensor document_ids{};      // (B, T) i32/i64: a query sees only keys of its own document
  Tensor key_document_ids{};  // (B, S) the keys' documents, when S != T (a KV cache, a ring step)
  Tensor cu_seqlens{};        // (N + 1) i32/i64, instead of document_ids: document r is tokens
                              // [cu[r], cu[r + 1]) of every batch row, 0 = cu[0] <= ... <= cu[N] = T
  // Causal by position instead of by index (needs causal; causal_offset is then unused): query
  // i sees key j iff key_positions[j] <= positions[i]. Context-parallel chunks and ring steps
  // hold tokens out of order; the kernel still skips the tiles these positions hide.
  Tensor positions{};      // (T) or (B, T) i32/i64: the queries' positions
  Tensor key_positions{};  // (S) or (B, S) the keys' positions, when S != T (default: positions)
  bool composite = false;     // run the composite of matmul/softmax/where (what CUDA tensors run)
};
/// An attention output with each query's log-sum-exp, so partial attentions over disjoint key
/// ranges merge: lse = logaddexp(lse1, lse2), out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2.
struct AttentionOutput {
  Tensor out;  // (B, Hq, T, Dv)
  Tensor lse;  // (B, Hq, T): log(sum_j exp(scale q_i.k_j)) over the keys seen, -inf where none; f32 (f64 for f64)
};
/// Scaled dot-product attention. q (B, Hq, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) with Hq a
/// multiple of Hkv (grouped-query heads: query head h reads kv head h / (Hq / Hkv); k and v are
/// never copied per query head). A query that may attend no key gets zeros (and zero
/// gradients), not NaN. On CPU a fused primitive (flash-style: tiles with an online softmax,
/// no (T, S) matrix kept; the backward recomputes from lse); both outputs carry gradients.
/// Call it with designated options, `scaled_dot_product_attention(q, k, v, {.causal = true})`.
AttentionOutput scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options);
/// The output alone, with an optional bool `mask` (broadcastable to (B, Hq, T, S), true = attend,
/// which runs the composite); `causal` lets query i see keys j <= i + (S - T) (aligned at the end
/// when S != T). `scale` defaults to 1/sqrt(D). Returns (B, Hq, T, Dv).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& mask = {}, bool causal = false,
                                    std::optional<double> scale = std::nullopt);
/// silu(gate) * up (broadcasting).
Tensor swiglu(const Tensor& gate, const Tensor& up);
/// Zeroes each element with probability p and scales the rest by 1/(1-p); identity if !train
/// or p == 0. Element i (row-major index) is kept iff its Philox draw for (key.seed, key.key, i)
/// exceeds p, so the mask depends only on (seed, key, index) — see dropout_mask().
/// The gradient reuses the same mask.
Tensor dropout(const Tensor& x, double p, RngKey key, bool train = true);
/// dropout() with a key drawn from `gen` (so checkpointed recomputation can replay it).
Tensor dropout(const Tensor& x, double p, Generator& gen, bool train = true);
/// The keep-mask (bool, true = kept) that dropout(x, p, key) applies to a tensor of `shape`.
Tensor dropout_mask(const Shape& shape, double p, RngKey key, Device device = Device::cpu());

}  // namespace quilt
