// Fused CPU attention (flash style): out = softmax(scale · Q Kᵀ, masked) V and its backward,
// computed over tiles of queries and keys with an online softmax, so no (T, S) matrix is ever
// formed; tiles a causal, position or document mask hides entirely are skipped, not computed
// (a tile's position or document range, its min and max, tells). The
// backward recomputes each tile's probabilities from Q, K and the forward's log-sum-exp.
// bf16/f16 tiles are widened to f32 and results rounded once; f64 computes in f64.
//
//   AttentionArgs a{.batch = 1, .q_heads = 8, .kv_heads = 2, .t = 512, .s = 512, .d = 64, .dv = 64,
//                   .scale = 0.125, .causal = true};
//   kernels::cpu::attention_forward(DType::f32, a, out, lse, q, k, v);
#pragma once

#include <cstdint>

#include "kernels/dtype.h"

namespace quilt::kernels::cpu {

/// Sizes and mask of one attention call. Every tensor is contiguous: q, dq (B, Hq, T, D),
/// k, dk (B, Hkv, S, D), v, dv (B, Hkv, S, Dv), out, dout (B, Hq, T, Dv), lse, dlse (B, Hq, T)
/// of stat_dtype (f32, f64 for f64). Query head h reads kv head h / (Hq / Hkv).
struct AttentionArgs {
  int64_t batch = 0, q_heads = 0, kv_heads = 0;
  int64_t t = 0, s = 0, d = 0, dv = 0;  // queries, keys, head dim of q/k, head dim of v
  double scale = 1.0;
  bool causal = false;
  int64_t causal_offset = 0;       // causal: query i sees key j iff j <= i + causal_offset
  const int32_t* q_doc = nullptr;  // (B, T) document of each query; null: no document mask
  const int32_t* k_doc = nullptr;  // (B, S) document of each key (given with q_doc)
  // Causal by position instead of by index (context-parallel chunks, a ring step's keys): with
  // causal, query i sees key j iff k_pos[j] <= q_pos[i]; causal_offset is then unused.
  const int32_t* q_pos = nullptr;  // (B, T) position of each query; null: causal by index
  const int32_t* k_pos = nullptr;  // (B, S) position of each key (given with q_pos)
};

/// out and lse = log(sum_j exp(scale · q_i·k_j)) over the keys query i may see; a query that
/// sees no key gets out = 0 and lse = -inf.
void attention_forward(DType dt, const AttentionArgs& a, void* out, void* lse, const void* q, const void* k,
                       const void* v);
/// The (query, key) pairs, over every batch row and query head, of the tiles attention_forward
/// computes (those the mask does not hide entirely): the work it does, for load-balance counts.
int64_t attention_forward_pairs(const AttentionArgs& a);
/// dq, dk, dv of attention_forward given dout, dlse (the gradient of lse; null: zero) and the
/// forward's out and lse. dk and dv sum over the query heads of their group.
void attention_backward(DType dt, const AttentionArgs& a, void* dq, void* dk, void* dv, const void* dout,
                        const void* dlse, const void* q, const void* k, const void* v, const void* out,
                        const void* lse);

}  // namespace quilt::kernels::cpu
