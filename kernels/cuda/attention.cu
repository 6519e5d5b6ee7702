// CUDA flash attention (see attention.h): forward with the per-query log-sum-exp, backward in
// three kernels (delta = rowsum(dO ∘ O) - dlse; dK/dV per key block; dQ per query block), so
// the backward is deterministic: every output element is summed by one CTA in a fixed order.
//
// Every CTA is 4 warps over a 64-query x 64-key tile; warp w owns query rows [16w, 16w + 16)
// of the scores, so the online softmax needs no block-level sync, only the K/V loads do. Tiles
// live in shared memory: the tile products are warp-wide 16 x n GEMMs with WMMA (bf16/f16 in,
// f32 accumulate) for 16-bit inputs and FMAs for f32 (exact f32 numbers, as the CPU). Scores,
// softmax state and accumulators (O, dQ, dK, dV) are f32; P and dS are rounded to the input
// dtype before they enter a tensor-core product, as flash attention does. Tiles that the causal
// rule (by index: bounds of the key loop; by position: min/max of the tile's positions) or the
// documents hide entirely are skipped. 16-bit tiles are padded by 16 bytes a row against
// shared-memory bank conflicts. This is the simple shared-memory form (no cp.async pipeline,
// no wgmma): correct first, then faster. attention_mma.cu has a FlashAttention-2 style forward
// (mma.sync, S, P and O in registers), run instead when attention_kernel() says mma, and
// attention_mma_backward.cu the backward's dK/dV and dQ kernels in that style, run after this
// file's delta kernel when attention_backward_kernel() says mma.
#include <mma.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <string_view>

#include "kernels/cuda/attention_common.cuh"

namespace quilt::kernels::cuda {
namespace {

constexpr int kTile = 64;     // queries and keys per tile
constexpr int kWarps = 4;     // warp w owns rows [16w, 16w + 16) of a tile
constexpr int kThreads = 32 * kWarps;
constexpr int kWarpRows = kTile / kWarps;
static_assert(kWarpRows == 16, "the WMMA products take 16 rows per warp");

template <class T>
struct Mma {
  static constexpr bool kTensor = false;
};
template <>
struct Mma<BFloat16> {
  static constexpr bool kTensor = true;
  using E = __nv_bfloat16;
};
template <>
struct Mma<Half> {
  static constexpr bool kTensor = true;
  using E = __half;
};

// Shared-memory layout of the kernels, in bytes; every piece is a multiple of 128 bytes, so
// carving them one after another keeps WMMA's 32-byte alignment.
template <class T, int kD>
struct Smem {
  static constexpr bool k16 = sizeof(T) == 2;
  static constexpr int ld = kD + (k16 ? 8 : 0);      // (64, D) tiles of T: Q, K, V, dO
  static constexpr int lds = kTile + (k16 ? 4 : 0);  // (64, 64) f32 tiles: S, dP
  static constexpr int ldp = kTile + (k16 ? 8 : 0);  // (64, 64) tiles of T: P, dS (f32: in S, dP)
  static constexpr int ldo = kD + (k16 ? 4 : 0);     // (64, D) f32 accumulators: O, dQ, dK, dV
  static constexpr size_t tile = size_t(kTile) * ld * sizeof(T);
  static constexpr size_t stile = size_t(kTile) * lds * sizeof(float);
  static constexpr size_t ptile = k16 ? size_t(kTile) * ldp * sizeof(T) : 0;
  static constexpr size_t otile = size_t(kTile) * ldo * sizeof(float);
  static constexpr size_t rows = size_t(kTile) * 4;  // one 64-entry f32 or i32 array
  static constexpr size_t forward = 3 * tile + stile + ptile + otile + 7 * rows;
  static constexpr size_t dkdv = 4 * tile + 2 * stile + 2 * ptile + 2 * otile + 6 * rows;
  static constexpr size_t dq = 4 * tile + 2 * stile + 2 * ptile + otile + 6 * rows;
  static constexpr size_t most = forward > dkdv ? (forward > dq ? forward : dq) : (dkdv > dq ? dkdv : dq);
};

// Bump allocator over the dynamic shared memory.
struct Carve {
  char* p;
  template <class X>
  __device__ X* take(size_t bytes) {
    X* r = reinterpret_cast<X*>(p);
    p += bytes;
    return r;
  }
};

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Rows [0, n) of a (rows, D) matrix at src into a (64, D) tile with row stride ld; rows n..63
// are zero (a zero V row times a zero probability must stay 0, never NaN).
template <class T, int kD>
__device__ void load_tile(T* dst, int ld, const T* __restrict__ src, int n, bool vec) {
  constexpr int V = 16 / sizeof(T);
  if (vec) {
    constexpr int per_row = kD / V;
    for (int i = threadIdx.x; i < kTile * per_row; i += kThreads) {
      const int r = i / per_row, c = (i % per_row) * V;
      Pack<T, V> v;
      if (r < n) {
        v = *reinterpret_cast<const Pack<T, V>*>(src + int64_t(r) * kD + c);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) v.v[j] = Num<T>::store(0.f);
      }
      *reinterpret_cast<Pack<T, V>*>(dst + r * ld + c) = v;
    }
  } else {
    for (int i = threadIdx.x; i < kTile * kD; i += kThreads) {
      const int r = i / kD, c = i % kD;
      dst[r * ld + c] = r < n ? src[int64_t(r) * kD + c] : Num<T>::store(0.f);
    }
  }
}

// Entries [0, n) of a 64-entry array (the rest `fill`), or all `fill` when src is null.
template <class X>
__device__ void load_row(X* dst, const X* __restrict__ src, int n, X fill) {
  for (int i = threadIdx.x; i < kTile; i += kThreads) dst[i] = (src && i < n) ? src[i] : fill;
}

// C (16, n) (+)= A (16, kk) B (kk, n), one warp. A(m, k) = kAT ? A[k * lda + m] : A[m * lda + k];
// B(k, n) = kBT ? B[n * ldb + k] : B[k * ldb + n]; C f32 row-major.
template <class T, bool kAT, bool kBT, int kN, int kK>
__device__ __forceinline__ void warp_mm(float* C, int ldc, bool acc, const T* A, int lda, const T* B, int ldb) {
  if constexpr (Mma<T>::kTensor) {
    namespace w = nvcuda::wmma;
    using E = typename Mma<T>::E;
    using LA = std::conditional_t<kAT, w::col_major, w::row_major>;
    using LB = std::conditional_t<kBT, w::col_major, w::row_major>;
    const E* a = reinterpret_cast<const E*>(A);
    const E* b = reinterpret_cast<const E*>(B);
#pragma unroll
    for (int n0 = 0; n0 < kN; n0 += 16) {
      w::fragment<w::accumulator, 16, 16, 16, float> c;
      if (acc) w::load_matrix_sync(c, C + n0, ldc, w::mem_row_major);
      else w::fill_fragment(c, 0.f);
#pragma unroll
      for (int k0 = 0; k0 < kK; k0 += 16) {
        w::fragment<w::matrix_a, 16, 16, 16, E, LA> fa;
        w::fragment<w::matrix_b, 16, 16, 16, E, LB> fb;
        w::load_matrix_sync(fa, a + (kAT ? k0 * lda : k0), lda);
        w::load_matrix_sync(fb, b + (kBT ? n0 * ldb + k0 : k0 * ldb + n0), ldb);
        w::mma_sync(c, fa, fb, c);
      }
      w::store_matrix_sync(C + n0, c, ldc, w::mem_row_major);
    }
  } else {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < kWarpRows * kN; i += 32) {
      const int m = i / kN, n = i % kN;
      float s = 0.f;
#pragma unroll 8
      for (int k = 0; k < kK; ++k) {
        const float av = Num<T>::load(kAT ? A[k * lda + m] : A[m * lda + k]);
        const float bv = Num<T>::load(kBT ? B[n * ldb + k] : B[k * ldb + n]);
        s = fmaf(av, bv, s);
      }
      C[m * ldc + n] = acc ? C[m * ldc + n] + s : s;
    }
  }
  __syncwarp();
}

