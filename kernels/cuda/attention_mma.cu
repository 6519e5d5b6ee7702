// The FlashAttention-2 style forward for bf16/f16 (see attention.h; the default, the WMMA kernel
// in attention.cu with set_attention_kernel or QUILT_CUDA_ATTENTION=wmma). Its products, ldmatrix
// addressing, cp.async loads and mask are attention_mma.cuh's, shared with the backward.
//
// A CTA is 8 warps over 128 queries; warp w owns query rows [16w, 16w + 16). Keys come in
// blocks of 32, K and V double-buffered in shared memory by cp.async (block i + 1 loads while
// block i computes). Products are mma.sync m16n8k16 (16-bit in, f32 accumulate) on operands
// loaded with ldmatrix (.trans for V). Scores S (16 x 32 a warp), the probabilities P and the
// output O (16 x D) stay in registers: P is rounded to 16 bits and fed straight back as the A
// operand of P V, since the accumulator of two 16x8 tiles holds exactly the A fragment of one
// 16x16 k-step. The online softmax runs in base 2 (scores times scale·log2 e) with the row's
// max and sum kept per thread and reduced over the row's 4 lanes by shuffles.
//
// Masks: key blocks past the causal diagonal (by index) are never visited, key blocks that the
// documents or positions hide entirely are skipped (tile_open), a warp none of whose 16 rows
// sees a key of a block (causal by index) skips its products, and only blocks that need it (ragged keys,
// the diagonal, documents, positions) are masked element by element.
//
// Shared memory rows are padded by 16 bytes, so the 8 rows an ldmatrix 8x8 piece reads fall
// in 8 distinct 16-byte bank groups. Shared memory a CTA: Q (128, D) + 2 stages of K and V
// (32, D), rows of D + 8 elements: 68 KiB at D 128, 36 KiB at D 64. Registers a thread
// (ptxas, sm_90a, CUDA 13, capped at 128 by __launch_bounds__(256, 2): two CTAs, 16 warps an
// SM): D 128: 128; D 64: 115, 125 with documents or positions; 0 bytes spilled in every one.
// Q's fragments are reloaded from shared memory every key block rather than held in
// registers, which keeps O and S within that cap.
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention_mma.cuh"

