// Mixture-of-experts ops: the grouped matrix product of routed experts and the token
// permutation around it.
//
// A router picks k experts per token: expert_idx (T, k). moe_route() stably sorts the T*k
// (token, slot) pairs by expert; moe_permute() copies token rows into that expert-major order,
// so that expert e's rows are one contiguous group; grouped_mm() multiplies each group by its
// expert's matrix; moe_unpermute() brings the rows back and sums each token's k results with
// the router's weights, in slot order (deterministic: the same bits every run and layout).
//
//   MoeRouting r = moe_route(expert_idx, E);                   // order (T*k), counts (E), offsets (E)
//   Tensor xs = moe_permute(x, r.order, k);                    // (T*k, H), grouped by expert
//   Tensor h = swiglu(grouped_mm(xs, w1t, r.offsets), grouped_mm(xs, w3t, r.offsets));
//   Tensor y = moe_unpermute(grouped_mm(h, w2t, r.offsets), r.order, weights);   // (T, H)
//
// All are primitives with CPU and CUDA kernels and backward formulas in ops; integer inputs
// (order, offsets, expert_idx) get no gradient. On CUDA nothing waits for the device except
// moe_route's host_counts; offsets and orders are read there unchecked (the CPU checks them).
// Sharding rules (dtensor/rules/moe.cpp): w Shard(2) -> out Shard(1) (column-parallel
// experts), x and w Shard(1) -> Partial (row-parallel), hidden-dim shards pass through
// moe_permute / moe_unpermute; offsets and order stay replicated.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/tensor.h"

namespace quilt {

/// Grouped matrix product. x (M, K) holds the rows of E groups back to back: group e is rows
/// [offsets[e-1], offsets[e]) (offsets[-1] = 0); w (E, K, N) holds one matrix per group; the
/// result (M, N) has row i = x[i] @ w[group of i]. offsets is a 1-D i32/i64 tensor of E
/// non-decreasing cumulative row ends with offsets[E-1] == M (empty groups allowed). w may be a
/// transposed view (E, N, K).transpose(1, 2) (no copy: the GEMM reads it transposed).
/// Gradients: dx is grouped the same way (dY_e @ w_e^T), dw_e = x_e^T @ dY_e (zero for empty
/// groups). Throws naming the shapes when they do not fit, and the offset that is out of order.
Tensor grouped_mm(const Tensor& x, const Tensor& w, const Tensor& offsets);

/// The expert-major order of a routing: for expert_idx (T, k) of integers in [0, E),
///   order   (T*k) i64: permuted row p holds slot order[p] (slot s = token s / k, choice s % k),
///           sorted by expert, ties in slot order (stable);
///   counts  (E) i64: rows per expert;   offsets (E) i64: cumulative counts (grouped_mm's);
///   host_counts: counts as a host vector (what all-to-all splits are made of).
/// Throws naming the first expert index outside [0, E).
struct MoeRouting {
  Tensor order, counts, offsets;
  std::vector<int64_t> host_counts;
};
MoeRouting moe_route(const Tensor& expert_idx, int64_t num_experts);

/// Rows of x (T, H) in routed order: out[p] = x[order[p] / k], (T*k, H). order is a 1-D
/// i32/i64 permutation of [0, T*k) (throws naming the first entry out of range or repeated).
/// The gradient sums each token's k rows in slot order (deterministic).
Tensor moe_permute(const Tensor& x, const Tensor& order, int64_t k);

/// The weighted combine back to tokens: for y (T*k, H) in routed order and weights (T, k),
/// out[t] = sum_{j=0..k-1} weights[t, j] * y[row of slot t*k+j], (T, H), summed in slot order j
/// (deterministic, no atomics). Computed in y's dtype with f32 accumulation for 16-bit types;
/// weights are cast to y's dtype. order as in moe_permute. Gradients to y (dy[row of slot s] =
/// weights[s] * dout[s / k]) and to weights (dw[t, j] = dot(dout[t], y[row of slot t*k+j])).
Tensor moe_unpermute(const Tensor& y, const Tensor& order, const Tensor& weights);

}  // namespace quilt
