// The MoE grouped GEMM on tensor cores through mma.sync (sm_80+, also run on sm_90a): an
// opt-in alternative to the WMMA kernel of grouped_gemm.cu for bf16/f16, chosen by
// set_grouped_gemm_kernel or QUILT_CUDA_GROUPED_GEMM=mma (moe.h). Offsets stay on the device.
//
// Forward (also dgrad, which is the forward with w's transposed view):
//   out (M, N) = x (M, K) @ w[e] (K, N)  for the rows of expert e
// A one-block pre-kernel writes tile_start (E+1), the first 128-row tile of each expert; CTA
// b is row tile b / n_tiles, column tile b % n_tiles of that numbering (the grid is an upper
// bound known from shapes alone; CTAs past the last tile exit).
// Weight gradient (K-grouped): dw[e] (K, N) = x_e^T (K, M_e) @ dy_e (M_e, N); one CTA per
// (expert, K tile, N tile) walks the expert's rows 32 at a time (zeros when M_e = 0).
//
// One tile routine serves both: C (128x128) = A (128 x kk) @ B (kk x 128), f32 accumulators.
// 8 warps as 2 (m) x 4 (n), each 64x32 = 4 x 4 mma.m16n8k16. Operands go global -> shared by
// 16-byte cp.async (zero fill past the problem) in a 4-stage pipeline of 32-deep k steps, then
// shared -> registers by ldmatrix.x4 (.trans where the operand's contiguous dim is m or n).
// Shared layouts are XOR-swizzled so that each 8-row ldmatrix phase hits 8 distinct 16-byte
// bank groups:
//   k-contiguous tile [128][32]:  chunk c (8 elements) of row r at c ^ ((r >> 1) & 3)
//   mn-contiguous tile [32][128]: chunk c of k-row r at c ^ (r & 7)
// The epilogue rounds to T in a padded shared tile and writes 16-byte row pieces.
//
// Needs 16-byte aligned operands with K, N and leading dims multiples of 8, x and dy
// row-major; grouped_gemm_mma / grouped_gemm_weight_grad_mma return false otherwise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe.h"

namespace quilt::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBM = 128, kBN = 128, kBK = 32, kStages = 4;
constexpr int kTileElems = 128 * kBK;                 // one operand's stage, either layout
constexpr int kStageElems = 2 * kTileElems;           // A then B
constexpr int kSmemBytes = kStages * kStageElems * 2; // 64 KiB
constexpr int kCLd = kBN + 8;                         // epilogue rows: 272 bytes, 16 apart mod 128
static_assert(kBM * kCLd * 2 <= kSmemBytes, "epilogue tile must fit in the pipeline's smem");
static_assert(kBM == 128 && kBN == 128 && kBK == 32 && kThreads == 256, "index math below assumes these");