// A warp's (16, kN) f32 accumulator. f32 inputs: rows of a shared-memory tile, summed into by
// warp_mm. 16-bit inputs: WMMA fragments held in registers across the whole key (or query) loop.
template <class T, int kN, bool kTensor = Mma<T>::kTensor>
struct WarpAcc {
  float* c;
  int ldc;
  __device__ WarpAcc(float* rows, int ld, float*) : c(rows), ldc(ld) { zero(); }
  __device__ void zero() {
    for (int i = threadIdx.x & 31; i < kWarpRows * kN; i += 32) c[(i / kN) * ldc + i % kN] = 0.f;
    __syncwarp();
  }
  // Row m times alpha[m].
  __device__ void scale_rows(const float* alpha) {
    for (int i = threadIdx.x & 31; i < kWarpRows * kN; i += 32) c[(i / kN) * ldc + i % kN] *= alpha[i / kN];
    __syncwarp();
  }
  // += A (16, kK) B (kK, kN), A(m, k) = kAT ? A[k * lda + m] : A[m * lda + k], B row-major.
  template <bool kAT, int kK>
  __device__ void add(const T* A, int lda, const T* B, int ldb) {
    warp_mm<T, kAT, false, kN, kK>(c, ldc, true, A, lda, B, ldb);
  }
  // Into rows of shared memory (a no-op when they are the accumulator's own).
  __device__ void store(float* dst, int ld) {
    if (dst != c)
      for (int i = threadIdx.x & 31; i < kWarpRows * kN; i += 32) dst[(i / kN) * ld + i % kN] = c[(i / kN) * ldc + i % kN];
    __syncwarp();
  }
};

template <class T, int kN>
struct WarpAcc<T, kN, true> {
  using Frag = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;
  Frag f[kN / 16];
  int row[Frag::num_elements];  // the row (0..15) of each of this lane's elements

