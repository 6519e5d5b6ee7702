// CPU kernels of the mixture-of-experts ops (see moe.h).
//
// The grouped GEMMs cut each group into tiles whose sizes follow from the shapes alone, sort the
// tiles largest first and hand them out one at a time inside a single OpenMP parallel region;
// each tile is one single-threaded GEMM of the library measured fastest for such tiles in its
// transpose mode (kernels/cpu/gemm_libs.h: OpenBLAS, BLIS, oneDNN or Eigen; nested in the region, every one of
// them runs on the calling thread, and each thread's nthreads ICV is 1 there as well), so a tile
// is computed the same way however many threads run and wherever it lands: the result is
// bit-identical across thread counts. bf16/f16 tiles are multiplied into per-thread f32 scratch
// and rounded once: bf16 natively where the CPU can (oneDNN, AVX512-BF16 or AMX), otherwise
// (and f16 always) widened to f32 first.
#include "kernels/cpu/moe.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cpu/eigen_map.h"
#include "kernels/cpu/gemm_libs.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec_math.h"

namespace quilt::kernels::cpu {
namespace {

// A strided matrix operand: element (i, j) at p[i * ld + j], or p[j * ld + i] when transposed.
template <class T>
struct Mat {
  const T* p = nullptr;
  int64_t ld = 0;
  bool trans = false;
  // The operand starting at row r, column c.
  Mat at(int64_t r, int64_t c) const { return {p + (trans ? c * ld + r : r * ld + c), ld, trans}; }
};

// c (m, n), ldc = a (m, k) @ b (k, n) through the tile library of the transpose mode (Eigen when
// it cannot take the operands), on the calling thread inside run_items' region.
template <class T>
void gemm_tile(int64_t m, int64_t n, int64_t k, const Mat<T>& a, const Mat<T>& b, T* c, int64_t ldc) {
  MMap<T> C(c, m, n, Eigen::OuterStride<>(ldc));
  if (k == 0) {
    C.setZero();
    return;
  }
  const gemm_libs::Lib lib = gemm_libs::active_tile(a.trans, b.trans);
  if (lib != gemm_libs::Lib::eigen) {
    const GemmArgs g{.m = m, .n = n, .k = k, .trans_a = a.trans, .trans_b = b.trans, .a = a.p, .lda = a.ld,
                     .b = b.p, .ldb = b.ld, .c = c, .ldc = ldc};
    bool done = false;
    if constexpr (std::is_same_v<T, float>) done = gemm_libs::sgemm(lib, g, a.p, b.p, c);
    else done = gemm_libs::dgemm(lib, g, a.p, b.p, c);
    if (done) return;
  }
  CMap<T> A(a.p, a.trans ? k : m, a.trans ? m : k, Eigen::OuterStride<>(a.ld));
  CMap<T> B(b.p, b.trans ? n : k, b.trans ? k : n, Eigen::OuterStride<>(b.ld));
  if (!a.trans && !b.trans) C.noalias() = A * B;
  else if (a.trans && !b.trans) C.noalias() = A.transpose() * B;
  else if (!a.trans && b.trans) C.noalias() = A * B.transpose();
  else C.noalias() = A.transpose() * B.transpose();
}

// The (rows, cols) block of a 16-bit operand widened into `buf`, row-major.
template <class H>
Mat<float> widen(const Mat<H>& s, int64_t rows, int64_t cols, std::vector<float>& buf) {
  buf.resize(size_t(rows * cols));
  float* d = buf.data();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) d[i * cols + j] = float(s.trans ? s.p[j * s.ld + i] : s.p[i * s.ld + j]);
  return {d, cols, false};
}

// Per-thread f32 scratch of the 16-bit path, kept for the thread's next call (a tile's worth
// of f32 is megabytes: allocated afresh per call it would be faulted in afresh).
struct Scratch {
  std::vector<float> a, b, c;
};
Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

// c (m, n) = a @ b in T's compute type: directly for f32/f64; for 16-bit into f32 scratch,
// rounded once: bf16 operands straight to oneDNN's native bf16 GEMM (f32 accumulate) where the
// CPU has AVX512-BF16 or AMX (gemm_libs::bf16_native), otherwise widened to f32 first.
template <class T>
void gemm_any(int64_t m, int64_t n, int64_t k, const Mat<T>& a, const Mat<T>& b, T* c, int64_t ldc, Scratch& s) {
  if (m == 0 || n == 0) return;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    gemm_tile<T>(m, n, k, a, b, c, ldc);
  } else {
    s.c.resize(size_t(m * n));
    bool done = false;
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (k > 0 && gemm_libs::bf16_native()) {
        const GemmArgs g{.m = m, .n = n, .k = k, .trans_a = a.trans, .trans_b = b.trans, .a = a.p, .lda = a.ld,
                         .b = b.p, .ldb = b.ld, .c = s.c.data(), .ldc = n};
        done = gemm_libs::gemm_bf16_f32(gemm_libs::Lib::onednn, g, reinterpret_cast<const uint16_t*>(a.p),
                                        reinterpret_cast<const uint16_t*>(b.p), s.c.data());
      }
    }
    if (!done) {
      const Mat<float> fa = widen(a, m, k, s.a), fb = widen(b, k, n, s.b);
      gemm_tile<float>(m, n, k, fa, fb, s.c.data(), n);
    }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = T(s.c[size_t(i * n + j)]);
  }
}