// ---- PTX wrappers ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; bytes past src_bytes (0 or 16 here) are zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16, row) @ b (16x8, col), f32 accumulators.
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two f32 rounded to T, packed low = first (the order mma's C pairs and memory share).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// ---- swizzled shared layouts (offsets in elements; chunk = 8 elements = 16 bytes) ----
// k-contiguous [128 rows (m or n)][32 k]: a row is 4 chunks; rows r and r^2, r^4, r^6 move their chunks.
__device__ __forceinline__ int kmajor_at(int r, int chunk) { return r * kBK + ((chunk ^ ((r >> 1) & 3)) << 3); }
// mn-contiguous [32 k rows][128 (m or n)]: a row is 16 chunks; the low 3 chunk bits take k's.
__device__ __forceinline__ int mnmajor_at(int k, int chunk) { return k * 128 + ((chunk ^ (k & 7)) << 3); }

// The tile problem: C (rows x cols, at most 128 x 128) = A (rows x kk) @ B (kk x cols).
// A(i, k) at a[i * lda + k], or a[k * lda + i] when TA; B(k, j) at b[k * ldb + j], or
// b[j * ldb + k] when TB; C(i, j) at c[i * ldc + j]. a, b, c point at the tile's origin.
struct Tile {
  const uint16_t* a;
  int64_t lda;
  const uint16_t* b;
  int64_t ldb;
  uint16_t* c;
  int64_t ldc;
  int rows, cols;
  int64_t kk;
};

// Queues one 32-deep k step of a 128-wide operand into `s` (shared address). KMAJOR: element
// (i, k) at g[i * ld + k] (i < mn_valid, k < k_valid); else at g[k * ld + i]. Valid extents
// along the contiguous dim are multiples of 8, so each 16-byte chunk is all in or all out.
template <bool KMAJOR>
__device__ __forceinline__ void load_operand(uint32_t s, const uint16_t* g, int64_t ld, int mn_valid, int k_valid) {
#pragma unroll
  for (int it = 0; it < (128 * kBK / 8) / kThreads; ++it) {
    const int id = threadIdx.x + it * kThreads;
    int r, chunk, off;
    bool ok;
    if constexpr (KMAJOR) {
      r = id >> 2, chunk = id & 3;  // 4 threads per 64-byte row: coalesced row pieces
      ok = r < mn_valid && chunk * 8 < k_valid;
      off = kmajor_at(r, chunk);
    } else {
      r = id >> 4, chunk = id & 15;  // 16 threads per 256-byte k row
      ok = r < k_valid && chunk * 8 < mn_valid;
      off = mnmajor_at(r, chunk);
    }
    const uint16_t* src = ok ? g + int64_t(r) * ld + chunk * 8 : g;  // g itself: a valid address, 0 bytes read
    cp_async16(s + uint32_t(off) * 2, src, ok ? 16 : 0);
  }
}

template <class T, bool TA, bool TB>
__device__ __forceinline__ void mma_tile(const Tile& p, uint16_t* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;  // this warp's 64x32 piece of C
  const uint32_t s0 = smem_addr(smem);
  const int64_t nk = (p.kk + kBK - 1) / kBK;

  auto load_stage = [&](int64_t kt) {
    const uint32_t sa = s0 + uint32_t((kt % kStages) * kStageElems) * 2, sb = sa + kTileElems * 2;
    const int64_t k0 = kt * kBK;
    const int kv = int(p.kk - k0 < kBK ? p.kk - k0 : kBK);
    load_operand<!TA>(sa, TA ? p.a + k0 * p.lda : p.a + k0, p.lda, p.rows, kv);
    load_operand<TB>(sb, TB ? p.b + k0 : p.b + k0 * p.ldb, p.ldb, p.cols, kv);
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

  // Prologue: stages 0 .. kStages-2 in flight, one commit group each (empty past the end, so
  // that group i is always k step i and wait_group counts stay uniform).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s);
    cp_async_commit();
  }

  // Per-lane ldmatrix coordinates. x4 matrix q = lane / 8 takes its row address from lane.
  //  A k-contiguous (a0..a3 = rows 0-7/8-15 x k 0-7, then k 8-15): row lane & 15, chunk + (lane >> 4).
  //  A m-contiguous (.trans): k row (lane >> 4) * 8 + (lane & 7), m chunk + ((lane >> 3) & 1).
  //  B k-contiguous [n][k]: n row (lane >> 4) * 8 + (lane & 7), k chunk + ((lane >> 3) & 1)
  //    -> {b0, b1} of n8 tile 0, then of n8 tile 1.
  //  B n-contiguous [k][n] (.trans): k row ((lane >> 3) & 1) * 8 + (lane & 7), n chunk + (lane >> 4)
  //    -> the same register order.
  const int l7 = lane & 7, l8 = (lane >> 3) & 1, l16 = lane >> 4;

  for (int64_t kt = 0; kt < nk; ++kt) {
    cp_async_wait<kStages - 2>();  // this thread's copies of step kt have landed
    __syncthreads();               // everyone's have; and step kt-1's stage is no longer read
    if (kt + kStages - 1 < nk) load_stage(kt + kStages - 1);
    cp_async_commit();

    const uint32_t sa = s0 + uint32_t((kt % kStages) * kStageElems) * 2, sb = sa + kTileElems * 2;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = wm + i * 16;
        if constexpr (!TA) {
          ldmatrix_x4(af[i], sa + uint32_t(kmajor_at(m + (lane & 15), ks * 2 + l16)) * 2);
        } else {
          ldmatrix_x4_trans(af[i], sa + uint32_t(mnmajor_at(ks * 16 + l16 * 8 + l7, (m >> 3) + l8)) * 2);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = wn + j * 16;
        uint32_t r[4];
        if constexpr (TB) {
          ldmatrix_x4(r, sb + uint32_t(kmajor_at(n + l16 * 8 + l7, ks * 2 + l8)) * 2);
        } else {
          ldmatrix_x4_trans(r, sb + uint32_t(mnmajor_at(ks * 16 + l8 * 8 + l7, (n >> 3) + l16)) * 2);
        }
        bf[2 * j][0] = r[0], bf[2 * j][1] = r[1], bf[2 * j + 1][0] = r[2], bf[2 * j + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma16816<T>(acc[i][j], af[i], bf[j][0], bf[j][1]);
    }
  }
  cp_async_wait<0>();  // only empty groups remain, but drain before smem is reused
  __syncthreads();

  // Epilogue: C fragments (c0, c1 at row g, cols 2t, 2t+1; c2, c3 at row g + 8) rounded into
  // a [128][136] tile (rows 16 banks apart: conflict-free), then 16-byte pieces of the valid rows.
  uint16_t* cs = smem;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = wm + i * 16 + g, c = wn + j * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(cs + r * kCLd + c) = pack2<T>(acc[i][j][0], acc[i][j][1]);
      *reinterpret_cast<uint32_t*>(cs + (r + 8) * kCLd + c) = pack2<T>(acc[i][j][2], acc[i][j][3]);
    }
  __syncthreads();
#pragma unroll
  for (int it = 0; it < kBM * kBN / 8 / kThreads; ++it) {
    const int id = threadIdx.x + it * kThreads, r = id >> 4, c = (id & 15) * 8;
    if (r < p.rows && c < p.cols)
      *reinterpret_cast<uint4*>(p.c + int64_t(r) * p.ldc + c) = *reinterpret_cast<const uint4*>(cs + r * kCLd + c);
  }
}

// Group e's rows [begin, end), clamped into [0, m] (bad offsets never read out of bounds).
__device__ __forceinline__ void group_rows(const int64_t* off, int64_t e, int64_t m, int64_t& begin, int64_t& end) {
  begin = e == 0 ? 0 : min(max(off[e - 1], int64_t(0)), m);
  end = min(max(off[e], begin), m);
}

// tile_start[e] = 128-row tiles of the groups before e, tile_start[E] = all. One block of 1024.
__global__ void __launch_bounds__(1024) tile_prefix_kernel(const int64_t* off, int64_t groups, int64_t m,
                                                           int64_t* tile_start) {
  __shared__ int64_t warp_sum[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t carry = 0;
  for (int64_t base = 0; base < groups; base += 1024) {
    const int64_t e = base + threadIdx.x;
    int64_t count = 0;
    if (e < groups) {
      int64_t b, en;
      group_rows(off, e, m, b, en);
      count = (en - b + kBM - 1) / kBM;
    }
    int64_t v = count;  // inclusive scan within the warp, then over the warps' totals
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += u;
    }
    if (lane == 31) warp_sum[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int64_t w = warp_sum[lane];
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int64_t u = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w += u;
      }
      warp_sum[lane] = w;
    }
    __syncthreads();
    if (e < groups) tile_start[e] = carry + (warp > 0 ? warp_sum[warp - 1] : 0) + v - count;
    carry += warp_sum[31];
    __syncthreads();  // warp_sum is rewritten by the next round
  }
  if (threadIdx.x == 0) tile_start[groups] = carry;
}

