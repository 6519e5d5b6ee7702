// The FlashAttention-2 style backward for bf16/f16 (see attention.h; opt-in through
// set_attention_backward_kernel or QUILT_CUDA_ATTENTION_BWD=mma, the WMMA kernels in
// attention.cu otherwise): given delta = rowsum(dO ∘ O) - dlse (attention.cu's delta kernel),
// two kernels, each output element summed by one CTA in a fixed order (deterministic, no
// atomics), both built from attention_mma.cuh's two warp products on ldmatrix operands:
//
// dK/dV: a CTA is 8 warps over 128 keys of one kv head; warp w owns keys [16w, 16w + 16). It
// loops over the query heads of the kv head's GQA group and their blocks of 64 queries (Q and
// dO double-buffered by cp.async), working on the transposed scores so that every product
// keeps its left operand in registers:
//   Sᵀ  = K Qᵀ              (16 x 64 a warp; K rows as A, Q rows as the B of X Yᵀ)
//   Pᵀ  = 2^(scale log2e Sᵀ - log2e lse[query])   (the forward's probabilities, recomputed)
//   dV += Pᵀ dO             (Pᵀ's registers as A, dO through ldmatrix .trans as B)
//   dPᵀ = V dOᵀ             (V rows as A, dO rows as the B of X Yᵀ)
//   dSᵀ = Pᵀ ∘ (dPᵀ - delta[query])
//   dK += dSᵀ Q             (dSᵀ's registers as A, Q through .trans as B); dK · scale at the end.
// dK and dV (16 x D each a warp) stay in registers over the whole loop.
//
// dQ: a CTA is 8 warps over 128 queries of one head, warp w owning rows [16w, 16w + 16), looping
// over blocks of 64 keys (K and V double-buffered): S = Q Kᵀ, P, dP = dO Vᵀ, dS = P ∘ (dP -
// delta), dQ += dS K (K through .trans), as the forward's loop with dS in place of P.
//
// P and dS are rounded to 16 bits only as operands of the next product, as the forward's P.
// Masks as the forward's: blocks past the causal diagonal are never visited (loop bounds), blocks
// the documents or positions hide entirely are skipped (tile_open), a warp none of whose rows
// sees the block skips its products, and only diagonal, ragged, document and position blocks are
// masked element by element. Queries past T and queries that see no key (lse = -inf) get
// log2e lse = +inf, so their P is 0 without a mask. Keys past S need none in the dK/dV pass
// (their rows are computed and never stored).
//
// Shared memory (rows padded by 16 bytes) and registers a thread (ptxas, sm_90a, CUDA 13,
// __launch_bounds__(256, 1): one CTA of 8 warps an SM), 0 bytes spilled and no stack frame in
// every instance (bf16 and f16 alike):
//   dK/dV: K, V (128, D) + 2 stages of Q, dO (64, D) + lse, delta: 137 KiB at D 128, 73 KiB at
//          D 64; registers D 128: 246 (254 with documents or positions), D 64: 177 (191).
//          Pᵀ and dPᵀ go 32 queries at a time (two halves of a stage): of all 64 beside dK and
//          dV, ptxas spilled.
//   dQ:    Q, dO (128, D) + 2 stages of K, V (64, D): 136 KiB at D 128, 72 KiB at D 64;
//          registers D 128: 221 (231), D 64: 174 (189).
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention_mma.cuh"

namespace quilt::kernels::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kKvKeys = 16 * kWarps;  // keys a dK/dV CTA
constexpr int kKvQueries = 64;        // queries a dK/dV step (a pipeline stage)
constexpr int kQRows = 16 * kWarps;   // queries a dQ CTA
constexpr int kQKeys = 64;            // keys a dQ step (a pipeline stage)

// Shared memory of the dK/dV kernel in bytes: K, V, Q stages 0 and 1, dO stages 0 and 1, then
// the f32 log2e·lse and delta of each stage's queries.
template <int kD>
struct DkdvLayout {
  static constexpr int ld = kD + kMmaPad;  // row stride in elements
  static constexpr int kv = kKvKeys * ld * 2;
  static constexpr int qs = kKvQueries * ld * 2;  // one stage of Q or of dO
  static constexpr int rows = 2 * kKvQueries * 4;  // both stages of lse or of delta
  static constexpr int total = 2 * kv + 4 * qs + 2 * rows;
};