// ---- tiling ----

// Forward tiles. A tile of few rows streams its slice of w once (close to memory-bound); if w is
// row-major, a narrow slice is short runs (nt * 4 bytes every N), so such tiles get wide column
// ranges, which the prefetchers and DRAM serve best (a transposed w has each column contiguous
// and streams at any width). A tile of many rows reuses w from cache (compute-bound): it is up
// to 512 x 512, since every tile packs its blocks of x and w afresh (the library's per-call
// packing), and 256 x 256 tiles packed each block of a 1024-row expert four times, against two
// (with random routing over 8 experts, 4096 rows, K 2048, N 768, 2 threads of an AVX-512 EPYC:
// f32 332 -> 351-356 GFLOP/s, bf16 622-632 -> 685-704). (The row/column rule: an AVX2 EPYC.)
constexpr int64_t kMaxRowTile = 512;   // rows of x per tile
constexpr int64_t kManyRows = 192;     // from here on a tile counts as compute-bound
constexpr int64_t kWideColTile = 1024;  // columns of w per tile below kManyRows rows
constexpr int64_t kMaxColTile = 512;    // columns of w per tile otherwise
// Weight-gradient tiles (K rows of dw by columns): up to kGradColTile columns of dy and about
// kTileMacs multiply-adds each, enough to amortise packing and the hand-out, and at least
// kMinDepthTile rows of dw.
constexpr int64_t kGradColTile = 256;
constexpr int64_t kTileMacs = int64_t(1) << 24;
constexpr int64_t kMinDepthTile = 128;

// `extent` cut into near-equal pieces of at most `max_piece` (multiples of 8 where cut).
struct Split {
  int64_t count = 0, piece = 0;
};
Split split(int64_t extent, int64_t max_piece) {
  if (extent <= 0) return {0, 0};
  max_piece = std::max<int64_t>(max_piece, 8);
  if (extent <= max_piece) return {1, extent};
  int64_t count = (extent + max_piece - 1) / max_piece;
  const int64_t piece = ((extent + count - 1) / count + 7) / 8 * 8;
  count = (extent + piece - 1) / piece;
  return {count, piece};
}

struct Item {
  int64_t group, r0, rows, c0, cols, macs;
};

// Largest first, so that the last tiles handed out are the small ones (ties keep their order).
void sort_items(std::vector<Item>& items) {
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.macs > b.macs; });
}