struct FwdParams {
  const uint16_t* x;  // (m, k) rows ldx apart
  int64_t ldx;
  const uint16_t* w;  // (E, k, n): w + e * w_group_stride; (k, n) rows ldw apart, or (n, k) when TW
  int64_t ldw, w_group_stride;
  uint16_t* out;  // (m, n) rows ldo apart
  int64_t ldo;
  int64_t groups, m, n, k;
  int64_t n_tiles;
};

template <class T, bool TW>
__global__ void __launch_bounds__(kThreads, 2) mma_fwd_kernel(FwdParams p, const int64_t* off,
                                                             const int64_t* tile_start) {
  extern __shared__ __align__(128) uint16_t smem[];
  const int64_t t = blockIdx.x / p.n_tiles, nt = blockIdx.x % p.n_tiles;
  // This tile's group: how many groups end at or before it (tile_start is non-decreasing);
  // all of them: t is past the last tile.
  int64_t e = 0;
  for (int64_t base = 0; base < p.groups; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    e += __syncthreads_count(i < p.groups && tile_start[i + 1] <= t);
  }
  if (e >= p.groups) return;  // the same for the whole CTA
  int64_t begin, end;
  group_rows(off, e, p.m, begin, end);
  const int64_t r0 = begin + (t - tile_start[e]) * kBM, n0 = nt * kBN;
  Tile q;
  q.a = p.x + r0 * p.ldx;
  q.lda = p.ldx;
  const uint16_t* w = p.w + e * p.w_group_stride;
  q.b = TW ? w + n0 * p.ldw : w + n0;
  q.ldb = p.ldw;
  q.c = p.out + r0 * p.ldo + n0;
  q.ldc = p.ldo;
  q.rows = int(min(end - r0, int64_t(kBM)));
  q.cols = int(min(p.n - n0, int64_t(kBN)));
  q.kk = p.k;
  mma_tile<T, false, TW>(q, smem);
}

