// Internal to the mma.sync attention kernels (attention_mma.cu: the forward;
// attention_mma_backward.cu: dK/dV and dQ): 16-bit mma.sync m16n8k16 and ldmatrix with the
// lane addressing that feeds them, cp.async tile loads, the two warp-level products every
// kernel is made of, and the element-wise mask of a score tile.
//
// Fragment layouts (PTX ISA, mma.m16n8k16; g = lane / 4, tq = lane % 4):
//   A (16x16, row): a0 (row g, cols 2tq, 2tq+1), a1 (row g+8, same cols), a2 a3: cols + 8.
//   B (16x8, col):  b0 (rows 2tq, 2tq+1, col g), b1: rows + 8.
//   C (16x8, f32):  c0 c1 (row g, cols 2tq, 2tq+1), c2 c3 (row g+8, same cols).
// So the accumulators of two adjacent 16x8 tiles, packed to 16 bits, are the A fragment of
// one 16x16 k-step: a product's result feeds the next product without leaving registers.
//
//   float s[4][4] = {};                       // S (16 x 32) = Q Kᵀ, one warp
//   mma_abt<E, 128, 32>(s, sq + a_lane(ld), sk + bt_lane(ld), ld);
//   mma_pv<E, 32, 128>(o, s, sv + a_lane(ld), ld);  // O (16 x 128) += S V
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention_common.cuh"