namespace quilt::kernels::cuda {
namespace {

constexpr int kRows = 128;           // queries a CTA
// Keys a block (a pipeline stage). 32 keeps S (16 x 32 a warp) beside O (16 x D) within the
// 128 registers a thread has at two CTAs an SM; with 64, ptxas spills (40 bytes at D 128, 16
// at D 64).
constexpr int kKeys = 32;
constexpr int kWarps = kRows / 16;   // warp w owns query rows [16w, 16w + 16)
constexpr int kThreads = 32 * kWarps;

// Shared memory of the kernel in bytes: Q, then K stages 0 and 1, then V stages 0 and 1.
template <int kD>
struct Layout {
  static constexpr int ld = kD + kMmaPad;  // row stride in elements
  static constexpr int q = kRows * ld * 2;
  static constexpr int kv = kKeys * ld * 2;  // one stage of K or of V
  static constexpr int total = q + 4 * kv;
};

// kDocPos: the call has documents or causal positions (a separate instance: their per-key
// loads cost registers the plain causal and dense calls should not pay for).
template <class T, int kD, bool kDocPos>
__global__ void __launch_bounds__(kThreads, 2)
    attention_forward_mma_kernel(Params p, T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ q,
                                 const T* __restrict__ k, const T* __restrict__ v) {
  using L = Layout<kD>;
  using E = Elem<T>;
  constexpr int kNt = kKeys / 8;  // 16x8 score tiles a warp
  constexpr int kDt = kD / 8;     // 16x8 output tiles a warp
  extern __shared__ __align__(128) char smem[];
  const uint32_t sq = uint32_t(__cvta_generic_to_shared(smem));
  const uint32_t sk = sq + L::q, sv = sk + 2 * L::kv;  // stage s at + s * L::kv

  const auto [b, h, kvh, q0, nq, qrow, krow] = query_block(p, kRows);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = 16 * warp;        // this warp's first query row in the block
  const int64_t qi0 = q0 + row0;     // and in the sequence
  const int g = lane >> 2, tq = lane & 3;  // accumulator rows g, g + 8; columns 2 tq, 2 tq + 1

  const int64_t k_end = causal_end(p, q0, nq);
  int64_t kb = kDocPos ? next_open<kKeys>(p, b, q0, nq, 0, k_end) : 0;
  load_async<kD, kRows, kThreads>(sq, q + qrow * kD, nq);
  cp_async_commit();
  if (kb < k_end) {
    const int nk = int(imin(kKeys, p.s - kb));
    load_async<kD, kKeys, kThreads>(sk, k + (krow + kb) * kD, nk);
    load_async<kD, kKeys, kThreads>(sv, v + (krow + kb) * kD, nk);
  }
  cp_async_commit();

  // This lane's two query rows' document and position (masking only).
  int qd[2] = {0, 0}, qp[2] = {0, 0};
  lane_doc_pos<kDocPos>(p, false, b, qi0, g, qd, qp);

  float o[kDt][4];
#pragma unroll
  for (int j = 0; j < kDt; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // the rows' running max of scale·log2e·score
  float l[2] = {0.f, 0.f};              // this lane's part of the rows' sum of 2^(x - m)
  const float scale2 = p.scale * kLog2e;

  // ldmatrix row addresses of this lane (attention_mma.cuh): Q as the A operand, K as the B
  // operand of S = Q Kᵀ, V (through .trans) as the B operand of O = P V.
  const uint32_t qa = sq + uint32_t(row0 * L::ld * 2) + a_lane(L::ld);
  const uint32_t ka = bt_lane(L::ld), va = a_lane(L::ld);

  int stage = 0;
#pragma unroll 1
  while (kb < k_end) {
    const int64_t kn = kDocPos ? next_open<kKeys>(p, b, q0, nq, kb + kKeys, k_end) : kb + kKeys;
    if (kn < k_end) {  // into the other stage, read last in the previous iteration (synced below)
      const int nk = int(imin(kKeys, p.s - kn));
      load_async<kD, kKeys, kThreads>(sk + (stage ^ 1) * L::kv, k + (krow + kn) * kD, nk);
      load_async<kD, kKeys, kThreads>(sv + (stage ^ 1) * L::kv, v + (krow + kn) * kD, nk);
    }
    cp_async_commit();  // possibly empty: one group an iteration keeps the count below right
    cp_async_wait<1>(); // all but the group just committed: Q and block kb are in
    __syncthreads();

    // A warp none of whose rows sees a key of this block (causal by index) has nothing to add.
    const bool seen = qi0 < p.t && !(p.by_index() && kb > qi0 + 15 + p.offset);
    if (seen) {
      const uint32_t ks = sk + stage * L::kv + ka, vs = sv + stage * L::kv + va;
      float s[kNt][4];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      mma_abt<E, kD, kKeys>(s, qa, ks, L::ld);
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= scale2;  // before the mask: scale may be negative
      const bool ragged = kb + kKeys > p.s;
      const bool diagonal = p.by_index() && kb + kKeys - 1 > qi0 + p.offset;
      if (kDocPos || ragged || diagonal) mask_scores<kDocPos, false, kKeys>(s, p, b, qi0, kb, qd, qp);

      // Online softmax of rows g (i = 0) and g + 8 (i = 1): new max over the row's 4 lanes,
      // rescale of what was summed so far, probabilities.
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
      float base[2], alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        base[i] = mx[i] == -INFINITY ? 0.f : mx[i];  // a row that saw nothing yet: 2^(-inf - 0) = 0
        alpha[i] = exp2_approx(m[i] - base[i]);      // 0 when m is -inf
        m[i] = mx[i];
        l[i] *= alpha[i];
      }
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] = exp2_approx(s[nt][e] - base[e >> 1]);
          l[e >> 1] += s[nt][e];
        }
#pragma unroll
      for (int j = 0; j < kDt; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }

      mma_pv<E, kKeys, kD>(o, s, vs, L::ld);  // O += P V, P straight from S's registers
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
    stage ^= 1;
    kb = kn;
  }