// Shared memory of the dQ kernel in bytes: Q, dO, K stages 0 and 1, V stages 0 and 1.
template <int kD>
struct DqLayout {
  static constexpr int ld = kD + kMmaPad;
  static constexpr int q = kQRows * ld * 2;
  static constexpr int kv = kQKeys * ld * 2;  // one stage of K or of V
  static constexpr int total = 2 * q + 4 * kv;
};

// log2e · lse of a query, +inf for one that sees no key (lse = -inf): 2^(x - inf) = 0.
__device__ __forceinline__ float lse2_of(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// A warp's 16 rows of an f32 accumulator (16 x kD: rows g, g + 8 of lane g·4 + tq), times
// `scale`, rounded to T and written to rows [r0, r0 + n) of a (rows, kD) matrix at dst, through
// the warp's own 16 rows of shared memory at so (row stride kD + kMmaPad, no other warp reads
// them) so that the global stores are whole 16-byte pieces.
template <class T, int kD>
__device__ __forceinline__ void store_rows(T* __restrict__ dst, T* so, const float (&c)[kD / 8][4], float scale,
                                           int n) {
  using E = Elem<T>;
  constexpr int ld = kD + kMmaPad;
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int j = 0; j < kD / 8; ++j) {
    const int col = 8 * j + 2 * tq;
    *reinterpret_cast<uint32_t*>(so + g * ld + col) = E::pack(c[j][0] * scale, c[j][1] * scale);
    *reinterpret_cast<uint32_t*>(so + (g + 8) * ld + col) = E::pack(c[j][2] * scale, c[j][3] * scale);
  }
  __syncwarp();
  constexpr int chunks = kD / 8;
#pragma unroll
  for (int it = 0; it < 16 * chunks / 32; ++it) {
    const int i = lane + 32 * it;
    const int r = i / chunks, col = (i % chunks) * 8;
    if (r < n) *reinterpret_cast<uint4*>(dst + int64_t(r) * kD + col) = *reinterpret_cast<const uint4*>(so + r * ld + col);
  }
}

template <int kN>
__device__ __forceinline__ void zero(float (&c)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
}