  // `scratch`: 256 floats of this warp's, 32-byte aligned. WMMA leaves the element layout
  // opaque, so the row of each element is read back once from a tile of row numbers.
  __device__ WarpAcc(float*, int, float* scratch) {
    namespace w = nvcuda::wmma;
    for (int i = threadIdx.x & 31; i < 256; i += 32) scratch[i] = float(i / 16);
    __syncwarp();
    Frag probe;
    w::load_matrix_sync(probe, scratch, 16, w::mem_row_major);
#pragma unroll
    for (int i = 0; i < Frag::num_elements; ++i) row[i] = int(probe.x[i]);
    __syncwarp();
    zero();
  }
  __device__ void zero() {
#pragma unroll
    for (int j = 0; j < kN / 16; ++j) nvcuda::wmma::fill_fragment(f[j], 0.f);
  }
  __device__ void scale_rows(const float* alpha) {
    float a[Frag::num_elements];
#pragma unroll
    for (int i = 0; i < Frag::num_elements; ++i) a[i] = alpha[row[i]];
#pragma unroll
    for (int j = 0; j < kN / 16; ++j)
#pragma unroll
      for (int i = 0; i < Frag::num_elements; ++i) f[j].x[i] *= a[i];
  }
  template <bool kAT, int kK>
  __device__ void add(const T* A, int lda, const T* B, int ldb) {
    namespace w = nvcuda::wmma;
    using E = typename Mma<T>::E;
    using LA = std::conditional_t<kAT, w::col_major, w::row_major>;
    const E* a = reinterpret_cast<const E*>(A);
    const E* b = reinterpret_cast<const E*>(B);
#pragma unroll
    for (int k0 = 0; k0 < kK; k0 += 16) {
      w::fragment<w::matrix_a, 16, 16, 16, E, LA> fa;
      w::load_matrix_sync(fa, a + (kAT ? k0 * lda : k0), lda);
#pragma unroll
      for (int j = 0; j < kN / 16; ++j) {
        w::fragment<w::matrix_b, 16, 16, 16, E, w::row_major> fb;
        w::load_matrix_sync(fb, b + k0 * ldb + 16 * j, ldb);
        w::mma_sync(f[j], fa, fb, f[j]);
      }
    }
  }
  __device__ void store(float* dst, int ld) {
#pragma unroll
    for (int j = 0; j < kN / 16; ++j) nvcuda::wmma::store_matrix_sync(dst + 16 * j, f[j], ld, nvcuda::wmma::mem_row_major);
    __syncwarp();
  }
};

// A warp's 16 rows of a (64, kD) tile as the left operand of S (16, 64) = X Kᵀ, for a tile that
// stays put over a loop (Q in the forward, Q and dO in the dQ pass): 16-bit inputs keep it in
// WMMA fragments, f32 reads shared memory.
template <class T, int kD, bool kTensor = Mma<T>::kTensor>
struct WarpRows {
  const T* x;
  int ld;
  __device__ WarpRows(const T* rows, int ld_) : x(rows), ld(ld_) {}
  __device__ void times_t(float* S, int lds, const T* K, int ldk) const {
    warp_mm<T, false, true, kTile, kD>(S, lds, false, x, ld, K, ldk);
  }
};

template <class T, int kD>
struct WarpRows<T, kD, true> {
  using E = typename Mma<T>::E;
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, E, nvcuda::wmma::row_major> f[kD / 16];
  __device__ WarpRows(const T* rows, int ld) {
#pragma unroll
    for (int k = 0; k < kD / 16; ++k) nvcuda::wmma::load_matrix_sync(f[k], reinterpret_cast<const E*>(rows) + 16 * k, ld);
  }
  __device__ void times_t(float* S, int lds, const T* K, int ldk) const {
    namespace w = nvcuda::wmma;
    const E* kp = reinterpret_cast<const E*>(K);
#pragma unroll
    for (int n0 = 0; n0 < kTile; n0 += 16) {
      w::fragment<w::accumulator, 16, 16, 16, float> c;
      w::fill_fragment(c, 0.f);
#pragma unroll
      for (int k = 0; k < kD / 16; ++k) {
        w::fragment<w::matrix_b, 16, 16, 16, E, w::col_major> fb;
        w::load_matrix_sync(fb, kp + n0 * ldk + 16 * k, ldk);
        w::mma_sync(c, f[k], fb, c);
      }
      w::store_matrix_sync(S + n0, c, lds, w::mem_row_major);
    }
    __syncwarp();
  }
};

// Whether local query row i (global q0 + i, batch b) sees local key j (global k0 + j); qd/kd,
// qp/kp are the tile's documents and positions in shared memory.
__device__ __forceinline__ bool sees(const Params& p, int64_t q0, int i, int64_t k0, int j, const int32_t* qd,
                                     const int32_t* kd, const int32_t* qp, const int32_t* kp) {
  if (q0 + i >= p.t || k0 + j >= p.s) return false;
  if (p.causal) {
    if (p.q_pos) {
      if (kp[j] > qp[i]) return false;
    } else if (k0 + j > q0 + i + p.offset) {
      return false;
    }
  }
  return !p.q_doc || qd[i] == kd[j];
}