struct WgradParams {
  const uint16_t* x;  // (m, k) rows ldx apart
  int64_t ldx;
  const uint16_t* dy;  // (m, n) rows lddy apart
  int64_t lddy;
  uint16_t* dw;  // (E, k, n) contiguous
  int64_t groups, m, n, k;
  int64_t k_tiles, n_tiles;  // over dw[e]'s (k, n)
};

// dw[e] = A @ B, A(i, r) = x(begin + r, i) (m-contiguous: TA), B(r, j) = dy(begin + r, j).
template <class T>
__global__ void __launch_bounds__(kThreads, 2) mma_wgrad_kernel(WgradParams p, const int64_t* off) {
  extern __shared__ __align__(128) uint16_t smem[];
  const int64_t per = p.k_tiles * p.n_tiles;
  const int64_t e = blockIdx.x / per, ki = (blockIdx.x % per) / p.n_tiles, ni = blockIdx.x % p.n_tiles;
  int64_t begin, end;
  group_rows(off, e, p.m, begin, end);
  const int64_t i0 = ki * kBM, j0 = ni * kBN;
  Tile q;
  q.a = p.x + begin * p.ldx + i0;  // not read when the group is empty
  q.lda = p.ldx;
  q.b = p.dy + begin * p.lddy + j0;
  q.ldb = p.lddy;
  q.c = p.dw + (e * p.k + i0) * p.n + j0;
  q.ldc = p.n;
  q.rows = int(min(p.k - i0, int64_t(kBM)));
  q.cols = int(min(p.n - j0, int64_t(kBN)));
  q.kk = end - begin;
  mma_tile<T, true, false>(q, smem);
}