// dK (scaled), dV of one block of kKvKeys keys of one kv head (B, Hkv, S, D); q, dout (B, Hq, T,
// D), lse and delta (B, Hq, T). kDocPos: the call has documents or causal positions.
template <class T, int kD, bool kDocPos>
__global__ void __launch_bounds__(kThreads, 1)
    attention_dkdv_mma_kernel(Params p, T* __restrict__ dk, T* __restrict__ dv, const T* __restrict__ dout,
                              const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const float* __restrict__ lse, const float* __restrict__ delta) {
  using L = DkdvLayout<kD>;
  using E = Elem<T>;
  constexpr int kDt = kD / 8;  // 16x8 tiles of dK, dV a warp
  extern __shared__ __align__(128) char smem[];
  const uint32_t sk = uint32_t(__cvta_generic_to_shared(smem));
  const uint32_t sv = sk + L::kv, sq = sv + L::kv, sdo = sq + 2 * L::qs;  // stage s at + s * L::qs
  float* lse_s = reinterpret_cast<float*>(smem + 2 * L::kv + 4 * L::qs);  // stage s at + s * kKvQueries
  float* delta_s = lse_s + 2 * kKvQueries;

  // Early key blocks are seen by the most queries under a causal mask: low block indices.
  const int64_t bkv = int64_t(blockIdx.x) % (p.batch * p.hkv);
  const int64_t k0 = (int64_t(blockIdx.x) / (p.batch * p.hkv)) * kKvKeys;
  const int64_t b = bkv / p.hkv, kvh = bkv % p.hkv, group = p.hq / p.hkv;
  const int nk = int(imin(kKvKeys, p.s - k0));
  const int64_t krow = bkv * p.s + k0;  // first row of k, v, dk, dv
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  const int row0 = 16 * warp;     // this warp's first key row in the block
  const int64_t ki0 = k0 + row0;  // and in the sequence
  const int g = lane >> 2, tq = lane & 3;

  // The first query block at or after q0 (a multiple of kKvQueries) that the documents or
  // positions let see a key of this block; T when none. The same for every head and warp.
  auto open_from = [&](int64_t q0) {
    if (kDocPos)
      while (q0 < p.t && !tile_open(p, b, q0, int(imin(kKvQueries, p.t - q0)), k0, nk)) q0 += kKvQueries;
    return q0;
  };
  // Q and dO of query block q0 of head kvh·group + hg into stage st (cp.async), and thread
  // tid's query's log2e·lse and delta into l2, dl.
  auto issue = [&](int st, int64_t hg, int64_t q0) {
    const int nq = int(imin(kKvQueries, p.t - q0));
    const int64_t qrow = (b * p.hq + kvh * group + hg) * p.t + q0;
    load_async<kD, kKvQueries, kThreads>(sq + st * L::qs, q + qrow * kD, nq);
    load_async<kD, kKvQueries, kThreads>(sdo + st * L::qs, dout + qrow * kD, nq);
  };
  auto rows_of = [&](int64_t hg, int64_t q0, float& l2, float& dl) {
    const int64_t qrow = (b * p.hq + kvh * group + hg) * p.t + q0;
    const bool in = q0 + tid < p.t;
    l2 = in ? lse2_of(lse[qrow + tid]) : INFINITY;
    dl = in ? delta[qrow + tid] : 0.f;
  };

  // (head of the group, query block) pairs in order, from (0, q_first); none when q_first is T.
  const int64_t q_first = open_from(causal_begin(p, k0) / kKvQueries * kKvQueries);
  int64_t hg = q_first < p.t ? 0 : group, qb = q_first;
  load_async<kD, kKvKeys, kThreads>(sk, k + krow * kD, nk);
  load_async<kD, kKvKeys, kThreads>(sv, v + krow * kD, nk);
  if (hg < group) {
    issue(0, hg, qb);
    if (tid < kKvQueries) rows_of(hg, qb, lse_s[tid], delta_s[tid]);
  }
  cp_async_commit();

  // This lane's two keys' document and position (masking only).
  int kd[2] = {0, 0}, kp[2] = {0, 0};
  lane_doc_pos<kDocPos>(p, true, b, ki0, g, kd, kp);

  float dka[kDt][4], dva[kDt][4];
  zero(dka);
  zero(dva);
  const float scale2 = p.scale * kLog2e;
  const uint32_t ka = sk + uint32_t(row0 * L::ld * 2) + a_lane(L::ld);  // this warp's K rows as A
  const uint32_t va = sv + uint32_t(row0 * L::ld * 2) + a_lane(L::ld);  // and V rows
  const uint32_t rows_b = bt_lane(L::ld), trans_b = a_lane(L::ld);      // Q, dO as B of X Yᵀ, of X Y

  int stage = 0;
#pragma unroll 1
  while (hg < group) {
    int64_t hn = hg, qn = open_from(qb + kKvQueries);
    if (qn >= p.t) {
      hn = hg + 1;
      qn = q_first;
    }
    float nl2 = 0.f, ndl = 0.f;  // the next block's row of thread tid, stored after the products
    if (hn < group) {  // into the other stage, read last in the previous iteration (synced below)
      issue(stage ^ 1, hn, qn);
      if (tid < kKvQueries) rows_of(hn, qn, nl2, ndl);
    }
    cp_async_commit();  // possibly empty: one group an iteration keeps the count below right
    cp_async_wait<1>(); // all but the group just committed: K, V and block qb are in
    __syncthreads();

    // Two halves of kHalf queries, one after the other: Pᵀ and dPᵀ of 64 queries beside dK and
    // dV (16 x D each) would not fit in 255 registers. A warp none of whose keys is seen by a
    // query of a half (causal by index, or past S) has nothing to add.
    constexpr int kHalf = kKvQueries / 2;
    constexpr int kNt = kHalf / 8;  // 16x8 tiles of Sᵀ a warp
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      const int64_t qh = qb + half * kHalf;
      if (ki0 >= p.s || (p.by_index() && ki0 > qh + kHalf - 1 + p.offset)) continue;
      const uint32_t off = uint32_t((stage * kKvQueries + half * kHalf) * L::ld * 2);  // Q, dO rows
      const uint32_t qs = sq + off, dos = sdo + off;
      const float* l2 = lse_s + stage * kKvQueries + half * kHalf;
      const float* dl = delta_s + stage * kKvQueries + half * kHalf;
      float s[kNt][4];
      zero(s);
      mma_abt<E, kD, kHalf>(s, ka, qs + rows_b, L::ld);  // Sᵀ = K Qᵀ
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= scale2;  // before the mask: scale may be negative
      const bool diagonal = p.by_index() && ki0 + 15 > qh + p.offset;
      if (kDocPos || diagonal) mask_scores<kDocPos, true, kHalf>(s, p, b, ki0, qh, kd, kp);
      // Pᵀ: column (query) 8 nt + 2 tq + (e & 1) of rows (keys) g, g + 8.
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const float2 x = *reinterpret_cast<const float2*>(l2 + 8 * nt + 2 * tq);
        s[nt][0] = exp2_approx(s[nt][0] - x.x);
        s[nt][1] = exp2_approx(s[nt][1] - x.y);
        s[nt][2] = exp2_approx(s[nt][2] - x.x);
        s[nt][3] = exp2_approx(s[nt][3] - x.y);
      }
      mma_pv<E, kHalf, kD>(dva, s, dos + trans_b, L::ld);  // dV += Pᵀ dO

      float ds[kNt][4];
      zero(ds);
      mma_abt<E, kD, kHalf>(ds, va, dos + rows_b, L::ld);  // dPᵀ = V dOᵀ
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const float2 x = *reinterpret_cast<const float2*>(dl + 8 * nt + 2 * tq);
        ds[nt][0] = s[nt][0] * (ds[nt][0] - x.x);
        ds[nt][1] = s[nt][1] * (ds[nt][1] - x.y);
        ds[nt][2] = s[nt][2] * (ds[nt][2] - x.x);
        ds[nt][3] = s[nt][3] * (ds[nt][3] - x.y);
      }
      mma_pv<E, kHalf, kD>(dka, ds, qs + trans_b, L::ld);  // dK += dSᵀ Q
    }
    if (hn < group && tid < kKvQueries) {
      lse_s[(stage ^ 1) * kKvQueries + tid] = nl2;
      delta_s[(stage ^ 1) * kKvQueries + tid] = ndl;
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
    stage ^= 1;
    hg = hn;
    qb = qn;
  }

  cp_async_wait<0>();  // with no query block visited, K and V may still be landing
  __syncthreads();
  const int n = int(imin(16, p.s - ki0));
  T* own = reinterpret_cast<T*>(smem) + row0 * L::ld;  // this warp's K rows, then its V rows
  store_rows<T, kD>(dk + (krow + row0) * kD, own, dka, p.scale, n);
  store_rows<T, kD>(dv + (krow + row0) * kD, own + kKvKeys * L::ld, dva, 1.f, n);
}