template <class T, int kD>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(Params p, T* __restrict__ out,
                                                                     float* __restrict__ lse, const T* __restrict__ q,
                                                                     const T* __restrict__ k,
                                                                     const T* __restrict__ v) {
  using L = Smem<T, kD>;
  extern __shared__ __align__(128) char smem[];
  Carve cv{smem};
  T* Qs = cv.take<T>(L::tile);
  T* Ks = cv.take<T>(L::tile);
  T* Vs = cv.take<T>(L::tile);
  float* S = cv.take<float>(L::stile);
  T* P = L::k16 ? cv.take<T>(L::ptile) : reinterpret_cast<T*>(S);
  constexpr int ldp = L::k16 ? L::ldp : L::lds;
  float* O = cv.take<float>(L::otile);
  int32_t* qd = cv.take<int32_t>(L::rows);
  int32_t* kd = cv.take<int32_t>(L::rows);
  int32_t* qp = cv.take<int32_t>(L::rows);
  int32_t* kp = cv.take<int32_t>(L::rows);
  float* alpha_s = cv.take<float>(L::rows);  // each row's rescale factor for this key tile
  float* m_s = cv.take<float>(L::rows);      // each row's running max
  float* l_s = cv.take<float>(L::rows);      // and sum of exp(x - max)

  const auto [b, h, kvh, q0, nq, qrow, krow] = query_block(p, kTile);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * kWarpRows;

  load_tile<T, kD>(Qs, L::ld, q + qrow * kD, nq, p.vec);
  load_row(qd, p.q_doc ? p.q_doc + b * p.t + q0 : nullptr, nq, 0);
  load_row(qp, p.by_pos() ? p.q_pos + b * p.t + q0 : nullptr, nq, 0);
  __syncthreads();
  const WarpRows<T, kD> qa(Qs + r0 * L::ld, L::ld);
  WarpAcc<T, kD> acc(O + r0 * L::ldo, L::ldo, S + r0 * L::lds);

  if (lane < kWarpRows) {
    m_s[r0 + lane] = -INFINITY;
    l_s[r0 + lane] = 0.f;
  }
  __syncwarp();
  const int64_t k_end = causal_end(p, q0, nq);
  for (int64_t k0 = 0; k0 < k_end; k0 += kTile) {
    const int nk = int(imin(kTile, p.s - k0));
    if (!tile_open(p, b, q0, nq, k0, nk)) continue;
    __syncthreads();  // the previous tile's K, V are no longer read
    load_tile<T, kD>(Ks, L::ld, k + (krow + k0) * kD, nk, p.vec);
    load_tile<T, kD>(Vs, L::ld, v + (krow + k0) * kD, nk, p.vec);
    load_row(kd, p.k_doc ? p.k_doc + b * p.s + k0 : nullptr, nk, 0);
    load_row(kp, p.by_pos() ? p.k_pos + b * p.s + k0 : nullptr, nk, 0);
    __syncthreads();

    qa.times_t(S + r0 * L::lds, L::lds, Ks, L::ld);
#pragma unroll 1
    for (int rr = 0; rr < kWarpRows; ++rr) {
      const int r = r0 + rr;
      const float m_old = m_s[r];
      float x[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int j = lane + 32 * c;
        x[c] = sees(p, q0, r, k0, j, qd, kd, qp, kp) ? S[r * L::lds + j] * p.scale : -INFINITY;
      }
      const float mx = fmaxf(m_old, warp_max(fmaxf(x[0], x[1])));
      float alpha = 1.f, pr[2] = {0.f, 0.f};
      if (mx != -INFINITY) {
        alpha = __expf(m_old - mx);  // 0 when nothing was seen before
#pragma unroll
        for (int c = 0; c < 2; ++c) pr[c] = x[c] == -INFINITY ? 0.f : __expf(x[c] - mx);
      }
      const float sum = warp_sum(pr[0] + pr[1]);
      __syncwarp();  // every lane has read S[r] and m_s[r] before P (which may alias S) and m_s are written
#pragma unroll
      for (int c = 0; c < 2; ++c) P[r * ldp + lane + 32 * c] = Num<T>::store(pr[c]);
      if (lane == 0) {
        alpha_s[r] = alpha;
        m_s[r] = mx;
        l_s[r] = l_s[r] * alpha + sum;
      }
    }
    __syncwarp();
    acc.scale_rows(alpha_s + r0);
    acc.template add<false, kTile>(P + r0 * ldp, ldp, Vs, L::ld);
  }
  acc.store(O + r0 * L::ldo, L::ldo);

  for (int rr = 0; rr < kWarpRows; ++rr) {
    const int r = r0 + rr;
    if (r >= nq) break;
    const float l = l_s[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;  // a query that sees no key: out 0
    T* o = out + (qrow + r) * kD;
    for (int c = lane; c < kD; c += 32) o[c] = Num<T>::store(O[r * L::ldo + c] * inv);
    if (lane == 0) lse[qrow + r] = l > 0.f ? m_s[r] + logf(l) : -INFINITY;
  }
}

// delta[r] = sum_j dO[r, j] O[r, j] - dlse[r]; one warp a row.
template <class T>
__global__ void __launch_bounds__(kThreads) attention_delta_kernel(float* __restrict__ delta, const T* __restrict__ dout,
                                                                   const T* __restrict__ out,
                                                                   const float* __restrict__ dlse, int64_t rows,
                                                                   int d) {
  const int lane = threadIdx.x & 31;
  const int64_t step = int64_t(gridDim.x) * kWarps;
  for (int64_t r = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); r < rows; r += step) {
    float acc = 0.f;
    for (int j = lane; j < d; j += 32) acc += Num<T>::load(dout[r * d + j]) * Num<T>::load(out[r * d + j]);
    acc = warp_sum(acc);
    if (lane == 0) delta[r] = acc - (dlse ? dlse[r] : 0.f);
  }
}

