// Grouped GEMM of the MoE experts on CUDA, reading the expert offsets from device memory (no
// host sync, no copy of offsets to the host).
//
// Forward: out (M, N) = x (M, K) @ w[e] (E, K, N) for the rows of expert e. A one-block
// pre-kernel turns the offsets into tile_start (E+1), the first row tile of each expert (row
// tiles of kBM rows, never straddling two experts). The main grid has (ceil(M/kBM) + E) row
// tiles x column tiles, an upper bound of the real count known from shapes alone; each CTA
// finds its expert by counting the tile_starts at or below its tile (__syncthreads_count) and
// exits when past the last tile. Weight gradient: dw[e] (K, N) = x_e^T @ dy_e; the grid is
// E x K-tiles x N-tiles (shapes only), each CTA loops over its expert's rows (zero rows: zeros).
//
// Both reduce to one tile routine on a problem C (m, n) = A (m, kk) @ B (kk, n) with A and B
// row-major or transposed. bf16/f16: 128x128x32 CTA tiles, 8 warps of 64x32, WMMA 16x16x16
// with f32 accumulators, two-stage cp.async pipeline (16-byte copies when the operand is
// aligned; element copies otherwise; zero fill outside the problem). f32/f64: a 64x64x16
// SIMT tile (exact: no TF32, as kernels/cuda/gemm.cu).
//
// Measured on one H200 (bench/kernels/cuda_grouped.cpp, E = 128, K = 2048, 131072 rows, bf16):
// about 160 TFLOP/s for N = 768 and 1536, balanced or Zipf-split, against about 300-500 for a
// per-expert cuBLAS loop and 620-660 for one dense GEMM of the same FLOPs. The next steps are
// more pipeline stages (dynamic shared memory) and then wgmma (sm_90a) with TMA loads; the first
// is grouped_gemm_mma.cu (mma.sync + ldmatrix, 4 stages), opt-in through set_grouped_gemm_kernel.
#include <mma.h>

#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe.h"

namespace quilt::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// ---- tile shapes ----
template <class T>
constexpr bool is16_v = std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;
template <class T>
constexpr int tile_m() { return is16_v<T> ? 128 : 64; }
template <class T>
constexpr int tile_n() { return is16_v<T> ? 128 : 64; }

// One CTA's piece of C (m, n) = A (m, kk) @ B (kk, n): A(i, j) at a[i * lda + j] (a[j * lda + i]
// when TA), B likewise with TB, C row-major. The CTA computes rows [m0, m0 + tile) and columns
// [n0, n0 + tile) of C, clipped to (m, n).
struct Problem {
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* c;
  int64_t ldc;
  int64_t m, n, kk;
  int64_t m0, n0;
};

// ---- the 16-bit tensor-core tile ----
constexpr int kBM = 128, kBN = 128, kBK = 32, kPad = 8;  // pad keeps rows 16-byte aligned, spreads banks
constexpr int kStageHalf = 128 * (kBK + kPad);           // = max over layouts of one operand's stage (5120)
static_assert(kStageHalf >= kBK * (kBM + kPad) && kStageHalf >= kBK * (kBN + kPad), "stage too small");

template <class T>
struct WmmaType;
template <>
struct WmmaType<BFloat16> {
  using E = __nv_bfloat16;
};
template <>
struct WmmaType<Half> {
  using E = __half;
};

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies a ROWS x COLS panel (COLS along the contiguous dim) of 16-bit values from g (rows
// `ld` apart) into s (rows `sld` apart); only the first rv rows and cv columns are read, the
// rest is zero. `vec`: g and ld allow 16-byte copies.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_panel(uint16_t* s, int sld, const uint16_t* g, int64_t ld, int rv, int cv,
                                           bool vec) {
  constexpr int kChunks = COLS / 8;
  for (int c = threadIdx.x; c < ROWS * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    uint16_t* d = s + r * sld + col;
    const int valid = r < rv ? max(0, min(8, cv - col)) : 0;
    const uint16_t* src = g + int64_t(r) * ld + col;
    if (vec) {
      cp_async16(d, valid > 0 ? src : g, valid * 2);  // src bytes < 16 zero-fill the rest
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) d[j] = j < valid ? src[j] : uint16_t(0);
    }
  }
}

