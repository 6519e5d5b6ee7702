// Context parallelism: the sequence dim sharded over the `cp` mesh axis, and attention across it.
//
// Layout: a sequence of T tokens is cut into 2·cp equal chunks and rank r holds chunks r and
// 2·cp−1−r, in that order, so that under a causal mask every rank has the same work (an early
// chunk pairs with a late one). Packed rows do the same per document. Tokens, targets and
// positions are reordered once, when the batch is laid out; attention then masks by the
// tokens' global positions, so no other layer needs to know the order.
//
// context_parallel_attention computes causal attention of this rank's queries against the keys
// of every rank, three ways (distributed.cp_comm_type): `ring` rotates K/V blocks around the cp
// ring with asynchronous send/recv under each block's computation and merges the partial
// outputs by their log-sum-exp; `all_gather` gathers K/V once; `a2a` (Ulysses) trades the
// sequence cut for a head cut with an all-to-all and back.
//
//   const std::vector<int64_t> idx = cp_token_indices(seq_len, cp, rank);
//   Tensor tokens_local = cp_shard_sequence(tokens, 1, idx), pos_local = cp_shard_sequence(pos, 0, idx);
//   Tensor y = context_parallel_attention(q, k, v, pos_local, {}, meshes["cp"].comm_ptr(0), CpCommType::ring);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "engine/tensor.h"

namespace quilt {

/// How context-parallel attention exchanges K/V (config key distributed.cp_comm_type).
enum class CpCommType { ring, all_gather, a2a };

/// "ring", "all_gather" or "a2a".
const char* cp_comm_type_name(CpCommType type);
/// The comm type named `name`; throws naming distributed.cp_comm_type and the valid names otherwise.
CpCommType parse_cp_comm_type(const std::string& name);

/// Indices (into 0..seq_len) of the tokens rank `rank` holds, in its order: chunks rank and
/// 2·cp−1−rank of 2·cp equal chunks. Throws naming seq_len and 2·cp unless 2·cp divides seq_len.
std::vector<int64_t> cp_token_indices(int64_t seq_len, int cp, int rank);
/// The per-document layout of a packed row whose documents are [cu[i], cu[i + 1]) (cu (N + 1),
/// 0 = cu[0] <= ... <= cu[N] = row length): each document is cut into 2·cp chunks and rank r
/// takes chunks r and 2·cp−1−r of every document, documents in order. Throws naming the
/// document and its length unless 2·cp divides every document's length.
std::vector<int64_t> cp_document_token_indices(const std::vector<int64_t>& cu_seqlens, int cp, int rank);
/// x with dim `dim` reordered to `indices` (a rank's tokens from cp_token_indices); differentiable.
Tensor cp_shard_sequence(const Tensor& x, int64_t dim, const std::vector<int64_t>& indices);

/// Causal attention of this rank's tokens against the whole sequence held over `cp_comm`.
/// q (B, Hq, T, D), k (B, Hkv, T, D), v (B, Hkv, T, Dv) are this rank's T tokens (any order, in
/// practice the load-balanced layout), `positions` ((T) or (B, T), i32/i64) their global
/// positions: query i sees key j iff position(j) <= position(i), and, with `document_ids`
/// ((B, T) integers, or undefined), only keys of its own document. Every rank holds the same
/// B, heads and T. Returns (B, Hq, T, Dv) with gradients to q, k and v; the same as one rank's
/// scaled_dot_product_attention on the whole sequence. a2a needs Hq and Hkv divisible by the cp
/// size. Distributed q, k, v cut along batch or heads (data or tensor parallel) run on their
/// shards. CPU only in this build.
Tensor context_parallel_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
                                  const Tensor& document_ids, const std::shared_ptr<Communicator>& cp_comm,
                                  CpCommType type = CpCommType::ring);

/// The forward attention work of one rank, per batch row, in FLOPs (4·D per (query, key) pair:
/// two products of 2·D).
struct CpAttentionFlops {
  double visible = 0;   // pairs the causal (and document) mask lets through
  double computed = 0;  // pairs in the tiles the CPU kernel computes (it skips hidden tiles)
};
/// What rank `rank` of `cp` does for a row of `seq_len` tokens in the load-balanced layout (per
/// document when `cu_seqlens` is given) with `heads` query heads of size `head_dim`, under `type`.
CpAttentionFlops context_parallel_attention_flops(int64_t seq_len, int cp, int rank, CpCommType type, int64_t heads,
                                                  int64_t head_dim, const std::vector<int64_t>& cu_seqlens = {});

}  // namespace quilt
