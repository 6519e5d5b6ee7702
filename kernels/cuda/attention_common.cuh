// Internal to the CUDA attention kernels (attention.cu: the WMMA kernels and the host entry
// points; attention_mma.cu, attention_mma_backward.cu: the mma.sync forward and backward): the
// call's sizes and mask as the kernels read them, the tile-skipping tests they share, and the
// mma.sync kernels' entries.
//
//   const Params p = attention_params(a, ptrs, 4);
//   if (!attention_forward_mma(dt, a, p, out, lse, q, k, v, stream)) { /* the WMMA kernel */ }
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/common.cuh"

namespace quilt::kernels::cuda {

// The call's sizes and mask, as the kernels read them.
struct Params {
  int64_t batch, hq, hkv, t, s;
  float scale;
  bool causal;
  int64_t offset;                        // causal by index: query i sees key j iff j <= i + offset
  const int32_t *q_doc, *k_doc;          // (B, T), (B, S) or null
  const int32_t *q_pos, *k_pos;          // (B, T), (B, S) or null (causal by position)
  bool vec;                              // every tensor pointer is 16-byte aligned
  __host__ __device__ bool by_pos() const { return causal && q_pos != nullptr; }
  __host__ __device__ bool by_index() const { return causal && q_pos == nullptr; }
};

/// Params of a call; `vec` says every non-null pointer of ptrs[0, n) is 16-byte aligned.
inline Params attention_params(const AttentionArgs& a, const void* const* ptrs, int n) {
  bool vec = true;
  for (int i = 0; i < n; ++i) vec = vec && (ptrs[i] == nullptr || aligned_to(ptrs[i], 16));
  return Params{a.batch, a.q_heads, a.kv_heads, a.t, a.s, float(a.scale), a.causal, a.causal_offset,
                a.q_doc, a.k_doc, a.q_pos, a.k_pos, vec};
}

/// Opt-in shared memory per block of the current device (cached per device).
inline size_t smem_optin() {
  static size_t cache[64] = {};
  int dev = 0;
  QUILT_CHECK_CUDA(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  if (cache[dev] == 0) {
    int v = 0;
    QUILT_CHECK_CUDA(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    cache[dev] = size_t(v);
  }
  return cache[dev];
}

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

/// The block of `rows` queries of one (batch, head) a thread block owns, from blockIdx.x. Later
/// query blocks see more keys under a causal mask: they get the low block indices.
struct QueryBlock {
  int64_t b, h, kvh;  // batch, query head, its kv head
  int64_t q0;         // first query of the block
  int nq;             // queries in the block (fewer in the last)
  int64_t qrow;       // first row of q (and of out, dout, lse, ...)
  int64_t krow;       // first row of k and v
};
__device__ __forceinline__ QueryBlock query_block(const Params& p, int rows) {
  const int64_t nqb = (p.t + rows - 1) / rows;
  const int64_t bh = int64_t(blockIdx.x) % (p.batch * p.hq);
  QueryBlock qb;
  qb.q0 = (nqb - 1 - int64_t(blockIdx.x) / (p.batch * p.hq)) * rows;
  qb.b = bh / p.hq;
  qb.h = bh % p.hq;
  qb.kvh = qb.h / (p.hq / p.hkv);
  qb.nq = int(imin(rows, p.t - qb.q0));
  qb.qrow = bh * p.t + qb.q0;
  qb.krow = (qb.b * p.hkv + qb.kvh) * p.s;
  return qb;
}

// Min and max of a[0, n) (n >= 1), read by one warp from global memory; every lane gets them.
__device__ __forceinline__ void warp_minmax(const int32_t* a, int n, int& lo, int& hi) {
  const int lane = threadIdx.x & 31;
  lo = INT_MAX;
  hi = INT_MIN;
  for (int i = lane; i < n; i += 32) {
    lo = min(lo, a[i]);
    hi = max(hi, a[i]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
}

// Whether the tile of queries [q0, q0 + nq) and keys [k0, k0 + nk) of batch row b has a pair
// the position or document mask lets through (causal by index is handled by loop bounds).
// Every warp computes the same answer, so the block branches uniformly.
__device__ inline bool tile_open(const Params& p, int64_t b, int64_t q0, int nq, int64_t k0, int nk) {
  int qlo, qhi, klo, khi;
  if (p.by_pos()) {
    warp_minmax(p.q_pos + b * p.t + q0, nq, qlo, qhi);
    warp_minmax(p.k_pos + b * p.s + k0, nk, klo, khi);
    if (klo > qhi) return false;
  }
  if (p.q_doc) {
    warp_minmax(p.q_doc + b * p.t + q0, nq, qlo, qhi);
    warp_minmax(p.k_doc + b * p.s + k0, nk, klo, khi);
    if (qhi < klo || khi < qlo) return false;
  }
  return true;
}

// Keys a query block [q0, q0 + nq) may see under the causal rule by index: up to key
// q0 + nq - 1 + offset (exclusive end, clamped to [0, S]).
__device__ __forceinline__ int64_t causal_end(const Params& p, int64_t q0, int nq) {
  if (!p.by_index()) return p.s;
  const int64_t e = q0 + nq + p.offset;
  return e < 0 ? 0 : (e > p.s ? p.s : e);
}
// The first query a key block [k0, ...) is seen by under the causal rule by index.
__device__ __forceinline__ int64_t causal_begin(const Params& p, int64_t k0) {
  if (!p.by_index()) return 0;
  const int64_t b = k0 - p.offset;
  return b < 0 ? 0 : b;
}

/// The mma.sync forward (attention_mma.cu) when it takes the call (bf16 or f16, D 64 or 128,
/// 16-byte aligned pointers, enough shared memory): launches it and returns true; otherwise
/// returns false and launches nothing.
bool attention_forward_mma(DType dt, const AttentionArgs& a, const Params& p, void* out, void* lse, const void* q,
                           const void* k, const void* v, cudaStream_t stream);

/// The mma.sync backward (attention_mma_backward.cu) when it takes the call (as the forward):
/// launches its dK/dV and dQ kernels, which read delta (B, Hq, T) = rowsum(dO ∘ O) - dlse, and
/// returns true; otherwise returns false and launches nothing.
bool attention_backward_mma(DType dt, const AttentionArgs& a, const Params& p, void* dq, void* dk, void* dv,
                            const void* dout, const void* q, const void* k, const void* v, const float* lse,
                            const float* delta, cudaStream_t stream);

}  // namespace quilt::kernels::cuda