template <class T, bool TA, bool TB>
__device__ void mma_tile(const Problem& p) {
  using namespace nvcuda;
  using E = typename WmmaType<T>::E;
  constexpr int kStage = 2 * kStageHalf;
  __shared__ __align__(128) uint16_t smem[2 * kStage];  // 40 KiB: two stages of A and B

  const int rows_m = int(min64(kBM, p.m - p.m0)), cols_n = int(min64(kBN, p.n - p.n0));
  const uint16_t* a = static_cast<const uint16_t*>(p.a) + (TA ? p.m0 : p.m0 * p.lda);
  const uint16_t* b = static_cast<const uint16_t*>(p.b) + (TB ? p.n0 * p.ldb : p.n0);
  const bool vec_a = p.lda % 8 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0;
  const bool vec_b = p.ldb % 8 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
  constexpr int lda_s = TA ? kBM + kPad : kBK + kPad;  // A stage: [kBK][kBM] col-major A, or [kBM][kBK]
  constexpr int ldb_s = TB ? kBK + kPad : kBN + kPad;  // B stage: [kBN][kBK] col-major B, or [kBK][kBN]

  auto load_stage = [&](int stage, int64_t k0) {
    uint16_t* sa = smem + stage * kStage;
    uint16_t* sb = sa + kStageHalf;
    const int kv = int(min64(kBK, p.kk - k0));
    if constexpr (TA) load_panel<kBK, kBM>(sa, lda_s, a + k0 * p.lda, p.lda, kv, rows_m, vec_a);
    else load_panel<kBM, kBK>(sa, lda_s, a + k0, p.lda, rows_m, kv, vec_a);
    if constexpr (TB) load_panel<kBN, kBK>(sb, ldb_s, b + k0, p.ldb, cols_n, kv, vec_b);
    else load_panel<kBK, kBN>(sb, ldb_s, b + k0 * p.ldb, p.ldb, kv, cols_n, vec_b);
    cp_async_commit();
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp / 4) * 64, wn = (warp % 4) * 32;  // this warp's 64x32 piece
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  using LayoutA = std::conditional_t<TA, wmma::col_major, wmma::row_major>;
  using LayoutB = std::conditional_t<TB, wmma::col_major, wmma::row_major>;
  const int64_t nk = (p.kk + kBK - 1) / kBK;
  if (nk > 0) load_stage(0, 0);
  for (int64_t kt = 0; kt < nk; ++kt) {
    if (kt + 1 < nk) {
      load_stage(int((kt + 1) & 1), (kt + 1) * kBK);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const E* sa = reinterpret_cast<const E*>(smem + int(kt & 1) * kStage);
    const E* sb = sa + kStageHalf;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, E, LayoutA> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, E, LayoutB> fb[2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = wm + i * 16;
        wmma::load_matrix_sync(fa[i], TA ? sa + kk * lda_s + r : sa + r * lda_s + kk, lda_s);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = wn + j * 16;
        wmma::load_matrix_sync(fb[j], TB ? sb + c * ldb_s + kk : sb + kk * ldb_s + c, ldb_s);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();  // before the next iteration's copy overwrites this stage
  }

  // Epilogue: each warp stages a 16x16 fragment in its own 1 KiB of smem, then writes the part
  // inside (m, n), rounded once to T.
  float* scratch = reinterpret_cast<float*>(smem) + warp * 256;
  T* c = static_cast<T*>(p.c);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r0 = wm + i * 16, c0 = wn + j * 16;
      if (r0 >= rows_m || c0 >= cols_n) continue;  // warp-uniform
      wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int r = r0 + e / 16, cc = c0 + e % 16;
        if (r < rows_m && cc < cols_n) c[(p.m0 + r) * p.ldc + p.n0 + cc] = Num<T>::store(scratch[e]);
      }
      __syncwarp();
    }
}