  // Row sums over the row's 4 lanes; out = O / l, through this warp's own Q rows in shared
  // memory so that the global stores are whole 16-byte rows pieces.
  float inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    inv[i] = l[i] > 0.f ? 1.f / l[i] : 0.f;  // a query that sees no key: out 0
  }
  cp_async_wait<0>();  // with no key block visited, Q may still be landing
  __syncthreads();
  T* so = reinterpret_cast<T*>(smem) + row0 * L::ld;
#pragma unroll
  for (int j = 0; j < kDt; ++j) {
    const int c = 8 * j + 2 * tq;
    *reinterpret_cast<uint32_t*>(so + g * L::ld + c) = E::pack(o[j][0] * inv[0], o[j][1] * inv[0]);
    *reinterpret_cast<uint32_t*>(so + (g + 8) * L::ld + c) = E::pack(o[j][2] * inv[1], o[j][3] * inv[1]);
  }
  __syncwarp();
  constexpr int chunks = kD / 8;
#pragma unroll
  for (int it = 0; it < 16 * chunks / 32; ++it) {
    const int i = lane + 32 * it;
    const int r = i / chunks, c = (i % chunks) * 8;
    if (qi0 + r < p.t)
      *reinterpret_cast<uint4*>(out + (qrow + row0 + r) * kD + c) = *reinterpret_cast<const uint4*>(so + r * L::ld + c);
  }
  if (tq == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t qi = qi0 + g + 8 * i;
      if (qi < p.t) lse[qrow + row0 + g + 8 * i] = l[i] > 0.f ? m[i] * kLn2 + logf(l[i]) : -INFINITY;
    }
  }
}

template <class T, int kD, bool kDocPos>
void launch_as(const Params& p, void* out, void* lse, const void* q, const void* k, const void* v, cudaStream_t stream) {
  constexpr int smem = Layout<kD>::total;
  const int64_t blocks = p.batch * p.hq * ((p.t + kRows - 1) / kRows);
  if (blocks > int64_t(INT_MAX)) fail_msg("scaled_dot_product_attention", "too many (batch, head, block) tiles for one grid");
  auto kernel = attention_forward_mma_kernel<T, kD, kDocPos>;
  QUILT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<unsigned(blocks), kThreads, smem, stream>>>(p, static_cast<T*>(out), static_cast<float*>(lse),
                                                       static_cast<const T*>(q), static_cast<const T*>(k),
                                                       static_cast<const T*>(v));
  QUILT_CHECK_LAUNCH();
}

template <class T, int kD>
void launch(const Params& p, void* out, void* lse, const void* q, const void* k, const void* v, cudaStream_t stream) {
  if (p.q_doc || p.by_pos()) launch_as<T, kD, true>(p, out, lse, q, k, v, stream);
  else launch_as<T, kD, false>(p, out, lse, q, k, v, stream);
}

}  // namespace

bool attention_forward_mma(DType dt, const AttentionArgs& a, const Params& p, void* out, void* lse, const void* q,
                           const void* k, const void* v, cudaStream_t stream) {
  if (dt != DType::bf16 && dt != DType::f16) return false;
  if (a.d != a.dv || (a.d != 64 && a.d != 128) || !p.vec) return false;
  if (size_t(a.d == 64 ? Layout<64>::total : Layout<128>::total) > smem_optin()) return false;
  const bool bf16 = dt == DType::bf16;
  if (a.d == 64) {
    if (bf16) launch<BFloat16, 64>(p, out, lse, q, k, v, stream);
    else launch<Half, 64>(p, out, lse, q, k, v, stream);
  } else {
    if (bf16) launch<BFloat16, 128>(p, out, lse, q, k, v, stream);
    else launch<Half, 128>(p, out, lse, q, k, v, stream);
  }
  return true;
}

}  // namespace quilt::kernels::cuda