// dQ (scaled) of one block of kQRows queries of one head (B, Hq, T, D).
template <class T, int kD, bool kDocPos>
__global__ void __launch_bounds__(kThreads, 1)
    attention_dq_mma_kernel(Params p, T* __restrict__ dq, const T* __restrict__ dout, const T* __restrict__ q,
                            const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ lse,
                            const float* __restrict__ delta) {
  using L = DqLayout<kD>;
  using E = Elem<T>;
  constexpr int kNt = kQKeys / 8;  // 16x8 score tiles a warp
  constexpr int kDt = kD / 8;      // 16x8 dQ tiles a warp
  extern __shared__ __align__(128) char smem[];
  const uint32_t sq = uint32_t(__cvta_generic_to_shared(smem));
  const uint32_t sdo = sq + L::q, sk = sdo + L::q, sv = sk + 2 * L::kv;  // stage s at + s * L::kv

  const auto [b, h, kvh, q0, nq, qrow, krow] = query_block(p, kQRows);  // q, dout, dq, lse, delta rows
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = 16 * warp;
  const int64_t qi0 = q0 + row0;
  const int g = lane >> 2;

  const int64_t k_end = causal_end(p, q0, nq);
  int64_t kb = kDocPos ? next_open<kQKeys>(p, b, q0, nq, 0, k_end) : 0;
  load_async<kD, kQRows, kThreads>(sq, q + qrow * kD, nq);
  load_async<kD, kQRows, kThreads>(sdo, dout + qrow * kD, nq);
  if (kb < k_end) {
    const int nk = int(imin(kQKeys, p.s - kb));
    load_async<kD, kQKeys, kThreads>(sk, k + (krow + kb) * kD, nk);
    load_async<kD, kQKeys, kThreads>(sv, v + (krow + kb) * kD, nk);
  }
  cp_async_commit();

  // This lane's two query rows: log2e·lse, delta, document and position.
  float l2[2], dl[2];
  int qd[2] = {0, 0}, qp[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t qi = qi0 + g + 8 * i;
    const bool in = qi < p.t;
    l2[i] = in ? lse2_of(lse[qrow + row0 + g + 8 * i]) : INFINITY;
    dl[i] = in ? delta[qrow + row0 + g + 8 * i] : 0.f;
    if (kDocPos && in) {
      if (p.q_doc) qd[i] = p.q_doc[b * p.t + qi];
      if (p.by_pos()) qp[i] = p.q_pos[b * p.t + qi];
    }
  }

  float dqa[kDt][4];
  zero(dqa);
  const float scale2 = p.scale * kLog2e;
  const uint32_t qa = sq + uint32_t(row0 * L::ld * 2) + a_lane(L::ld);   // this warp's Q rows as A
  const uint32_t doa = sdo + uint32_t(row0 * L::ld * 2) + a_lane(L::ld); // and dO rows
  const uint32_t rows_b = bt_lane(L::ld), trans_b = a_lane(L::ld);       // K, V as B of X Yᵀ, K of X Y

  int stage = 0;
#pragma unroll 1
  while (kb < k_end) {
    const int64_t kn = kDocPos ? next_open<kQKeys>(p, b, q0, nq, kb + kQKeys, k_end) : kb + kQKeys;
    if (kn < k_end) {  // into the other stage, read last in the previous iteration (synced below)
      const int nk = int(imin(kQKeys, p.s - kn));
      load_async<kD, kQKeys, kThreads>(sk + (stage ^ 1) * L::kv, k + (krow + kn) * kD, nk);
      load_async<kD, kQKeys, kThreads>(sv + (stage ^ 1) * L::kv, v + (krow + kn) * kD, nk);
    }
    cp_async_commit();
    cp_async_wait<1>();  // Q, dO and block kb are in
    __syncthreads();

    const bool seen = qi0 < p.t && !(p.by_index() && kb > qi0 + 15 + p.offset);
    if (seen) {
      const uint32_t ks = sk + stage * L::kv, vs = sv + stage * L::kv;
      float s[kNt][4];
      zero(s);
      mma_abt<E, kD, kQKeys>(s, qa, ks + rows_b, L::ld);  // S = Q Kᵀ
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= scale2;
      const bool ragged = kb + kQKeys > p.s;
      const bool diagonal = p.by_index() && kb + kQKeys - 1 > qi0 + p.offset;
      if (kDocPos || ragged || diagonal) mask_scores<kDocPos, false, kQKeys>(s, p, b, qi0, kb, qd, qp);
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = exp2_approx(s[nt][e] - l2[e >> 1]);  // P

      float ds[kNt][4];
      zero(ds);
      mma_abt<E, kD, kQKeys>(ds, doa, vs + rows_b, L::ld);  // dP = dO Vᵀ
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[nt][e] = s[nt][e] * (ds[nt][e] - dl[e >> 1]);
      mma_pv<E, kQKeys, kD>(dqa, ds, ks + trans_b, L::ld);  // dQ += dS K
    }
    __syncthreads();
    stage ^= 1;
    kb = kn;
  }

  cp_async_wait<0>();  // with no key block visited, Q and dO may still be landing
  __syncthreads();
  T* own = reinterpret_cast<T*>(smem) + row0 * L::ld;  // this warp's Q rows
  store_rows<T, kD>(dq + (qrow + row0) * kD, own, dqa, p.scale, int(imin(16, p.t - qi0)));
}