// ---- the f32 / f64 SIMT tile ----
template <class T, bool TA, bool TB>
__device__ void simt_tile(const Problem& p) {
  constexpr int BM = 64, BN = 64, BK = 16;
  __shared__ T as[BK][BM + 1];
  __shared__ T bs[BK][BN + 1];
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t rows_m = min64(BM, p.m - p.m0), cols_n = min64(BN, p.n - p.n0);
  T acc[4][4] = {};
  for (int64_t k0 = 0; k0 < p.kk; k0 += BK) {
    const int64_t kv = min64(BK, p.kk - k0);
    for (int i = threadIdx.x; i < BM * BK; i += kThreads) {
      // Index order follows the contiguous dim so that a warp's reads coalesce.
      const int r = TA ? i % BM : i / BK, k = TA ? i / BM : i % BK;
      const int64_t gr = p.m0 + r, gk = k0 + k;
      as[k][r] = r < rows_m && k < kv ? (TA ? a[gk * p.lda + gr] : a[gr * p.lda + gk]) : T(0);
    }
    for (int i = threadIdx.x; i < BN * BK; i += kThreads) {
      const int c = TB ? i / BK : i % BN, k = TB ? i % BK : i / BN;
      const int64_t gc = p.n0 + c, gk = k0 + k;
      bs[k][c] = c < cols_n && k < kv ? (TB ? b[gc * p.ldb + gk] : b[gk * p.ldb + gc]) : T(0);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      T av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[k][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[k][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
  T* c = static_cast<T*>(p.c);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = ty + 16 * i, cc = tx + 16 * j;
      if (r < rows_m && cc < cols_n) c[(p.m0 + r) * p.ldc + p.n0 + cc] = acc[i][j];
    }
}

template <class T, bool TA, bool TB>
__device__ __forceinline__ void tile(const Problem& p) {
  if constexpr (is16_v<T>) mma_tile<T, TA, TB>(p);
  else simt_tile<T, TA, TB>(p);
}

// Group e's rows [begin, end), clamped into [0, m] so that bad offsets never read out of bounds.
__device__ __forceinline__ void group_rows(const int64_t* off, int64_t e, int64_t m, int64_t& begin, int64_t& end) {
  begin = e == 0 ? 0 : min(max(off[e - 1], int64_t(0)), m);
  end = min(max(off[e], begin), m);
}

// tile_start[e] = row tiles of groups before e (tile_start[E] = all), one block.
__global__ void tile_starts_kernel(const int64_t* off, int64_t groups, int64_t m, int64_t tile_rows,
                                   int64_t* tile_start) {
  __shared__ int64_t tiles[1024];
  int64_t carry = 0;  // thread 0's
  for (int64_t base = 0; base < groups; base += blockDim.x) {
    const int64_t e = base + threadIdx.x;
    if (e < groups) {
      int64_t b, en;
      group_rows(off, e, m, b, en);
      tiles[threadIdx.x] = (en - b + tile_rows - 1) / tile_rows;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t cnt = min64(blockDim.x, groups - base);
      for (int64_t i = 0; i < cnt; ++i) {
        tile_start[base + i] = carry;
        carry += tiles[i];
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_start[groups] = carry;
}

struct FwdParams {
  const void* x;
  int64_t ldx;
  const void* w;
  int64_t ldw, w_group_stride;
  void* out;
  int64_t ldo;
  int64_t groups, m, n, k;
  int64_t n_tiles;
};

template <class T, bool TX, bool TW>
__global__ void __launch_bounds__(kThreads, 2) grouped_fwd_kernel(FwdParams p, const int64_t* off,
                                                               const int64_t* tile_start) {
  constexpr int BM = tile_m<T>(), BN = tile_n<T>();
  const int64_t lin = blockIdx.x;
  const int64_t t = lin / p.n_tiles, nt = lin % p.n_tiles;
  if (t >= tile_start[p.groups]) return;  // the same for the whole CTA
  // This tile's group: how many groups end at or before it (tile_start is non-decreasing).
  int64_t e = 0;
  for (int64_t base = 0; base < p.groups; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    e += __syncthreads_count(i < p.groups && tile_start[i + 1] <= t);
  }
  int64_t begin, end;
  group_rows(off, e, p.m, begin, end);
  const int64_t r0 = begin + (t - tile_start[e]) * BM;
  const T* x = static_cast<const T*>(p.x);
  Problem q;
  q.a = x + (TX ? r0 : r0 * p.ldx);
  q.lda = p.ldx;
  q.b = static_cast<const T*>(p.w) + e * p.w_group_stride;
  q.ldb = p.ldw;
  q.c = static_cast<T*>(p.out) + r0 * p.ldo;
  q.ldc = p.ldo;
  q.m = end - r0;
  q.n = p.n;
  q.kk = p.k;
  q.m0 = 0;
  q.n0 = nt * BN;
  tile<T, TX, TW>(q);
}

struct WgradParams {
  const void* x;
  int64_t ldx;
  const void* dy;
  int64_t lddy;
  void* dw;
  int64_t groups, m, n, k;
  int64_t m_tiles, n_tiles;  // over dw's (k, n)
};

// dw[e] = A @ B with A(i, r) = x(begin + r, i): x row-major makes A transposed (TA = !trans_x).
template <class T, bool TA, bool TDY>
__global__ void __launch_bounds__(kThreads, 2) grouped_wgrad_kernel(WgradParams p, const int64_t* off) {
  constexpr int BM = tile_m<T>(), BN = tile_n<T>();
  const int64_t lin = blockIdx.x, per = p.m_tiles * p.n_tiles;
  const int64_t e = lin / per, mi = (lin % per) / p.n_tiles, ni = lin % p.n_tiles;
  int64_t begin, end;
  group_rows(off, e, p.m, begin, end);
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  Problem q;
  q.a = x + (TA ? begin * p.ldx : begin);  // x at row `begin`
  q.lda = p.ldx;
  q.b = dy + (TDY ? begin : begin * p.lddy);
  q.ldb = p.lddy;
  q.c = static_cast<T*>(p.dw) + e * p.k * p.n;
  q.ldc = p.n;
  q.m = p.k;
  q.n = p.n;
  q.kk = end - begin;  // 0: the tile is zeros
  q.m0 = mi * BM;
  q.n0 = ni * BN;
  tile<T, TA, TDY>(q);
}

unsigned blocks_of(int64_t n, const char* op) {
  if (n > INT_MAX) fail_msg(op, ("needs " + std::to_string(n) + " thread blocks, more than a grid holds").c_str());
  return static_cast<unsigned>(n);
}

template <class T>
void fwd_t(const GroupedGemmArgs& g, cudaStream_t s) {
  constexpr int BM = tile_m<T>(), BN = tile_n<T>();
  FwdParams p{g.x, g.ldx, g.w, g.ldw, g.w_group_stride, g.out, g.ldo, g.groups, g.m, g.n, g.k, (g.n + BN - 1) / BN};
  const int64_t row_tiles = (g.m + BM - 1) / BM + g.groups;  // >= sum over groups of ceil(rows / BM)
  const unsigned blocks = blocks_of(row_tiles * p.n_tiles, "grouped_mm");
  auto* tile_start = static_cast<int64_t*>(workspace_alloc(size_t(g.groups + 1) * sizeof(int64_t), s));
  tile_starts_kernel<<<1, 1024, 0, s>>>(g.offsets, g.groups, g.m, BM, tile_start);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) {
    const auto launch = [&](auto kernel) { kernel<<<blocks, kThreads, 0, s>>>(p, g.offsets, tile_start); };
    if (g.trans_x) g.trans_w ? launch(grouped_fwd_kernel<T, true, true>) : launch(grouped_fwd_kernel<T, true, false>);
    else g.trans_w ? launch(grouped_fwd_kernel<T, false, true>) : launch(grouped_fwd_kernel<T, false, false>);
    err = cudaGetLastError();
  }
  workspace_free(tile_start, s);  // stream-ordered: after the kernels that read it
  QUILT_CHECK_CUDA(err);
}

template <class T>
void wgrad_t(const GroupedGemmWeightGradArgs& g, cudaStream_t s) {
  constexpr int BM = tile_m<T>(), BN = tile_n<T>();
  WgradParams p{g.x, g.ldx, g.dy, g.lddy, g.dw, g.groups, g.m, g.n, g.k, (g.k + BM - 1) / BM, (g.n + BN - 1) / BN};
  const unsigned blocks = blocks_of(g.groups * p.m_tiles * p.n_tiles, "grouped_mm_weight_grad");
  const auto launch = [&](auto kernel) { kernel<<<blocks, kThreads, 0, s>>>(p, g.offsets); };
  // A = x_e^T: transposed exactly when x is row-major.
  if (!g.trans_x) g.trans_dy ? launch(grouped_wgrad_kernel<T, true, true>) : launch(grouped_wgrad_kernel<T, true, false>);
  else g.trans_dy ? launch(grouped_wgrad_kernel<T, false, true>) : launch(grouped_wgrad_kernel<T, false, false>);
  QUILT_CHECK_LAUNCH();
}

}  // namespace

void grouped_gemm(DType dt, const GroupedGemmArgs& g, void* stream) {
  if (g.m == 0 || g.n == 0 || g.groups == 0) return;
  if (grouped_gemm_kernel() == GroupedGemmKernel::mma && grouped_gemm_mma(dt, g, stream)) return;
  QUILT_DISPATCH_FLOATING(dt, [&] { fwd_t<scalar_t>(g, as_stream(stream)); });
}

void grouped_gemm_weight_grad(DType dt, const GroupedGemmWeightGradArgs& g, void* stream) {
  if (g.k == 0 || g.n == 0 || g.groups == 0) return;
  if (grouped_gemm_kernel() == GroupedGemmKernel::mma && grouped_gemm_weight_grad_mma(dt, g, stream)) return;
  QUILT_DISPATCH_FLOATING(dt, [&] { wgrad_t<scalar_t>(g, as_stream(stream)); });
}

}  // namespace quilt::kernels::cuda