// Runs body(item, scratch) for every item in one parallel region, a tile at a time.
template <class F>
void run_items(const std::vector<Item>& items, F&& body) {
  if (items.empty()) return;
  const int threads = int(std::min<int64_t>(omp_in_parallel() ? 1 : omp_get_max_threads(), int64_t(items.size())));
  const int64_t n = int64_t(items.size());
  if (threads == 1) {  // one tile (or one thread): it may use every thread the library has
    Scratch& s = thread_scratch();
    for (int64_t i = 0; i < n; ++i) body(items[size_t(i)], s);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    omp_set_num_threads(1);  // this thread's GEMM calls stay single-threaded (see the top)
    Scratch& s = thread_scratch();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) body(items[size_t(i)], s);
  }
}

template <class T>
void grouped_gemm_t(const GroupedGemmArgs& g) {
  if (g.m == 0 || g.n == 0) return;
  T* out = static_cast<T*>(g.out);
  std::vector<Item> items;
  int64_t start = 0;
  for (int64_t e = 0; e < g.groups; ++e) {
    const int64_t rows = g.offsets[e] - start;
    if (rows > 0) {
      const Split rs = split(rows, kMaxRowTile);
      const Split cs = split(g.n, rs.piece < kManyRows && !g.trans_w ? kWideColTile : kMaxColTile);
      for (int64_t r = 0; r < rs.count; ++r) {
        const int64_t r0 = r * rs.piece, nr = std::min(rs.piece, rows - r0);
        for (int64_t c = 0; c < cs.count; ++c) {
          const int64_t c0 = c * cs.piece, nc = std::min(cs.piece, g.n - c0);
          items.push_back({e, start + r0, nr, c0, nc, nr * nc * std::max<int64_t>(g.k, 1)});
        }
      }
    }
    start = g.offsets[e];
  }
  sort_items(items);
  const Mat<T> x{static_cast<const T*>(g.x), g.ldx, g.trans_x};
  const T* w = static_cast<const T*>(g.w);
  run_items(items, [&](const Item& it, Scratch& s) {
    const Mat<T> we{w + it.group * g.w_group_stride, g.ldw, g.trans_w};
    gemm_any<T>(it.rows, it.cols, g.k, x.at(it.r0, 0), we.at(0, it.c0), out + it.r0 * g.ldo + it.c0, g.ldo, s);
  });
}

template <class T>
void grouped_gemm_weight_grad_t(const GroupedGemmWeightGradArgs& g) {
  if (g.k == 0 || g.n == 0) return;
  T* dw = static_cast<T*>(g.dw);
  std::vector<Item> items;
  int64_t start = 0;
  for (int64_t e = 0; e < g.groups; ++e) {
    const int64_t rows = g.offsets[e] - start;
    // An empty group is one tile that writes zeros (a k = 0 GEMM).
    const int64_t depth = std::max<int64_t>(rows, 1);
    const Split cs = split(g.n, kGradColTile);
    const int64_t k_max = std::max(kMinDepthTile, kTileMacs / (depth * cs.piece));
    const Split ks = rows > 0 ? split(g.k, k_max) : Split{1, g.k};
    const Split cs2 = rows > 0 ? cs : Split{1, g.n};
    for (int64_t kt = 0; kt < ks.count; ++kt) {
      const int64_t k0 = kt * ks.piece, nk = std::min(ks.piece, g.k - k0);
      for (int64_t c = 0; c < cs2.count; ++c) {
        const int64_t c0 = c * cs2.piece, nc = std::min(cs2.piece, g.n - c0);
        items.push_back({e, k0, nk, c0, nc, nk * nc * depth});
      }
    }
    start = g.offsets[e];
  }
  sort_items(items);
  const Mat<T> x{static_cast<const T*>(g.x), g.ldx, g.trans_x};
  const Mat<T> dy{static_cast<const T*>(g.dy), g.lddy, g.trans_dy};
  std::vector<int64_t> begin(size_t(g.groups));
  for (int64_t e = 0; e < g.groups; ++e) begin[size_t(e)] = e == 0 ? 0 : g.offsets[e - 1];
  run_items(items, [&](const Item& it, Scratch& s) {
    const int64_t r0 = begin[size_t(it.group)], rows = g.offsets[it.group] - r0;
    // dw_e[k0:, c0:] = (x_e[:, k0:])^T @ dy_e[:, c0:]: x's block read transposed.
    const Mat<T> xt = x.at(r0, it.r0);
    const Mat<T> a{xt.p, xt.ld, !xt.trans};
    gemm_any<T>(it.rows, it.cols, rows, a, dy.at(r0, it.c0), dw + it.group * g.k * g.n + it.r0 * g.n + it.c0, g.n, s);
  });
}

