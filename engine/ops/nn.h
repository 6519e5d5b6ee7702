// Neural-network ops: softmax family, losses, embedding, norms, rotary embedding,
// attention, swiglu, dropout.
//
//   Tensor loss = cross_entropy(logits.view({-1, V}), targets.view({-1}));
#pragma once

#include <optional>

#include "engine/random.h"
#include "engine/tensor.h"

namespace quilt {

Tensor softmax(const Tensor& x, int64_t dim = -1);
Tensor log_softmax(const Tensor& x, int64_t dim = -1);

enum class Reduction { mean, sum, none };
/// Cross entropy of logits (N, C) against class indices (N) (i32/i64). Targets equal to
/// `ignore_index` contribute nothing; `mean` divides by the number of counted targets.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::mean);
/// Rows of `weight` (V, D) picked by integer `indices` (any shape) -> indices.shape + (D).
Tensor embedding(const Tensor& weight, const Tensor& indices);
/// x / sqrt(mean(x^2, -1) + eps) * weight (weight over the last dim; may be undefined).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
/// (x - mean) / sqrt(var + eps) * weight + bias over the last dim (weight/bias may be undefined).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
/// Rotary embedding of x (B, H, T, D) with cos/sin tables (T, D/2), rotating pairs
/// (x[..., i], x[..., i + D/2]) as HF Llama's rotate_half does.
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin);
/// Scaled dot-product attention. q (B, Hq, T, D), k/v (B, Hkv, S, D) with Hq a multiple of Hkv
/// (grouped-query heads); `mask` (broadcastable to (B, Hq, T, S), bool: true = attend) optional;
/// `causal` masks keys after the query position (aligned at the end when S > T).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& mask = {}, bool causal = false,
                                    std::optional<double> scale = std::nullopt);
/// silu(gate) * up.
Tensor swiglu(const Tensor& gate, const Tensor& up);
/// Zeroes each element with probability p and scales the rest by 1/(1-p); identity if !train.
Tensor dropout(const Tensor& x, double p, RngKey key, bool train = true);
/// dropout() with a key drawn from `gen` (so checkpointed recomputation can replay it).
Tensor dropout(const Tensor& x, double p, Generator& gen, bool train = true);

}  // namespace quilt