template <class T, int kD, bool kDocPos>
void launch_as(const Params& p, void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
               const void* v, const float* lse, const float* delta, cudaStream_t stream) {
  constexpr const char* kWhat = "scaled_dot_product_attention_backward";
  const int64_t kv_blocks = p.batch * p.hkv * ((p.s + kKvKeys - 1) / kKvKeys);
  const int64_t q_blocks = p.batch * p.hq * ((p.t + kQRows - 1) / kQRows);
  if (kv_blocks > int64_t(INT_MAX) || q_blocks > int64_t(INT_MAX))
    fail_msg(kWhat, "too many (batch, head, block) tiles for one grid");
  if (kv_blocks > 0) {  // with T = 0 this writes dK = dV = 0
    constexpr int smem = DkdvLayout<kD>::total;
    auto kernel = attention_dkdv_mma_kernel<T, kD, kDocPos>;
    QUILT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<unsigned(kv_blocks), kThreads, smem, stream>>>(
        p, static_cast<T*>(dk), static_cast<T*>(dv), static_cast<const T*>(dout), static_cast<const T*>(q),
        static_cast<const T*>(k), static_cast<const T*>(v), lse, delta);
    QUILT_CHECK_LAUNCH();
  }
  if (q_blocks > 0) {  // with S = 0 this writes dQ = 0
    constexpr int smem = DqLayout<kD>::total;
    auto kernel = attention_dq_mma_kernel<T, kD, kDocPos>;
    QUILT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<unsigned(q_blocks), kThreads, smem, stream>>>(p, static_cast<T*>(dq), static_cast<const T*>(dout),
                                                          static_cast<const T*>(q), static_cast<const T*>(k),
                                                          static_cast<const T*>(v), lse, delta);
    QUILT_CHECK_LAUNCH();
  }
}