// ---- row kernels ----

// Rows per thread chunk so that a chunk moves about kGrain elements.
int64_t row_grain(int64_t h) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(h, 1)); }

template <class T>
void permute_t(int64_t n, int64_t h, int64_t k, const int64_t* order, const T* x, int64_t ldx, const T* w, T* out) {
  using C = compute_t<T>;
  parallel_range(n, row_grain(h), [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t s = order[p];
      const T* src = x + (s / k) * ldx;
      T* dst = out + p * h;
      if (!w) {
        std::memcpy(dst, src, size_t(h) * sizeof(T));
        continue;
      }
      const C ws = C(w[s]);
      for (int64_t i = 0; i < h; ++i) dst[i] = T(ws * C(src[i]));
    }
  });
}

// acc[i] = (acc[i] +) sum over j < G of ws[j] * src[j][i] (or src[j][i] unweighted), in
// ascending j: the first term of the row a product, every later one a vec::mul_add into the
// running sum (named, so the bits do not depend on how the compiler contracts). All G rows are
// read in one pass and the sum kept in a register, so the k rows of a token stream in together
// and acc is written once per pass, not once per row.
template <int G, bool First, bool Weighted, class T, class C>
QUILT_VEC_INLINE void combine_pass(C* __restrict acc, int64_t n, const T* const* src, const C* ws) {
  const T* s[G];
  C w[G];
  for (int j = 0; j < G; ++j) s[j] = src[j], w[j] = Weighted ? ws[j] : C(1);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    C v;
    if constexpr (First) v = Weighted ? w[0] * C(vec::load(s[0][i])) : C(vec::load(s[0][i]));
    else v = Weighted ? vec::mul_add(w[0], C(vec::load(s[0][i])), acc[i]) : acc[i] + C(vec::load(s[0][i]));
    for (int j = 1; j < G; ++j) v = Weighted ? vec::mul_add(w[j], C(vec::load(s[j][i])), v) : v + C(vec::load(s[j][i]));
    acc[i] = v;
  }
}

// acc = the combine of k rows (k >= 1) in passes of 8, 4, 2 and 1 rows: the same order of adds as
// one row at a time, so the result does not depend on how k splits into passes.
template <bool Weighted, class T, class C>
void combine_rows(C* __restrict acc, int64_t n, int64_t k, const T* const* src, const C* ws) {
  int64_t j = 0;
  auto pass = [&]<int G>() {
    if (j == 0) combine_pass<G, true, Weighted>(acc, n, src, ws);
    else combine_pass<G, false, Weighted>(acc, n, src + j, ws + j);
    j += G;
  };
  while (k - j >= 8) pass.template operator()<8>();
  if (k - j >= 4) pass.template operator()<4>();
  if (k - j >= 2) pass.template operator()<2>();
  if (k - j >= 1) pass.template operator()<1>();
}