// The backward's shared tiles: Q, dO (query block), K, V (key block), S and dP (f32), P and dS
// (T; in S and dP for f32), the query rows' lse and delta, documents and positions.
template <class T, int kD>
struct GradTiles {
  using L = Smem<T, kD>;
  static constexpr int ldp = L::k16 ? L::ldp : L::lds;
  T *Qs, *dOs, *Ks, *Vs;
  float *S, *dP;
  T *P, *dS;
  float *lse, *delta;
  int32_t *qd, *kd, *qp, *kp;

  __device__ explicit GradTiles(Carve& cv) {
    Qs = cv.take<T>(L::tile);
    dOs = cv.take<T>(L::tile);
    Ks = cv.take<T>(L::tile);
    Vs = cv.take<T>(L::tile);
    S = cv.take<float>(L::stile);
    dP = cv.take<float>(L::stile);
    P = L::k16 ? cv.take<T>(L::ptile) : reinterpret_cast<T*>(S);
    dS = L::k16 ? cv.take<T>(L::ptile) : reinterpret_cast<T*>(dP);
    lse = cv.take<float>(L::rows);
    delta = cv.take<float>(L::rows);
    qd = cv.take<int32_t>(L::rows);
    kd = cv.take<int32_t>(L::rows);
    qp = cv.take<int32_t>(L::rows);
    kp = cv.take<int32_t>(L::rows);
  }

  // This warp's rows of P = exp(scale S - lse) (0 where masked or the row sees nothing) and
  // dS = P ∘ (dO Vᵀ - delta), for queries [q0, ...) against keys [k0, ...).
  __device__ void grads(const Params& p, int64_t q0, int64_t k0) {
    const int r0 = (threadIdx.x >> 5) * kWarpRows;
    warp_mm<T, false, true, kTile, kD>(S + r0 * L::lds, L::lds, false, Qs + r0 * L::ld, L::ld, Ks, L::ld);
    warp_mm<T, false, true, kTile, kD>(dP + r0 * L::lds, L::lds, false, dOs + r0 * L::ld, L::ld, Vs, L::ld);
    probabilities(p, q0, k0);
  }
  // The same with this warp's rows of Q and dO held over the loop.
  __device__ void grads(const Params& p, int64_t q0, int64_t k0, const WarpRows<T, kD>& qa,
                        const WarpRows<T, kD>& da) {
    const int r0 = (threadIdx.x >> 5) * kWarpRows;
    qa.times_t(S + r0 * L::lds, L::lds, Ks, L::ld);
    da.times_t(dP + r0 * L::lds, L::lds, Vs, L::ld);
    probabilities(p, q0, k0);
  }
  // P and dS of this warp's rows from S and dP.
  __device__ void probabilities(const Params& p, int64_t q0, int64_t k0) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * kWarpRows;
    for (int rr = 0; rr < kWarpRows; ++rr) {
      const int r = r0 + rr;
      const float lr = lse[r], dr = delta[r];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int j = lane + 32 * c;
        const float pr = (lr != -INFINITY && sees(p, q0, r, k0, j, qd, kd, qp, kp))
                             ? __expf(S[r * L::lds + j] * p.scale - lr)
                             : 0.f;
        const float ds = pr * (dP[r * L::lds + j] - dr);
        P[r * ldp + j] = Num<T>::store(pr);  // the same lane read S[r, j] and dP[r, j] (f32 aliasing)
        dS[r * ldp + j] = Num<T>::store(ds);
      }
    }
    __syncwarp();
  }
};