namespace quilt::kernels::cuda {

inline constexpr int kMmaPad = 8;  // elements of padding a shared row (16 bytes)
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// The 16-bit element type's mma and its packing of two floats into one register.
template <class T>
struct Elem;
template <>
struct Elem<BFloat16> {
  // lo in the low half: the element of the lower column index, as mma reads a register.
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  // c (16x8, f32) += a (16x16, row) b (16x8, col)
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct Elem<Half> {
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Four 8x8 16-bit pieces from shared memory; lanes 8i..8i+7 give the row addresses of piece i,
// and r[i] of lane t holds row t/4, columns 2(t%4), 2(t%4) + 1 of piece i (.trans: column t/4,
// rows 2(t%4), 2(t%4) + 1). The memory clobber keeps them after the barriers that publish the
// tiles and before the stores that reuse them.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// This lane's ldmatrix_x4 row address, in bytes from a 16x16 piece of a row-major 16-bit tile
// with row stride ld elements, for two uses:
//  - a_lane: the piece as an A operand (row lane%16, column 8 (lane/16): pieces a0 a1 a2 a3),
//    and, loaded with .trans, as the B operands of X Y with Y that tile (k = its rows, n = its
//    columns: b0 b1 of the 8-column tile n0, then b0 b1 of n0 + 8);
//  - bt_lane: the B operands of X Yᵀ with Y that tile (n = its rows, k = its columns; row
//    lane%8 + 8 (lane/16), column 8 ((lane/8)%2): b0 b1 of the 8-row tile n0, then of n0 + 8).
__device__ __forceinline__ uint32_t a_lane(int ld) {
  const int lane = threadIdx.x & 31;
  return uint32_t(((lane & 15) * ld + 8 * (lane >> 4)) * 2);
}
__device__ __forceinline__ uint32_t bt_lane(int ld) {
  const int lane = threadIdx.x & 31;
  return uint32_t((((lane & 7) + 8 * (lane >> 4)) * ld + 8 * ((lane >> 3) & 1)) * 2);
}

// C (16 x kN, accumulator tiles of 16x8) += X Yᵀ for X (16 x kK) and Y (kN x kK) row-major in
// shared memory with row stride ld; x = X's address + a_lane(ld), y = Y's + bt_lane(ld).
template <class E, int kK, int kN>
__device__ __forceinline__ void mma_abt(float (&c)[kN / 8][4], uint32_t x, uint32_t y, int ld) {
  static_assert(kK % 16 == 0 && kN % 16 == 0, "whole 16x16 pieces");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[4];
    ldmatrix_x4(a, x + kk * 32);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, y + uint32_t((np * 16 * ld + kk * 16) * 2));
      E::mma(c[2 * np], a, b[0], b[1]);
      E::mma(c[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// C (16 x kN) += P Y for P (16 x kK) the f32 accumulator tiles of an earlier product (rounded
// to 16 bits here) and Y (kK x kN) row-major in shared memory; y = Y's address + a_lane(ld).
template <class E, int kK, int kN>
__device__ __forceinline__ void mma_pv(float (&c)[kN / 8][4], const float (&p)[kK / 8][4], uint32_t y, int ld) {
  static_assert(kK % 16 == 0 && kN % 16 == 0, "whole 16x16 pieces");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    // Tiles 2kk and 2kk + 1 of P are the A fragment (a0: row g, a1: row g + 8, a2 a3: 8 on).
    const uint32_t a[4] = {E::pack(p[2 * kk][0], p[2 * kk][1]), E::pack(p[2 * kk][2], p[2 * kk][3]),
                           E::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                           E::pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, y + uint32_t((kk * 16 * ld + np * 16) * 2));
      E::mma(c[2 * np], a, b[0], b[1]);
      E::mma(c[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// 16 bytes global -> shared without a register stop; valid false writes 16 zero bytes (and
// reads nothing from src, which must still be a mapped address).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most n of this thread's committed groups are still in flight.
template <int n>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

__device__ __forceinline__ float exp2_approx(float x) {  // 2^x; 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Rows [0, n) of a (rows, kD) matrix at src into kTileRows rows of shared memory at dst (row
// stride kD + kMmaPad) by the CTA's kThreads threads; the rest are zero (a zero V row times a
// zero probability stays 0).
template <int kD, int kTileRows, int kThreads, class T>
__device__ __forceinline__ void load_async(uint32_t dst, const T* __restrict__ src, int n) {
  constexpr int chunks = kD / 8;  // 16-byte pieces a row
  static_assert(kTileRows * chunks % kThreads == 0, "every thread moves the same number of pieces");
#pragma unroll
  for (int it = 0; it < kTileRows * chunks / kThreads; ++it) {
    const int i = int(threadIdx.x) + it * kThreads;
    const int r = i / chunks, c = (i % chunks) * 8;
    const bool ok = r < n;
    cp_async16(dst + uint32_t((r * (kD + kMmaPad) + c) * 2), src + (ok ? int64_t(r) * kD + c : 0), ok);
  }
}

// A warp's score tile (16 rows x kN columns as accumulator tiles of 16x8) to -inf where the
// query may not see the key. Row i of the lane is r0 + lane/4 (+ 8: i = 1), its columns
// c0 + 8 nt + 2 (lane%4) (+ 1). kKeyRows false: rows are queries and columns keys (S = Q Kᵀ);
// true: rows are keys and columns queries (Sᵀ = K Qᵀ). rd, rp: the lane's two rows' document and
// position (read only with kDocPos). Columns past the sequence are masked; rows past it are the
// caller's. Local 32-bit column indices keep the registers this takes few: it runs inside the
// loops that hold the accumulators.
template <bool kDocPos, bool kKeyRows, int kN>
__device__ __forceinline__ void mask_scores(float (&s)[kN / 8][4], const Params& p, int64_t b, int64_t r0,
                                            int64_t c0, const int (&rd)[2], const int (&rp)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, cl = 2 * (lane & 3);
  const int nc = int(imin(kN, (kKeyRows ? p.t : p.s) - c0));
  int lo[2], hi[2];  // the local columns row i may see are [lo, hi]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    lo[i] = 0;
    hi[i] = nc - 1;
    if (p.by_index()) {  // causal: key <= query + offset
      if (kKeyRows) {    // the first query column that sees key r0 + g + 8i
        const int64_t e = r0 + g + 8 * i - p.offset - c0;
        lo[i] = e > 0 ? (e > kN ? kN : int(e)) : 0;
      } else {  // the last key column query r0 + g + 8i sees
        const int64_t e = r0 + g + 8 * i + p.offset - c0;
        hi[i] = e < hi[i] ? (e < -1 ? -1 : int(e)) : hi[i];
      }
    }
  }
  const int64_t cb = b * (kKeyRows ? p.t : p.s) + c0;
  const int32_t* cpos = kDocPos && p.by_pos() ? (kKeyRows ? p.q_pos : p.k_pos) + cb : nullptr;
  const int32_t* cdoc = kDocPos && p.q_doc ? (kKeyRows ? p.q_doc : p.k_doc) + cb : nullptr;
#pragma unroll
  for (int nt = 0; nt < kN / 8; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = 8 * nt + cl + j;
      int cp = 0, cd = 0;
      if (kDocPos && c < nc) {
        if (cpos) cp = __ldg(cpos + c);
        if (cdoc) cd = __ldg(cdoc + c);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        bool ok;
        if constexpr (kKeyRows) ok = c >= lo[i] && c <= hi[i] && (!cpos || rp[i] <= cp) && (!cdoc || cd == rd[i]);
        else ok = c <= hi[i] && (!cpos || cp <= rp[i]) && (!cdoc || cd == rd[i]);
        if (!ok) s[nt][2 * i + j] = -INFINITY;
      }
    }
  }
}

// The next block of kStep keys at or after k0 (a multiple of kStep) that the documents or
// positions do not hide entirely from queries [q0, q0 + nq); k_end when none. The same for
// every warp.
template <int kStep>
__device__ __forceinline__ int64_t next_open(const Params& p, int64_t b, int64_t q0, int nq, int64_t k0,
                                             int64_t k_end) {
  if (p.q_doc || p.by_pos())
    while (k0 < k_end && !tile_open(p, b, q0, nq, k0, int(imin(kStep, p.s - k0)))) k0 += kStep;
  return k0;
}

/// The document ids and positions (those the call has) of this lane's two rows, i0 + g and
/// i0 + g + 8, of a (B, n) table pair: queries (q_doc, q_pos, T) or keys (k_doc, k_pos, S). Rows
/// past n, and calls without documents or positions, keep 0.
template <bool kDocPos>
__device__ __forceinline__ void lane_doc_pos(const Params& p, bool keys, int64_t b, int64_t i0, int g, int (&doc)[2],
                                             int (&pos)[2]) {
  const int64_t n = keys ? p.s : p.t;
  const int32_t* docs = keys ? p.k_doc : p.q_doc;
  const int32_t* poss = keys ? p.k_pos : p.q_pos;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t r = i0 + g + 8 * i;
    if (kDocPos && r < n) {
      if (docs) doc[i] = docs[b * n + r];
      if (p.by_pos()) pos[i] = poss[b * n + r];
    }
  }
}

}  // namespace quilt::kernels::cuda