template <class T, int kD>
void launch(const Params& p, void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
            const void* v, const float* lse, const float* delta, cudaStream_t stream) {
  if (p.q_doc || p.by_pos()) launch_as<T, kD, true>(p, dq, dk, dv, dout, q, k, v, lse, delta, stream);
  else launch_as<T, kD, false>(p, dq, dk, dv, dout, q, k, v, lse, delta, stream);
}

template <int kD>
constexpr int most_smem = DkdvLayout<kD>::total > DqLayout<kD>::total ? DkdvLayout<kD>::total : DqLayout<kD>::total;

}  // namespace

bool attention_backward_mma(DType dt, const AttentionArgs& a, const Params& p, void* dq, void* dk, void* dv,
                            const void* dout, const void* q, const void* k, const void* v, const float* lse,
                            const float* delta, cudaStream_t stream) {
  if (dt != DType::bf16 && dt != DType::f16) return false;
  if (a.d != a.dv || (a.d != 64 && a.d != 128) || !p.vec) return false;
  if (size_t(a.d == 64 ? most_smem<64> : most_smem<128>) > smem_optin()) return false;
  const bool bf16 = dt == DType::bf16;
  if (a.d == 64) {
    if (bf16) launch<BFloat16, 64>(p, dq, dk, dv, dout, q, k, v, lse, delta, stream);
    else launch<Half, 64>(p, dq, dk, dv, dout, q, k, v, lse, delta, stream);
  } else {
    if (bf16) launch<BFloat16, 128>(p, dq, dk, dv, dout, q, k, v, lse, delta, stream);
    else launch<Half, 128>(p, dq, dk, dv, dout, q, k, v, lse, delta, stream);
  }
  return true;
}

}  // namespace quilt::kernels::cuda