// dK, dV of one key block of one kv head, over the query heads of its group and the query
// blocks that see it; dK = scale · Σ dSᵀ Q, dV = Σ Pᵀ dO. Warp w owns key rows [16w, 16w + 16).
template <class T, int kD>
__global__ void __launch_bounds__(kThreads) attention_dkdv_kernel(Params p, T* __restrict__ dk, T* __restrict__ dv,
                                                                  const T* __restrict__ dout,
                                                                  const T* __restrict__ q, const T* __restrict__ k,
                                                                  const T* __restrict__ v,
                                                                  const float* __restrict__ lse,
                                                                  const float* __restrict__ delta) {
  using L = Smem<T, kD>;
  using G = GradTiles<T, kD>;
  extern __shared__ __align__(128) char smem[];
  Carve cv{smem};
  G g(cv);
  float* dKs = cv.take<float>(L::otile);
  float* dVs = cv.take<float>(L::otile);

  const int64_t bkv = int64_t(blockIdx.x) % (p.batch * p.hkv);
  const int64_t k0 = (int64_t(blockIdx.x) / (p.batch * p.hkv)) * kTile;
  const int64_t b = bkv / p.hkv, kvh = bkv % p.hkv, group = p.hq / p.hkv;
  const int nk = int(imin(kTile, p.s - k0));
  const int64_t krow = bkv * p.s + k0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * kWarpRows;

  load_tile<T, kD>(g.Ks, L::ld, k + krow * kD, nk, p.vec);
  load_tile<T, kD>(g.Vs, L::ld, v + krow * kD, nk, p.vec);
  load_row(g.kd, p.k_doc ? p.k_doc + b * p.s + k0 : nullptr, nk, 0);
  load_row(g.kp, p.by_pos() ? p.k_pos + b * p.s + k0 : nullptr, nk, 0);
  WarpAcc<T, kD> dk_acc(dKs + r0 * L::ldo, L::ldo, g.S + r0 * L::lds);  // S rows: the probe's scratch
  WarpAcc<T, kD> dv_acc(dVs + r0 * L::ldo, L::ldo, g.S + r0 * L::lds);

  const int64_t q_begin = (causal_begin(p, k0) / kTile) * kTile;
  for (int64_t hg = 0; hg < group; ++hg) {
    const int64_t h = kvh * group + hg;
    for (int64_t q0 = q_begin; q0 < p.t; q0 += kTile) {
      const int nq = int(imin(kTile, p.t - q0));
      if (!tile_open(p, b, q0, nq, k0, nk)) continue;
      const int64_t qrow = (b * p.hq + h) * p.t + q0;
      __syncthreads();  // the previous query block's tiles are no longer read
      load_tile<T, kD>(g.Qs, L::ld, q + qrow * kD, nq, p.vec);
      load_tile<T, kD>(g.dOs, L::ld, dout + qrow * kD, nq, p.vec);
      load_row(g.lse, lse + qrow, nq, -INFINITY);
      load_row(g.delta, delta + qrow, nq, 0.f);
      load_row(g.qd, p.q_doc ? p.q_doc + b * p.t + q0 : nullptr, nq, 0);
      load_row(g.qp, p.by_pos() ? p.q_pos + b * p.t + q0 : nullptr, nq, 0);
      __syncthreads();
      g.grads(p, q0, k0);
      __syncthreads();  // P and dS complete: the products below read every query row
      // dV[keys] += Pᵀ dO, dK[keys] += dSᵀ Q: A = Pᵀ is P read column-major from column r0.
      dv_acc.template add<true, kTile>(g.P + r0, G::ldp, g.dOs, L::ld);
      dk_acc.template add<true, kTile>(g.dS + r0, G::ldp, g.Qs, L::ld);
    }
  }
  dk_acc.store(dKs + r0 * L::ldo, L::ldo);
  dv_acc.store(dVs + r0 * L::ldo, L::ldo);
  for (int rr = 0; rr < kWarpRows; ++rr) {
    const int r = r0 + rr;
    if (r >= nk) break;
    for (int c = lane; c < kD; c += 32) {
      dk[(krow + r) * kD + c] = Num<T>::store(dKs[r * L::ldo + c] * p.scale);
      dv[(krow + r) * kD + c] = Num<T>::store(dVs[r * L::ldo + c]);
    }
  }
}

// dQ of one query block of one head over the key blocks it sees; dQ = scale · Σ dS K.
template <class T, int kD>
__global__ void __launch_bounds__(kThreads) attention_dq_kernel(Params p, T* __restrict__ dq, const T* __restrict__ dout,
                                                                const T* __restrict__ q, const T* __restrict__ k,
                                                                const T* __restrict__ v,
                                                                const float* __restrict__ lse,
                                                                const float* __restrict__ delta) {
  using L = Smem<T, kD>;
  using G = GradTiles<T, kD>;
  extern __shared__ __align__(128) char smem[];
  Carve cv{smem};
  G g(cv);
  float* dQs = cv.take<float>(L::otile);

  const auto [b, h, kvh, q0, nq, qrow, krow] = query_block(p, kTile);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * kWarpRows;

  load_tile<T, kD>(g.Qs, L::ld, q + qrow * kD, nq, p.vec);
  load_tile<T, kD>(g.dOs, L::ld, dout + qrow * kD, nq, p.vec);
  load_row(g.lse, lse + qrow, nq, -INFINITY);
  load_row(g.delta, delta + qrow, nq, 0.f);
  load_row(g.qd, p.q_doc ? p.q_doc + b * p.t + q0 : nullptr, nq, 0);
  load_row(g.qp, p.by_pos() ? p.q_pos + b * p.t + q0 : nullptr, nq, 0);
  __syncthreads();
  const WarpRows<T, kD> qa(g.Qs + r0 * L::ld, L::ld), da(g.dOs + r0 * L::ld, L::ld);
  WarpAcc<T, kD> acc(dQs + r0 * L::ldo, L::ldo, g.S + r0 * L::lds);

  const int64_t k_end = causal_end(p, q0, nq);
  for (int64_t k0 = 0; k0 < k_end; k0 += kTile) {
    const int nk = int(imin(kTile, p.s - k0));
    if (!tile_open(p, b, q0, nq, k0, nk)) continue;
    __syncthreads();
    load_tile<T, kD>(g.Ks, L::ld, k + (krow + k0) * kD, nk, p.vec);
    load_tile<T, kD>(g.Vs, L::ld, v + (krow + k0) * kD, nk, p.vec);
    load_row(g.kd, p.k_doc ? p.k_doc + b * p.s + k0 : nullptr, nk, 0);
    load_row(g.kp, p.by_pos() ? p.k_pos + b * p.s + k0 : nullptr, nk, 0);
    __syncthreads();
    g.grads(p, q0, k0, qa, da);
    acc.template add<false, kTile>(g.dS + r0 * G::ldp, G::ldp, g.Ks, L::ld);
  }
  acc.store(dQs + r0 * L::ldo, L::ldo);
  for (int rr = 0; rr < kWarpRows; ++rr) {
    const int r = r0 + rr;
    if (r >= nq) break;
    for (int c = lane; c < kD; c += 32) dq[(qrow + r) * kD + c] = Num<T>::store(dQs[r * L::ldo + c] * p.scale);
  }
}