unsigned grid_of(int64_t blocks, const char* op) {
  if (blocks > INT_MAX) fail_msg(op, ("needs " + std::to_string(blocks) + " thread blocks, more than a grid holds").c_str());
  return static_cast<unsigned>(blocks);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Opts `kernel` in to kSmemBytes of dynamic shared memory, once per device (`done`: that
// kernel's own bitmask of devices), so that later launches (and stream captures) skip the call.
template <class K>
void allow_smem(K kernel, std::atomic<uint64_t>& done) {
  int dev = 0;
  QUILT_CHECK_CUDA(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  QUILT_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  done.fetch_or(bit, std::memory_order_release);
}

template <class T>
void fwd_t(const GroupedGemmArgs& g, cudaStream_t s) {
  FwdParams p{static_cast<const uint16_t*>(g.x), g.ldx, static_cast<const uint16_t*>(g.w), g.ldw, g.w_group_stride,
              static_cast<uint16_t*>(g.out), g.ldo, g.groups, g.m, g.n, g.k, (g.n + kBN - 1) / kBN};
  const int64_t row_tiles = (g.m + kBM - 1) / kBM + g.groups;  // >= sum over groups of ceil(rows / kBM)
  const unsigned blocks = grid_of(row_tiles * p.n_tiles, "grouped_mm");
  const auto kernel = g.trans_w ? mma_fwd_kernel<T, true> : mma_fwd_kernel<T, false>;
  static std::atomic<uint64_t> done[2];  // per trans_w
  allow_smem(kernel, done[g.trans_w ? 1 : 0]);
  auto* tile_start = static_cast<int64_t*>(workspace_alloc(size_t(g.groups + 1) * sizeof(int64_t), s));
  tile_prefix_kernel<<<1, 1024, 0, s>>>(g.offsets, g.groups, g.m, tile_start);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) {
    kernel<<<blocks, kThreads, kSmemBytes, s>>>(p, g.offsets, tile_start);
    err = cudaGetLastError();
  }
  workspace_free(tile_start, s);  // stream-ordered: after the kernels that read it
  QUILT_CHECK_CUDA(err);
}

template <class T>
void wgrad_t(const GroupedGemmWeightGradArgs& g, cudaStream_t s) {
  WgradParams p{static_cast<const uint16_t*>(g.x), g.ldx, static_cast<const uint16_t*>(g.dy), g.lddy,
                static_cast<uint16_t*>(g.dw), g.groups, g.m, g.n, g.k, (g.k + kBM - 1) / kBM, (g.n + kBN - 1) / kBN};
  const unsigned blocks = grid_of(g.groups * p.k_tiles * p.n_tiles, "grouped_mm_weight_grad");
  static std::atomic<uint64_t> done;
  allow_smem(mma_wgrad_kernel<T>, done);
  mma_wgrad_kernel<T><<<blocks, kThreads, kSmemBytes, s>>>(p, g.offsets);
  QUILT_CHECK_LAUNCH();
}

bool is16(DType dt) { return dt == DType::bf16 || dt == DType::f16; }

GroupedGemmKernel kernel_from_env() {
  const char* v = std::getenv("QUILT_CUDA_GROUPED_GEMM");
  if (v == nullptr || *v == '\0' || std::string(v) == "mma") return GroupedGemmKernel::mma;
  if (std::string(v) == "wmma") return GroupedGemmKernel::wmma;
  fail_msg("grouped_mm", ("QUILT_CUDA_GROUPED_GEMM is '" + std::string(v) + "', not 'wmma' or 'mma'").c_str());
}

std::atomic<GroupedGemmKernel>& selected_kernel() {
  static std::atomic<GroupedGemmKernel> k{kernel_from_env()};
  return k;
}

}  // namespace

GroupedGemmKernel grouped_gemm_kernel() { return selected_kernel().load(std::memory_order_relaxed); }

void set_grouped_gemm_kernel(GroupedGemmKernel k) { selected_kernel().store(k, std::memory_order_relaxed); }

bool grouped_gemm_mma(DType dt, const GroupedGemmArgs& g, void* stream) {
  if (!is16(dt) || g.trans_x || g.k % 8 != 0 || g.n % 8 != 0 || g.ldx % 8 != 0 || g.ldw % 8 != 0 ||
      g.w_group_stride % 8 != 0 || g.ldo % 8 != 0 || !aligned16(g.x) || !aligned16(g.w) || !aligned16(g.out))
    return false;
  if (g.m == 0 || g.n == 0 || g.groups == 0) return true;
  if (dt == DType::bf16) fwd_t<BFloat16>(g, as_stream(stream));
  else fwd_t<Half>(g, as_stream(stream));
  return true;
}

bool grouped_gemm_weight_grad_mma(DType dt, const GroupedGemmWeightGradArgs& g, void* stream) {
  if (!is16(dt) || g.trans_x || g.trans_dy || g.k % 8 != 0 || g.n % 8 != 0 || g.ldx % 8 != 0 || g.lddy % 8 != 0 ||
      !aligned16(g.x) || !aligned16(g.dy) || !aligned16(g.dw))
    return false;
  if (g.k == 0 || g.n == 0 || g.groups == 0) return true;
  if (dt == DType::bf16) wgrad_t<BFloat16>(g, as_stream(stream));
  else wgrad_t<Half>(g, as_stream(stream));
  return true;
}

}  // namespace quilt::kernels::cuda