template <class T>
void unpermute_t(int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const T* y, int64_t ldy, const T* w,
                 T* out) {
  using C = compute_t<T>;
  if (k == 0) {
    for (int64_t i = 0; i < tokens * h; ++i) out[i] = T(0);
    return;
  }
  constexpr int64_t kChunk = 1024;  // columns at a time (accumulated on the stack for 16-bit)
  parallel_range(tokens, row_grain(h * k), [&](int64_t lo, int64_t hi) {
    std::vector<const T*> src(static_cast<size_t>(k));
    std::vector<C> ws(static_cast<size_t>(k));
    C acc_buf[std::is_same_v<T, C> ? 1 : kChunk];
    for (int64_t t = lo; t < hi; ++t) {
      T* dst = out + t * h;
      for (int64_t j = 0; j < k; ++j) ws[size_t(j)] = w ? C(w[t * k + j]) : C(1);
      for (int64_t c0 = 0; c0 < h; c0 += kChunk) {
        const int64_t nc = std::min(kChunk, h - c0);
        for (int64_t j = 0; j < k; ++j) src[size_t(j)] = y + slot_row[t * k + j] * ldy + c0;
        C* acc;
        if constexpr (std::is_same_v<T, C>) acc = dst + c0;
        else acc = acc_buf;
        if (w) combine_rows<true>(acc, nc, k, src.data(), ws.data());
        else combine_rows<false>(acc, nc, k, src.data(), ws.data());
        if constexpr (!std::is_same_v<T, C>) {
#pragma omp simd
          for (int64_t i = 0; i < nc; ++i) vec::store(dst[c0 + i], acc[i]);
        }
      }
    }
  });
}

// dot(a, b) over n in a fixed order: kLanes running sums, then a fixed tree.
template <class T>
compute_t<T> dot_fixed(const T* a, const T* b, int64_t n) {
  using C = compute_t<T>;
  constexpr int kLanes = 16;
  C acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += C(a[i + l]) * C(b[i + l]);
  for (int l = 0; i < n; ++i, ++l) acc[l] += C(a[i]) * C(b[i]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0];
}

template <class T>
void slot_dot_t(int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const T* a, int64_t lda, const T* b,
                int64_t ldb, T* d) {
  if (h == 0) {  // empty rows (a and b may be null): every dot product is 0
    std::fill(d, d + tokens * k, T(0));
    return;
  }
  parallel_range(tokens * k, row_grain(2 * h), [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) d[s] = T(dot_fixed(a + (s / k) * lda, b + slot_row[s] * ldb, h));
  });
}

}  // namespace

void grouped_gemm(DType dt, const GroupedGemmArgs& args) {
  QUILT_DISPATCH_FLOATING(dt, [&] { grouped_gemm_t<scalar_t>(args); });
}

void grouped_gemm_weight_grad(DType dt, const GroupedGemmWeightGradArgs& args) {
  QUILT_DISPATCH_FLOATING(dt, [&] { grouped_gemm_weight_grad_t<scalar_t>(args); });
}

int64_t moe_invert_order(int64_t n, const int64_t* order, int64_t* slot_row) {
  std::fill(slot_row, slot_row + n, int64_t(-1));
  for (int64_t p = 0; p < n; ++p) {
    const int64_t s = order[p];
    if (s < 0 || s >= n || slot_row[s] >= 0) return p;
    slot_row[s] = p;
  }
  return -1;
}

void moe_permute(DType dt, int64_t n, int64_t h, int64_t k, const int64_t* order, const void* x, int64_t ldx,
                 const void* w, void* out) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    permute_t<scalar_t>(n, h, k, order, static_cast<const scalar_t*>(x), ldx, static_cast<const scalar_t*>(w),
                        static_cast<scalar_t*>(out));
  });
}

void moe_unpermute(DType dt, int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const void* y,
                   int64_t ldy, const void* w, void* out) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    unpermute_t<scalar_t>(tokens, h, k, slot_row, static_cast<const scalar_t*>(y), ldy,
                          static_cast<const scalar_t*>(w), static_cast<scalar_t*>(out));
  });
}

void moe_slot_dot(DType dt, int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const void* a,
                  int64_t lda, const void* b, int64_t ldb, void* d) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    slot_dot_t<scalar_t>(tokens, h, k, slot_row, static_cast<const scalar_t*>(a), lda,
                         static_cast<const scalar_t*>(b), ldb, static_cast<scalar_t*>(d));
  });
}

}  // namespace quilt::kernels::cpu