// ---- host side -------------------------------------------------------------------------------

template <class T, int kD>
bool fits() {
  return Smem<T, kD>::most <= smem_optin();
}

unsigned grid_of(int64_t blocks, const char* what) {
  if (blocks > int64_t(INT_MAX)) fail_msg(what, "too many (batch, head, block) tiles for one grid");
  return unsigned(blocks);
}

// Lets `kernel` use `smem` bytes of dynamic shared memory (over the 48 KB default).
template <class K>
void allow_smem(K kernel, size_t smem, const char* what) {
  if (smem > smem_optin()) fail_msg(what, "needs more shared memory than this device gives a block");
  QUILT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
}

template <class T, int kD>
void forward_impl(const AttentionArgs& a, void* out, void* lse, const void* q, const void* k, const void* v,
                  cudaStream_t stream) {
  const void* ptrs[] = {out, q, k, v};
  const Params p = attention_params(a, ptrs, 4);
  const int64_t nqb = (a.t + kTile - 1) / kTile;
  const unsigned grid = grid_of(a.batch * a.q_heads * nqb, "scaled_dot_product_attention");
  constexpr size_t smem = Smem<T, kD>::forward;
  auto kernel = attention_forward_kernel<T, kD>;
  allow_smem(kernel, smem, "scaled_dot_product_attention");
  kernel<<<grid, kThreads, smem, stream>>>(p, static_cast<T*>(out), static_cast<float*>(lse),
                                           static_cast<const T*>(q), static_cast<const T*>(k),
                                           static_cast<const T*>(v));
  QUILT_CHECK_LAUNCH();
}

template <class T, int kD>
void backward_impl(const AttentionArgs& a, void* dq, void* dk, void* dv, const void* dout, const void* dlse,
                   const void* q, const void* k, const void* v, const void* out, const void* lse,
                   cudaStream_t stream) {
  constexpr const char* kWhat = "scaled_dot_product_attention_backward";
  const void* ptrs[] = {dq, dk, dv, dout, q, k, v, out};
  const Params p = attention_params(a, ptrs, 8);
  const int64_t rows = a.batch * a.q_heads * a.t;
  float* delta = nullptr;
  if (rows > 0) {
    delta = static_cast<float*>(workspace_alloc(size_t(rows) * sizeof(float), stream));
    attention_delta_kernel<T><<<grid_for(rows, kWarps), kThreads, 0, stream>>>(
        delta, static_cast<const T*>(dout), static_cast<const T*>(out), static_cast<const float*>(dlse), rows, kD);
    QUILT_CHECK_LAUNCH();
  }
  if (attention_backward_kernel() == AttentionKernel::mma &&
      attention_backward_mma(dtype_of<T>(), a, p, dq, dk, dv, dout, q, k, v, static_cast<const float*>(lse), delta,
                             stream)) {
    if (delta) workspace_free(delta, stream);
    return;
  }
  const int64_t nkb = (a.s + kTile - 1) / kTile, nqb = (a.t + kTile - 1) / kTile;
  if (a.batch * a.kv_heads * nkb > 0) {  // with T = 0 this writes dK = dV = 0
    const unsigned grid = grid_of(a.batch * a.kv_heads * nkb, kWhat);
    constexpr size_t smem = Smem<T, kD>::dkdv;
    auto kernel = attention_dkdv_kernel<T, kD>;
    allow_smem(kernel, smem, kWhat);
    kernel<<<grid, kThreads, smem, stream>>>(p, static_cast<T*>(dk), static_cast<T*>(dv),
                                             static_cast<const T*>(dout), static_cast<const T*>(q),
                                             static_cast<const T*>(k), static_cast<const T*>(v),
                                             static_cast<const float*>(lse), delta);
    QUILT_CHECK_LAUNCH();
  }
  if (rows > 0) {  // with S = 0 this writes dQ = 0
    const unsigned grid = grid_of(a.batch * a.q_heads * nqb, kWhat);
    constexpr size_t smem = Smem<T, kD>::dq;
    auto kernel = attention_dq_kernel<T, kD>;
    allow_smem(kernel, smem, kWhat);
    kernel<<<grid, kThreads, smem, stream>>>(p, static_cast<T*>(dq), static_cast<const T*>(dout),
                                             static_cast<const T*>(q), static_cast<const T*>(k),
                                             static_cast<const T*>(v), static_cast<const float*>(lse), delta);
    QUILT_CHECK_LAUNCH();
    workspace_free(delta, stream);
  }
}

// Calls f.template operator()<T, kD>() for the call's dtype and head dim.
template <class F>
void dispatch(DType dt, int64_t d, const char* what, F&& f) {
  auto by_dim = [&]<class T>() {
    if (d == 64) f.template operator()<T, 64>();
    else if (d == 128) f.template operator()<T, 128>();
    else fail_msg(what, "head dim must be 64 or 128 (others take the composite)");
  };
  switch (dt) {
    case DType::f32: by_dim.template operator()<float>(); break;
    case DType::bf16: by_dim.template operator()<BFloat16>(); break;
    case DType::f16: by_dim.template operator()<Half>(); break;
    default: fail_dtype(what, dt);
  }
}

void check_args(const AttentionArgs& a, const char* what) {
  if (a.d != a.dv) fail_msg(what, "q/k and v head dims must be equal");
  if (a.kv_heads <= 0 || a.q_heads % a.kv_heads != 0) fail_msg(what, "query heads must be a multiple of kv heads");
  if ((a.q_doc == nullptr) != (a.k_doc == nullptr)) fail_msg(what, "give both query and key documents");
  if (a.causal && (a.q_pos == nullptr) != (a.k_pos == nullptr)) fail_msg(what, "give both query and key positions");
}

// set_attention_kernel's and set_attention_backward_kernel's choices (-1: none yet).
std::atomic<int> g_kernel_choice{-1};
std::atomic<int> g_backward_choice{-1};

// The kernel `var` names ("mma" or "wmma"), else `dflt`.
AttentionKernel env_kernel(const char* var, AttentionKernel dflt) {
  const char* e = std::getenv(var);
  if (e != nullptr && std::string_view(e) == "mma") return AttentionKernel::mma;
  if (e != nullptr && std::string_view(e) == "wmma") return AttentionKernel::wmma;
  return dflt;
}

// A set_*_kernel choice (>= 0) wins over the environment's.
AttentionKernel chosen_or(const std::atomic<int>& chosen, AttentionKernel from_env) {
  const int c = chosen.load(std::memory_order_relaxed);
  return c >= 0 ? AttentionKernel(c) : from_env;
}

}  // namespace

AttentionKernel attention_kernel() {
  static const AttentionKernel from_env = env_kernel("QUILT_CUDA_ATTENTION", AttentionKernel::mma);
  return chosen_or(g_kernel_choice, from_env);
}

void set_attention_kernel(AttentionKernel k) { g_kernel_choice.store(int(k), std::memory_order_relaxed); }

AttentionKernel attention_backward_kernel() {
  static const AttentionKernel from_env = env_kernel("QUILT_CUDA_ATTENTION_BWD", AttentionKernel::wmma);
  return chosen_or(g_backward_choice, from_env);
}

void set_attention_backward_kernel(AttentionKernel k) {
  g_backward_choice.store(int(k), std::memory_order_relaxed);
}

bool attention_supported(DType dt, int64_t d, int64_t dv) {
  if (d != dv || (d != 64 && d != 128)) return false;
  if (dt != DType::f32 && dt != DType::bf16 && dt != DType::f16) return false;
  bool ok = false;
  dispatch(dt, d, "scaled_dot_product_attention", [&]<class T, int kD>() { ok = fits<T, kD>(); });
  return ok;
}

void attention_forward(DType dt, const AttentionArgs& a, void* out, void* lse, const void* q, const void* k,
                       const void* v, void* stream) {
  constexpr const char* kWhat = "scaled_dot_product_attention";
  if (a.batch == 0 || a.q_heads == 0 || a.t == 0) return;
  check_args(a, kWhat);
  if (attention_kernel() == AttentionKernel::mma) {
    const void* ptrs[] = {out, q, k, v};
    if (attention_forward_mma(dt, a, attention_params(a, ptrs, 4), out, lse, q, k, v, as_stream(stream))) return;
  }
  dispatch(dt, a.d, kWhat,
           [&]<class T, int kD>() { forward_impl<T, kD>(a, out, lse, q, k, v, as_stream(stream)); });
}

void attention_backward(DType dt, const AttentionArgs& a, void* dq, void* dk, void* dv, const void* dout,
                        const void* dlse, const void* q, const void* k, const void* v, const void* out,
                        const void* lse, void* stream) {
  constexpr const char* kWhat = "scaled_dot_product_attention_backward";
  if (a.batch == 0 || a.q_heads == 0) return;
  check_args(a, kWhat);
  dispatch(dt, a.d, kWhat, [&]<class T, int kD>() {
    backward_impl<T, kD>(a, dq, dk, dv, dout, dlse, q, k, v, out, lse, as_stream(stream));
  });
}

}  // namespace quilt::kernels::cuda
