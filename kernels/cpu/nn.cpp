// Fused CPU kernels for softmax, cross entropy, RMS/layer norm and embedding (see nn.h).
// Rows are independent and split across OpenMP threads; inside a row the math runs on Eigen
// arrays of the compute type C (f32, or f64 for f64 data), so bf16/f16 rows are widened into a
// per-thread scratch row first and rounded once on the way out.
#include "kernels/cpu/nn.h"

#include <Eigen/Core>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec_math.h"

namespace quilt::kernels::cpu {
namespace {

template <class C> using Arr = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
template <class C> using CArr = Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>>;

// Rows per thread chunk so that a chunk holds about kGrain elements.
inline int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)); }

// dst[i] = C(src[i]) / dst[i] = T(src[i]). bf16 is written with integer ops and a select, not
// the scalar converter's early return, so these loops vectorise (they bound every bf16 kernel).
template <class C, class T>
inline void widen_n(C* __restrict dst, const T* __restrict src, int64_t n) {
  if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<C, float>) {
    const uint16_t* __restrict b = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(uint32_t(b[i]) << 16);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = C(src[i]);
  }
}
template <class T, class C>
inline void narrow_n(T* __restrict dst, const C* __restrict src, int64_t n) {
  if constexpr (std::is_same_v<T, BFloat16> && std::is_same_v<C, float>) {
    uint16_t* __restrict b = reinterpret_cast<uint16_t*>(dst);
    int64_t i = 0;
#if defined(__AVX512BF16__)
    // The CPU's own conversion, 16 at a time: round to nearest even and NaN kept quiet as
    // vec::bf16_bits below, except that it flushes inputs below 2^-126 to zero (bf16 denormals,
    // far under anything a training step produces).
    for (; i + 16 <= n; i += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
      std::memcpy(b + i, &h, sizeof h);
    }
#endif
    for (; i < n; ++i) b[i] = vec::bf16_bits(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);
  }
}

// Scratch rows of the compute type for one thread's chunk (empty when T is already C).
template <class T>
struct Scratch {
  using C = compute_t<T>;
  static constexpr bool kWiden = !std::is_same_v<T, C>;
  std::vector<C> a, b, c;
  explicit Scratch(int64_t cols) {
    if constexpr (kWiden) { a.resize(size_t(cols)); b.resize(size_t(cols)); c.resize(size_t(cols)); }
  }
  // The row as C values: itself, or widened into `buf`.
  static const C* load(const T* src, int64_t n, std::vector<C>& buf) {
    if constexpr (kWiden) {
      widen_n(buf.data(), src, n);
      return buf.data();
    } else {
      return src;
    }
  }
  // Where to compute an output row: in place, or in `buf` to be stored with store().
  static C* target(T* dst, std::vector<C>& buf) {
    if constexpr (kWiden) return buf.data();
    else return dst;
  }
  static void store(T* dst, const C* src, int64_t n) {
    if constexpr (kWiden) narrow_n(dst, src, n);
  }
};

template <class I>
void with_index_type(DType dt, I&& f) {
  if (dt == DType::i32) f(int32_t{});
  else f(int64_t{});
}

// bf16 rows (and f32 ones where measured faster) go sixteen lanes at a time (vec::F32x16): T loaded
// and stored in place, no scratch row, and the row's sums in four independent accumulators. A sum is
// taken over 64-element steps into the four, then 16-element steps into the first, then the
// scalar tail, so its order is a function of the row length alone.
template <class T>
constexpr bool kLanes16 = std::is_same_v<T, float> || std::is_same_v<T, BFloat16>;

// Where the CPU has AVX or AVX-512 (vec::kFastExp16), the exp-bound kernels (SwiGLU, cross
// entropy) can take the exp in sixteen lanes (vec::exp16), T read and written in place. In
// alternating runs against Eigen's array form (docs/PERF.md) that won on AVX-512 for every bf16
// kernel (no widened copy of the rows and no narrowing pass) and, in f32, for the SwiGLU backward
// and the cross-entropy forward (which prefetches the next row); there the f32 SwiGLU forward
// and cross-entropy backward measured within the noise or below and stay on Eigen, as does
// everything without AVX, f64, f16. On AVX2 the lanes' exp is our own (vec::exp8, 1.9x Eigen's
// packet exp), and every f32 and bf16 kernel takes it, softmax included.
template <class T>
constexpr bool kExpLanes = vec::kFastExp16 && kLanes16<T>;
template <class T>
constexpr bool kExpLanesBf16 = vec::kFastExp16 && std::is_same_v<T, BFloat16>;
// The SwiGLU forward and cross-entropy backward, on Eigen's form in f32 on AVX-512, take the lanes
// in f32 too where they are our own exp (AVX2). (Softmax takes them only there, kExp16IsScalar.)
template <class T>
constexpr bool kExpLanesOwn = vec::kExp16IsScalar ? kExpLanes<T> : kExpLanesBf16<T>;

// ---- softmax ----

template <class T>
void softmax_row16(T* o, const T* x, int64_t n, bool log, float* e);

template <class T>
void softmax_fwd(T* out, const T* in, int64_t rows, int64_t cols, bool log) {
  using S = Scratch<T>;
  using C = typename S::C;
  parallel_range(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    S s(cols);
    for (int64_t r = b; r < e; ++r) {
      if constexpr (vec::kExp16IsScalar && kExpLanes<T>) {
        T* orow = out + r * cols;
        float* ex;
        if constexpr (std::is_same_v<T, float>) ex = orow;
        else ex = s.b.data();
        softmax_row16(orow, in + r * cols, cols, log, ex);
        continue;
      }
      CArr<C> x(S::load(in + r * cols, cols, s.a), cols);
      T* orow = out + r * cols;
      Arr<C> o(S::target(orow, s.b), cols);
      const C m = x.maxCoeff();
      if (log) {
        const C lse = m + std::log((x - m).exp().sum());
        o = x - lse;
      } else {
        o = (x - m).exp();
        o *= C(1) / o.sum();
      }
      S::store(orow, o.data(), cols);
    }
  });
}

template <class T>
void softmax_bwd(T* gin, const T* gout, const T* y, int64_t rows, int64_t cols, bool log) {
  using S = Scratch<T>;
  using C = typename S::C;
  parallel_range(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    S s(cols);
    for (int64_t r = b; r < e; ++r) {
      CArr<C> g(S::load(gout + r * cols, cols, s.a), cols);
      CArr<C> yy(S::load(y + r * cols, cols, s.b), cols);
      T* orow = gin + r * cols;
      Arr<C> o(S::target(orow, s.c), cols);
      if (log) o = g - yy.exp() * g.sum();
      else o = yy * (g - (g * yy).sum());
      S::store(orow, o.data(), cols);
    }
  });
}

// ---- cross entropy ----

// log Σ exp(x_i) of a row: its max in four lane accumulators (row_max16), then Σ exp(x - max) by
// vec::sum16 from cache. `next` (the following row, or null) is prefetched during the exp pass, so its trip
// from memory overlaps this row's exps instead of stalling the next max pass.
template <class T>
float row_max16(const T* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  if (n >= 16) {
    vec::F32x16 m0 = vec::load16(x), m1 = m0, m2 = m0, m3 = m0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      m0 = vec::max16(m0, vec::load16(x + i));
      m1 = vec::max16(m1, vec::load16(x + i + 16));
      m2 = vec::max16(m2, vec::load16(x + i + 32));
      m3 = vec::max16(m3, vec::load16(x + i + 48));
    }
    for (; i + 16 <= n; i += 16) m0 = vec::max16(m0, vec::load16(x + i));
    m = vec::hmax(vec::max16(vec::max16(m0, m1), vec::max16(m2, m3)));
  }
  for (int64_t i = n / 16 * 16; i < n; ++i) m = std::max(m, vec::load(x[i]));
  return m;
}

template <class T>
float row_logsumexp16(const T* x, int64_t n, const T* next = nullptr) {
  const float m = row_max16(x, n);
  const vec::F32x16 m16 = vec::splat16(m);
  const float s = vec::sum16(
      n,
      [&](int64_t i, vec::F32x16& acc) {
        if (next) _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
        acc += vec::exp16(vec::load16(x + i) - m16);
      },
      [&](int64_t i) { return vec::exp(vec::load(x[i]) - m); });
  return m + std::log(s);
}

// A softmax or log-softmax row in lanes where the exp is our own (AVX2), T read and written in
// place: log-softmax as x - logsumexp; softmax as exp(x - max) into `e` (the output row in f32,
// else f32 scratch) with its sum in the same pass, then scaled by 1 / sum.
template <class T>
void softmax_row16(T* o, const T* x, int64_t n, bool log, float* e) {
  int64_t i = 0;
  if (log) {
    const float l = row_logsumexp16(x, n);
    const vec::F32x16 l16 = vec::splat16(l);
    for (; i + 16 <= n; i += 16) vec::store16(o + i, vec::load16(x + i) - l16);
    for (; i < n; ++i) vec::store(o[i], vec::load(x[i]) - l);
    return;
  }
  const float m = row_max16(x, n);
  const vec::F32x16 m16 = vec::splat16(m);
  const float sum = vec::sum16(
      n,
      [&](int64_t k, vec::F32x16& acc) {
        const vec::F32x16 v = vec::exp16(vec::load16(x + k) - m16);
        vec::store16(e + k, v);
        acc += v;
      },
      [&](int64_t k) { return e[k] = vec::exp(vec::load(x[k]) - m); });
  const float inv = 1.0f / sum;
  const vec::F32x16 inv16 = vec::splat16(inv);
  for (; i + 16 <= n; i += 16) vec::store16(o + i, vec::load16(e + i) * inv16);
  for (; i < n; ++i) vec::store(o[i], e[i] * inv);
}

template <class C>
C logsumexp(const CArr<C>& x) {
  const C m = x.maxCoeff();
  return m + std::log((x - m).exp().sum());
}

template <class T, class I>
void ce_fwd(compute_t<T>* loss, compute_t<T>* lse, const T* logits, const I* target, int64_t rows, int64_t cols,
            int64_t ignore) {
  using S = Scratch<T>;
  using C = typename S::C;
  parallel_range(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    S s(kExpLanes<T> ? 0 : cols);  // (the lane path needs no scratch row)
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = int64_t(target[r]);
      if (t == ignore) {
        loss[r] = C(0);
        if (lse) lse[r] = C(0);
        continue;
      }
      C l, xt;
      if constexpr (kExpLanes<T>) {
        l = row_logsumexp16(logits + r * cols, cols, r + 1 < e ? logits + (r + 1) * cols : nullptr);
        xt = vec::load(logits[r * cols + t]);
      } else {
        CArr<C> x(S::load(logits + r * cols, cols, s.a), cols);
        l = logsumexp(x);
        xt = x[t];
      }
      loss[r] = l - xt;
      if (lse) lse[r] = l;
    }
  });
}

// With the forward's lse the softmax is never formed apart from the gradient: one read of the
// row, one write. Without it, the row's logsumexp is recomputed (the row is then in cache).
template <class T, class I>
void ce_bwd(T* grad, const T* logits, const I* target, const compute_t<T>* scale, const compute_t<T>* lse,
            int64_t rows, int64_t cols, int64_t ignore) {
  using S = Scratch<T>;
  using C = typename S::C;
  parallel_range(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    S s(kExpLanesOwn<T> ? 0 : cols);
    for (int64_t r = b; r < e; ++r) {
      T* orow = grad + r * cols;
      const int64_t t = int64_t(target[r]);
      if (t == ignore) {  // written as zeros, never scale * 0 (scale may be inf for an all-ignored mean)
        std::memset(static_cast<void*>(orow), 0, size_t(cols) * sizeof(T));
        continue;
      }
      const C k = scale[r];
      if constexpr (kExpLanesOwn<T>) {
        const T* x = logits + r * cols;
        const float l = lse ? lse[r] : row_logsumexp16(x, cols);
        const vec::F32x16 l16 = vec::splat16(l), k16 = vec::splat16(k);
        int64_t i = 0;
        const int64_t n = cols;  // a local bound (see vec::store16)
        for (; i + 16 <= n; i += 16) vec::store16(orow + i, vec::exp16(vec::load16(x + i) - l16) * k16);
        for (; i < n; ++i) vec::store(orow[i], vec::exp(vec::load(x[i]) - l) * k);
        // The target's element again from the logit (a bf16 row was already rounded once).
        vec::store(orow[t], vec::exp(vec::load(x[t]) - l) * k - k);
        continue;
      }
      CArr<C> x(S::load(logits + r * cols, cols, s.a), cols);
      Arr<C> o(S::target(orow, s.b), cols);
      // (recomputed as the forward computes it, so a kept and a recomputed lse are the same bits)
      C l;
      if (lse) l = lse[r];
      else if constexpr (kExpLanes<T>) l = row_logsumexp16(logits + r * cols, cols);
      else l = logsumexp(x);
      o = (x - l).exp() * k;
      o[t] -= k;
      S::store(orow, o.data(), cols);
    }
  });
}

// ---- norms ----

// Rows split into a fixed number of blocks (a function of `rows` only), so that weight
// gradients are summed in the same order whatever the thread count.
inline int64_t norm_blocks(int64_t rows) { return std::clamp<int64_t>(rows, 1, 64); }
inline int64_t block_begin(int64_t rows, int64_t nb, int64_t b) { return rows * b / nb; }

// Sums per-block partials (nb, cols) of C into out (cols) of T, blocks in order. Columns go in
// chunks, each summed over the blocks row by row (contiguous, vectorised) in one accumulator
// row; a column at a time would stride through the partials by `cols`.
template <class T, class C>
void sum_partials(T* out, const C* part, int64_t nb, int64_t cols) {
  constexpr int64_t kChunk = 512;
  const int64_t chunks = (cols + kChunk - 1) / kChunk;
  parallel_range(chunks, std::max<int64_t>(1, kGrain / (std::max<int64_t>(nb, 1) * kChunk)), [&](int64_t b, int64_t e) {
    alignas(64) C acc[kChunk];
    for (int64_t ch = b; ch < e; ++ch) {
      const int64_t c0 = ch * kChunk, n = std::min(kChunk, cols - c0);
      std::fill(acc, acc + n, C(0));
      for (int64_t k = 0; k < nb; ++k) {
        const C* __restrict p = part + k * cols + c0;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) acc[c] += p[c];
      }
      for (int64_t c = 0; c < n; ++c) out[c0 + c] = T(acc[c]);
    }
  });
}

template <class T, class C>
void sum_partials(T* out, const std::vector<C>& part, int64_t nb, int64_t cols) {
  sum_partials(out, part.data(), nb, cols);
}

// A norm's weight row widened to f32 once per thread chunk; ones without a weight.
template <class T>
std::vector<float> weight_row(const T* w, int64_t cols) {
  std::vector<float> row(size_t(cols), 1.0f);
  for (int64_t i = 0; i < (w ? cols : 0); ++i) row[size_t(i)] = float(w[i]);
  return row;
}

template <class T>
void rms_fwd16(T* y, float* rstd, const T* x, const T* res, T* h, const T* w, int64_t rows, int64_t cols,
               double eps) {
  using vec::load16, vec::store16;
  parallel_range(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    const int64_t n = cols;  // a local bound (see vec::store16)
    const std::vector<float> wbuf = weight_row(w, n);
    const float* __restrict wp = wbuf.data();
    for (int64_t r = b; r < e; ++r) {
      const T* __restrict xr = x + r * n;
      if (res) {  // h = x + res, stored (rounded to T) first: the norm reads h as stored
        const T* __restrict rr = res + r * n;
        T* __restrict hr = h + r * n;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) store16(hr + i, load16(xr + i) + load16(rr + i));
        for (; i < n; ++i) vec::store(hr[i], vec::load(xr[i]) + vec::load(rr[i]));
        xr = hr;
      }
      const float ss = vec::sum16(
          n, [&](int64_t i, vec::F32x16& a) { const vec::F32x16 v = load16(xr + i); a += v * v; },
          [&](int64_t i) { const float v = vec::load(xr[i]); return v * v; });
      const float rs = 1.0f / std::sqrt(ss / float(n) + float(eps));
      rstd[r] = rs;
      T* __restrict yr = y + r * n;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) store16(yr + i, load16(xr + i) * rs * load16(wp + i));
      for (; i < n; ++i) vec::store(yr[i], vec::load(xr[i]) * rs * wp[i]);
    }
  });
}

// With `res` (add_rms_norm) the row normalised is h = x + res, stored to `h` first (rounded to
// T, so y is exactly rms_norm of the stored h); without, it is x itself.
template <class T>
void rms_fwd(T* y, compute_t<T>* rstd, const T* x, const T* res, T* h, const T* w, int64_t rows, int64_t cols,
             double eps) {
  // f32 stays on the Eigen form below: at 16384 x 1024 it read 40-51 GB/s against the lanes'
  // 28-38 (AVX-512 EPYC, alternating runs), while for bf16 the lanes were 1.3-2.3x faster.
  if constexpr (std::is_same_v<T, BFloat16>) {
    rms_fwd16(y, rstd, x, res, h, w, rows, cols, eps);
    return;
  }
  using S = Scratch<T>;
  using C = typename S::C;
  parallel_range(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    S s(cols);
    std::vector<C> wbuf(size_t(w ? cols : 0));
    for (int64_t i = 0; i < (w ? cols : 0); ++i) wbuf[size_t(i)] = C(w[i]);
    for (int64_t r = b; r < e; ++r) {
      const C* xp;
      if (res) {
        const T* __restrict xr = x + r * cols;
        const T* __restrict rr = res + r * cols;
        T* __restrict hr = h + r * cols;
        if constexpr (S::kWiden) {
          C* __restrict hc = s.a.data();
          C* __restrict rc = s.c.data();
          widen_n(hc, xr, cols);
          widen_n(rc, rr, cols);
          for (int64_t i = 0; i < cols; ++i) hc[i] += rc[i];
          narrow_n(hr, hc, cols);
          widen_n(hc, hr, cols);  // the norm reads h as stored
          xp = hc;
        } else {
          for (int64_t i = 0; i < cols; ++i) hr[i] = xr[i] + rr[i];
          xp = hr;
        }
      } else {
        xp = S::load(x + r * cols, cols, s.a);
      }
      CArr<C> xx(xp, cols);
      T* orow = y + r * cols;
      Arr<C> o(S::target(orow, s.b), cols);
      const C rs = C(1) / std::sqrt(xx.square().sum() / C(cols) + C(eps));
      rstd[r] = rs;
      if (w) o = xx * rs * CArr<C>(wbuf.data(), cols);
      else o = xx * rs;
      S::store(orow, o.data(), cols);
    }
  });
}

template <class T>
void rms_bwd16(T* gx, T* gw, const T* g, const T* gh, const T* x, const T* w, const float* rstd, int64_t rows,
               int64_t cols) {
  using vec::F32x16, vec::load16, vec::store16;
  const int64_t nb = norm_blocks(rows);
  const std::unique_ptr<float[]> part(new float[size_t(gw ? nb * cols : 0)]);
  parallel_range(nb, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n = cols;  // a local bound (see vec::store16)
    const std::vector<float> wbuf = weight_row(w, n);
    const float* __restrict wp = wbuf.data();
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* __restrict pp = gw ? part.get() + blk * n : nullptr;
      if (pp) std::fill(pp, pp + n, 0.0f);  // by the thread that sums into it, in its cache
      for (int64_t r = block_begin(rows, nb, blk); r < block_begin(rows, nb, blk + 1); ++r) {
        const T* __restrict gr = g + r * n;
        const T* __restrict xr = x + r * n;
        const T* __restrict hr = gh ? gh + r * n : nullptr;
        T* __restrict orow = gx + r * n;
        // f32: the next row's g and x (and g_h) are fetched during this row's second pass, a
        // prefetch per cache line (2048 x 512 and 16384 x 1024, four alternating runs on an
        // AVX-512 EPYC: 1.14-1.15x; in bf16 the same read 0.91-0.98x, so bf16 goes without).
        const bool more = std::is_same_v<T, float> && r + 1 < rows;
        const float rs = rstd[r];
        const float dot = vec::sum16(
            n, [&](int64_t i, F32x16& a) { a += load16(gr + i) * load16(wp + i) * load16(xr + i); },
            [&](int64_t i) { return vec::load(gr[i]) * wp[i] * vec::load(xr[i]); });
        const float k = rs * rs * rs * dot / float(n);
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
          if (more) {
            _mm_prefetch(reinterpret_cast<const char*>(gr + n + i), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(xr + n + i), _MM_HINT_T0);
            if (hr) _mm_prefetch(reinterpret_cast<const char*>(hr + n + i), _MM_HINT_T0);
          }
          const F32x16 gv = load16(gr + i), xv = load16(xr + i);
          F32x16 o = rs * (gv * load16(wp + i)) - k * xv;
          if (hr) o += load16(hr + i);
          store16(orow + i, o);
          if (pp) store16(pp + i, load16(pp + i) + gv * xv * rs);
        }
        for (; i < n; ++i) {
          const float gv = vec::load(gr[i]), xv = vec::load(xr[i]);
          vec::store(orow[i], rs * (gv * wp[i]) - k * xv + (hr ? vec::load(hr[i]) : 0.0f));
          if (pp) pp[i] += gv * xv * rs;
        }
      }
    }
  });
  if (gw) sum_partials(gw, part.get(), nb, cols);
}

// With `gh` (add_rms_norm) the gradient that reaches h directly is added to grad_x in the
// same pass.
template <class T>
void rms_bwd(T* gx, T* gw, const T* g, const T* gh, const T* x, const T* w, const compute_t<T>* rstd, int64_t rows,
             int64_t cols) {
  if constexpr (kLanes16<T>) {
    rms_bwd16(gx, gw, g, gh, x, w, rstd, rows, cols);
    return;
  }
  using S = Scratch<T>;
  using C = typename S::C;
  const int64_t nb = norm_blocks(rows);
  std::vector<C> part(size_t(gw ? nb * cols : 0), C(0));
  parallel_range(nb, 1, [&](int64_t b0, int64_t b1) {
    S s(cols);
    std::vector<C> wbuf(size_t(cols), C(1)), hb(size_t(gh ? cols : 0));
    for (int64_t i = 0; i < (w ? cols : 0); ++i) wbuf[size_t(i)] = C(w[i]);
    const C* __restrict wp = wbuf.data();  // ones without a weight
    // Two passes over a row: the dot product g·w·x, then grad_x (and the weight gradient's
    // partial sum) from the same loads, so w·g is never stored.
    for (int64_t blk = b0; blk < b1; ++blk) {
      C* __restrict pp = gw ? part.data() + blk * cols : nullptr;
      for (int64_t r = block_begin(rows, nb, blk); r < block_begin(rows, nb, blk + 1); ++r) {
        const C* __restrict gp = S::load(g + r * cols, cols, s.a);
        const C* __restrict xp = S::load(x + r * cols, cols, s.b);
        const C* __restrict hp = gh ? S::load(gh + r * cols, cols, hb) : nullptr;
        const C rs = rstd[r];
        C dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < cols; ++i) dot += gp[i] * wp[i] * xp[i];
        const C k = rs * rs * rs * dot / C(cols);
        T* orow = gx + r * cols;
        C* __restrict op = S::target(orow, s.c);
        if (hp) {
#pragma omp simd
          for (int64_t i = 0; i < cols; ++i) op[i] = rs * (gp[i] * wp[i]) - k * xp[i] + hp[i];
        } else {
#pragma omp simd
          for (int64_t i = 0; i < cols; ++i) op[i] = rs * (gp[i] * wp[i]) - k * xp[i];
        }
        if (pp) {
#pragma omp simd
          for (int64_t i = 0; i < cols; ++i) pp[i] += gp[i] * xp[i] * rs;
        }
        S::store(orow, op, cols);
      }
    }
  });
  if (gw) sum_partials(gw, part, nb, cols);
}

template <class T>
void ln_fwd(T* y, compute_t<T>* mean, compute_t<T>* rstd, const T* x, const T* w, const T* bias, int64_t rows,
            int64_t cols, double eps) {
  using S = Scratch<T>;
  using C = typename S::C;
  parallel_range(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    S s(cols);
    std::vector<C> wbuf(size_t(w ? cols : 0)), bbuf(size_t(bias ? cols : 0));
    for (int64_t i = 0; i < (w ? cols : 0); ++i) wbuf[size_t(i)] = C(w[i]);
    for (int64_t i = 0; i < (bias ? cols : 0); ++i) bbuf[size_t(i)] = C(bias[i]);
    for (int64_t r = b; r < e; ++r) {
      CArr<C> xx(S::load(x + r * cols, cols, s.a), cols);
      T* orow = y + r * cols;
      Arr<C> o(S::target(orow, s.b), cols);
      const C mu = xx.sum() / C(cols);
      o = xx - mu;  // two passes: the variance of centred values does not cancel
      const C rs = C(1) / std::sqrt(o.square().sum() / C(cols) + C(eps));
      mean[r] = mu;
      rstd[r] = rs;
      o *= rs;
      if (w) o *= CArr<C>(wbuf.data(), cols);
      if (bias) o += CArr<C>(bbuf.data(), cols);
      S::store(orow, o.data(), cols);
    }
  });
}

template <class T>
void ln_bwd(T* gx, T* gw, T* gb, const T* g, const T* x, const T* w, const compute_t<T>* mean,
            const compute_t<T>* rstd, int64_t rows, int64_t cols) {
  using S = Scratch<T>;
  using C = typename S::C;
  const int64_t nb = norm_blocks(rows);
  std::vector<C> pw(size_t(gw ? nb * cols : 0), C(0)), pb(size_t(gb ? nb * cols : 0), C(0));
  parallel_range(nb, 1, [&](int64_t b0, int64_t b1) {
    S s(cols);
    std::vector<C> wbuf(size_t(w ? cols : 0)), xh(static_cast<size_t>(cols)), wg(static_cast<size_t>(cols));
    for (int64_t i = 0; i < (w ? cols : 0); ++i) wbuf[size_t(i)] = C(w[i]);
    for (int64_t blk = b0; blk < b1; ++blk) {
      for (int64_t r = block_begin(rows, nb, blk); r < block_begin(rows, nb, blk + 1); ++r) {
        CArr<C> gg(S::load(g + r * cols, cols, s.a), cols);
        CArr<C> xx(S::load(x + r * cols, cols, s.b), cols);
        const C rs = rstd[r];
        Arr<C> xhat(xh.data(), cols);
        xhat = (xx - mean[r]) * rs;
        Arr<C> wgr(wg.data(), cols);
        if (w) wgr = gg * CArr<C>(wbuf.data(), cols);
        else wgr = gg;
        const C a = wgr.sum() / C(cols);
        const C d = (wgr * xhat).sum() / C(cols);
        T* orow = gx + r * cols;
        Arr<C> o(S::target(orow, s.c), cols);
        o = rs * (wgr - a - xhat * d);
        S::store(orow, o.data(), cols);
        if (gw) Arr<C>(pw.data() + blk * cols, cols) += gg * xhat;
        if (gb) Arr<C>(pb.data() + blk * cols, cols) += gg;
      }
    }
  });
  if (gw) sum_partials(gw, pw, nb, cols);
  if (gb) sum_partials(gb, pb, nb, cols);
}

// ---- swiglu ----

// Elements per block: a block's operands, widened to C, stay in L1 between the array
// statements, so each input is read from memory once and each output written once.
constexpr int64_t kEltBlock = 1024;

template <class T>
const compute_t<T>* widen_block(const T* src, int64_t n, compute_t<T>* buf) {
  if constexpr (std::is_same_v<T, compute_t<T>>) {
    return src;
  } else {
    widen_n(buf, src, n);
    return buf;
  }
}
template <class T>
compute_t<T>* out_block(T* dst, compute_t<T>* buf) {
  if constexpr (std::is_same_v<T, compute_t<T>>) return dst;
  else return buf;
}
template <class T>
void store_block(T* dst, const compute_t<T>* src, int64_t n) {
  if constexpr (!std::is_same_v<T, compute_t<T>>) narrow_n(dst, src, n);
}

// Runs f(offset, len) over blocks of kEltBlock elements, blocks split among threads.
template <class F>
void for_blocks(int64_t n, F&& f) {
  const int64_t blocks = (n + kEltBlock - 1) / kEltBlock;
  parallel_range(blocks, std::max<int64_t>(1, kGrain / kEltBlock), [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) f(k * kEltBlock, std::min(kEltBlock, n - k * kEltBlock));
  });
}

// silu(g)·u and its gradients where the CPU has AVX or AVX-512: one pass, sixteen lanes, T read and
// written in place (vec::exp16), no widened block and no second pass to narrow it.
template <class T>
void swiglu_fwd16(T* out, const T* gate, const T* up, int64_t n) {
  for_blocks(n, [&](int64_t off, int64_t len) {
    const T *g = gate + off, *u = up + off;
    T* o = out + off;
    const vec::F32x16 one = vec::splat16(1.0f);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
      const vec::F32x16 gv = vec::load16(g + i);
      vec::store16(o + i, gv / (one + vec::exp16(-gv)) * vec::load16(u + i));
    }
    for (; i < len; ++i) {  // the lanes' formula, element by element
      const float gi = vec::load(g[i]);
      vec::store(o[i], gi / (1.0f + vec::exp(-gi)) * vec::load(u[i]));
    }
  });
}

template <class T>
void swiglu_bwd16(T* ggate, T* gup, const T* gout, const T* gate, const T* up, int64_t n) {
  for_blocks(n, [&](int64_t off, int64_t len) {
    const T *g = gate + off, *u = up + off, *go = gout + off;
    T *dg = ggate + off, *du = gup + off;
    const vec::F32x16 one = vec::splat16(1.0f);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
      const vec::F32x16 gv = vec::load16(g + i), gov = vec::load16(go + i);
      const vec::F32x16 sig = one / (one + vec::exp16(-gv));
      vec::store16(du + i, gov * gv * sig);
      vec::store16(dg + i, gov * vec::load16(u + i) * sig * (one + gv * (one - sig)));
    }
    for (; i < len; ++i) {
      const float gi = vec::load(g[i]), gi_out = vec::load(go[i]), sig = vec::sigmoid(gi);
      vec::store(du[i], gi_out * gi * sig);
      vec::store(dg[i], gi_out * vec::load(u[i]) * sig * (1.0f + gi * (1.0f - sig)));
    }
  });
}

template <class T>
void swiglu_fwd(T* out, const T* gate, const T* up, int64_t n) {
  using C = compute_t<T>;
  if constexpr (kExpLanesOwn<T>) {
    swiglu_fwd16(out, gate, up, n);
    return;
  }
  for_blocks(n, [&](int64_t off, int64_t len) {
    alignas(64) C gb[kEltBlock], ub[kEltBlock], ob[kEltBlock];
    CArr<C> g(widen_block(gate + off, len, gb), len), u(widen_block(up + off, len, ub), len);
    Arr<C> o(out_block(out + off, ob), len);
    o = g / (C(1) + (-g).exp()) * u;
    store_block(out + off, o.data(), len);
  });
}

// Where the lanes are not taken (f16, or no AVX) the backward's sigmoid by vec::exp in one
// vectorised loop over the block (Eigen's array form took three passes over it and a division per
// element that did not pipeline); f64 keeps the Eigen form.
template <class T>
void swiglu_bwd(T* ggate, T* gup, const T* gout, const T* gate, const T* up, int64_t n) {
  using C = compute_t<T>;
  if constexpr (kExpLanes<T>) {
    swiglu_bwd16(ggate, gup, gout, gate, up, n);
    return;
  }
  for_blocks(n, [&](int64_t off, int64_t len) {
    alignas(64) C gb[kEltBlock], ub[kEltBlock], hb[kEltBlock], sb[kEltBlock], dgb[kEltBlock], dub[kEltBlock];
    const C* __restrict g = widen_block(gate + off, len, gb);
    const C* __restrict u = widen_block(up + off, len, ub);
    const C* __restrict go = widen_block(gout + off, len, hb);
    C* __restrict dg = out_block(ggate + off, dgb);
    C* __restrict du = out_block(gup + off, dub);
    if constexpr (std::is_same_v<C, float>) {
#pragma omp simd simdlen(16)
      for (int64_t i = 0; i < len; ++i) {
        const float sig = 1.0f / (1.0f + vec::exp(-g[i]));
        du[i] = go[i] * g[i] * sig;
        dg[i] = go[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
      }
    } else {
      Arr<C> sig(sb, len);
      sig = C(1) / (C(1) + (-CArr<C>(g, len)).exp());
      Arr<C>(du, len) = CArr<C>(go, len) * CArr<C>(g, len) * sig;
      Arr<C>(dg, len) = CArr<C>(go, len) * CArr<C>(u, len) * sig * (C(1) + CArr<C>(g, len) * (C(1) - sig));
    }
    store_block(ggate + off, dg, len);
    store_block(gup + off, du, len);
  });
}

// ---- rotary embedding ----

// One row: o = rotate(xr) by (c, sgn * sn), d / 2 pairs (x1 = xr[:d/2], x2 = xr[d/2:]).
template <class T>
inline void rope_row(T* __restrict o, const T* __restrict xr, const compute_t<T>* __restrict c,
                     const compute_t<T>* __restrict sn, compute_t<T> sgn, int64_t half) {
  using C = compute_t<T>;
  if constexpr (kLanes16<T>) {  // in place, sixteen pairs at a time (no scratch for bf16)
    using vec::F32x16, vec::load16, vec::store16;
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
      const F32x16 x1 = load16(xr + i), x2 = load16(xr + half + i), cc = load16(c + i), ss = sgn * load16(sn + i);
      store16(o + i, x1 * cc - x2 * ss);
      store16(o + half + i, x2 * cc + x1 * ss);
    }
    for (; i < half; ++i) {
      const float x1 = vec::load(xr[i]), x2 = vec::load(xr[half + i]), cc = c[i], ss = sgn * sn[i];
      vec::store(o[i], x1 * cc - x2 * ss);
      vec::store(o[half + i], x2 * cc + x1 * ss);
    }
    return;
  }
  alignas(64) C x1b[512], x2b[512];
  for (int64_t i0 = 0; i0 < half; i0 += 512) {
    const int64_t len = std::min<int64_t>(512, half - i0);
    const C* x1 = widen_block(xr + i0, len, x1b);
    const C* x2 = widen_block(xr + half + i0, len, x2b);
    if constexpr (std::is_same_v<T, C>) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        const C cc = c[i0 + i], ss = sgn * sn[i0 + i];
        o[i0 + i] = x1[i] * cc - x2[i] * ss;
        o[half + i0 + i] = x2[i] * cc + x1[i] * ss;
      }
    } else {
      alignas(64) C o1[512], o2[512];
      for (int64_t i = 0; i < len; ++i) {
        const C cc = c[i0 + i], ss = sgn * sn[i0 + i];
        o1[i] = x1[i] * cc - x2[i] * ss;
        o2[i] = x2[i] * cc + x1[i] * ss;
      }
      narrow_n(o + i0, o1, len);
      narrow_n(o + half + i0, o2, len);
    }
  }
}

// Rows of out follow the leading index in order (out is contiguous). When x is a transposed
// view (the model's (B, T, H, D) projection read as (B, H, T, D)), the dim whose rows lie next
// to each other in x is not the innermost one, and walking rows in out's order reads x with a
// stride of H·D per row: at sizes past the caches that ran at a third of copy bandwidth. Such a
// layout is walked in tiles instead: kRopeTile rows along the innermost dim by every index of
// x's adjacent dim, so x is read in runs of whole tiles and out written in runs of kRopeTile rows.
constexpr int64_t kRopeTile = 16;

template <class T>
void rope_fwd(T* out, const T* x, const compute_t<T>* cosp, const compute_t<T>* sinp, const RopeLayout& l,
              bool inverse) {
  using C = compute_t<T>;
  int64_t rows = 1;
  for (int k = 0; k < l.ndim; ++k) rows *= l.lead[k];
  const int64_t d = l.d, half = d / 2;
  const C sgn = inverse ? C(-1) : C(1);
  const int q = l.ndim - 1;  // out's innermost leading dim
  int p = q;                 // x's: the smallest stride among dims of more than one index
  for (int k = 0; k < l.ndim; ++k)
    if (l.lead[k] > 1 && (p == q || l.x_strides[k] < l.x_strides[p]) && l.x_strides[k] < l.x_strides[q]) p = k;
  if (q >= 1 && p != q && l.lead[q] > 1) {
    int64_t out_rows[16];  // rows of out per step of each dim
    out_rows[q] = 1;
    for (int k = q - 1; k >= 0; --k) out_rows[k] = out_rows[k + 1] * l.lead[k + 1];
    const int64_t tiles_q = (l.lead[q] + kRopeTile - 1) / kRopeTile;
    const int64_t outer = rows / (l.lead[q] * l.lead[p]);  // combinations of the other dims
    const int64_t per_item = l.lead[p] * kRopeTile * d;    // elements of one work item
    parallel_range(outer * tiles_q, std::max<int64_t>(1, kGrain / per_item), [&](int64_t b, int64_t e) {
      for (int64_t item = b; item < e; ++item) {
        int64_t rem = item / tiles_q, xo = 0, to = 0, oo = 0;
        for (int k = q - 1; k >= 0; --k) {
          if (k == p) continue;
          const int64_t i = rem % l.lead[k];
          rem /= l.lead[k];
          xo += i * l.x_strides[k];
          to += i * l.table_strides[k];
          oo += i * out_rows[k];
        }
        const int64_t t0 = (item % tiles_q) * kRopeTile, t1 = std::min(l.lead[q], t0 + kRopeTile);
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t ip = 0; ip < l.lead[p]; ++ip) {
            const int64_t xr = xo + ip * l.x_strides[p] + t * l.x_strides[q];
            const int64_t tr = to + ip * l.table_strides[p] + t * l.table_strides[q];
            const int64_t orow = oo + ip * out_rows[p] + t;
            rope_row(out + orow * d, x + xr, cosp + tr, sinp + tr, sgn, half);
          }
      }
    });
    return;
  }
  parallel_range(rows, row_grain(d), [&](int64_t b, int64_t e) {
    // Leading index of row b, then stepped like an odometer (no division per row).
    int64_t idx[16] = {};
    int64_t xo = 0, to = 0;
    {
      int64_t rem = b;
      for (int k = l.ndim - 1; k >= 0; --k) {
        idx[k] = rem % l.lead[k];
        rem /= l.lead[k];
        xo += idx[k] * l.x_strides[k];
        to += idx[k] * l.table_strides[k];
      }
    }
    for (int64_t r = b; r < e; ++r) {
      rope_row(out + r * d, x + xo, cosp + to, sinp + to, sgn, half);
      for (int k = l.ndim - 1; k >= 0; --k) {
        xo += l.x_strides[k];
        to += l.table_strides[k];
        if (++idx[k] < l.lead[k]) break;
        xo -= idx[k] * l.x_strides[k];
        to -= idx[k] * l.table_strides[k];
        idx[k] = 0;
      }
    }
  });
}

// ---- embedding ----

template <class T, class I>
void emb_fwd(T* out, const T* weight, const I* index, int64_t n, int64_t dim) {
  parallel_range(n, row_grain(dim), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      std::memcpy(static_cast<void*>(out + i * dim), weight + int64_t(index[i]) * dim, size_t(dim) * sizeof(T));
  });
}

template <class T, class I>
void emb_bwd(T* gw, const T* g, const I* index, int64_t n, int64_t vocab, int64_t dim) {
  using C = compute_t<T>;
  parallel_range(vocab * dim, kGrain * 4, [&](int64_t b, int64_t e) {
    std::memset(static_cast<void*>(gw + b), 0, size_t(e - b) * sizeof(T));
  });
  if (n == 0 || dim == 0) return;
  // Positions grouped by row (stable, so each row sums its contributions in position order);
  // one thread owns each row, so there are no races and no atomics.
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return index[a] < index[b]; });
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || index[order[size_t(i)]] != index[order[size_t(i - 1)]]) starts.push_back(i);
  starts.push_back(n);
  const int64_t segments = int64_t(starts.size()) - 1;
  parallel_range(segments, row_grain(dim), [&](int64_t b, int64_t e) {
    std::vector<C> acc(static_cast<size_t>(dim));
    for (int64_t sgm = b; sgm < e; ++sgm) {
      std::fill(acc.begin(), acc.end(), C(0));
      for (int64_t k = starts[size_t(sgm)]; k < starts[size_t(sgm + 1)]; ++k) {
        const T* src = g + order[size_t(k)] * dim;
        for (int64_t j = 0; j < dim; ++j) acc[size_t(j)] += C(src[j]);
      }
      T* dst = gw + int64_t(index[order[size_t(starts[size_t(sgm)])]]) * dim;
      for (int64_t j = 0; j < dim; ++j) dst[j] = T(acc[size_t(j)]);
    }
  });
}

}  // namespace

void softmax_forward(DType dt, void* out, const void* in, int64_t rows, int64_t cols, bool log) {
  if (rows == 0 || cols == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    softmax_fwd(static_cast<scalar_t*>(out), static_cast<const scalar_t*>(in), rows, cols, log);
  });
}

void softmax_backward(DType dt, void* grad_in, const void* grad_out, const void* out, int64_t rows, int64_t cols,
                      bool log) {
  if (rows == 0 || cols == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    softmax_bwd(static_cast<scalar_t*>(grad_in), static_cast<const scalar_t*>(grad_out),
                static_cast<const scalar_t*>(out), rows, cols, log);
  });
}

void cross_entropy_forward(DType dt, void* loss, const void* logits, DType target_dt, const void* target,
                           int64_t rows, int64_t cols, int64_t ignore_index, void* lse) {
  if (rows == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    with_index_type(target_dt, [&](auto idx) {
      using I = decltype(idx);
      ce_fwd(static_cast<compute_t<scalar_t>*>(loss), static_cast<compute_t<scalar_t>*>(lse),
             static_cast<const scalar_t*>(logits), static_cast<const I*>(target), rows, cols, ignore_index);
    });
  });
}

void cross_entropy_backward(DType dt, void* grad_logits, const void* logits, DType target_dt, const void* target,
                            const void* scale, int64_t rows, int64_t cols, int64_t ignore_index, const void* lse) {
  if (rows == 0 || cols == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    with_index_type(target_dt, [&](auto idx) {
      using I = decltype(idx);
      ce_bwd(static_cast<scalar_t*>(grad_logits), static_cast<const scalar_t*>(logits), static_cast<const I*>(target),
             static_cast<const compute_t<scalar_t>*>(scale), static_cast<const compute_t<scalar_t>*>(lse), rows, cols,
             ignore_index);
    });
  });
}

void rms_norm_forward(DType dt, void* y, void* rstd, const void* x, const void* weight, int64_t rows, int64_t cols,
                      double eps) {
  if (rows == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    rms_fwd(static_cast<T*>(y), static_cast<compute_t<T>*>(rstd), static_cast<const T*>(x), static_cast<const T*>(nullptr),
            static_cast<T*>(nullptr), static_cast<const T*>(weight), rows, cols, eps);
  });
}

void rms_norm_backward(DType dt, void* grad_x, void* grad_weight, const void* g, const void* x, const void* weight,
                       const void* rstd, int64_t rows, int64_t cols) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    rms_bwd(static_cast<T*>(grad_x), static_cast<T*>(grad_weight), static_cast<const T*>(g),
            static_cast<const T*>(nullptr), static_cast<const T*>(x), static_cast<const T*>(weight),
            static_cast<const compute_t<T>*>(rstd), rows, cols);
  });
}

void add_rms_norm_forward(DType dt, void* h, void* y, void* rstd, const void* x, const void* r, const void* weight,
                          int64_t rows, int64_t cols, double eps) {
  if (rows == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    rms_fwd(static_cast<T*>(y), static_cast<compute_t<T>*>(rstd), static_cast<const T*>(x), static_cast<const T*>(r),
            static_cast<T*>(h), static_cast<const T*>(weight), rows, cols, eps);
  });
}

void add_rms_norm_backward(DType dt, void* grad_h, void* grad_weight, const void* g, const void* g_h,
                           const void* h, const void* weight, const void* rstd, int64_t rows, int64_t cols) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    rms_bwd(static_cast<T*>(grad_h), static_cast<T*>(grad_weight), static_cast<const T*>(g),
            static_cast<const T*>(g_h), static_cast<const T*>(h), static_cast<const T*>(weight),
            static_cast<const compute_t<T>*>(rstd), rows, cols);
  });
}

void layer_norm_forward(DType dt, void* y, void* mean, void* rstd, const void* x, const void* weight,
                        const void* bias, int64_t rows, int64_t cols, double eps) {
  if (rows == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    ln_fwd(static_cast<T*>(y), static_cast<compute_t<T>*>(mean), static_cast<compute_t<T>*>(rstd),
           static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias), rows, cols, eps);
  });
}

void layer_norm_backward(DType dt, void* grad_x, void* grad_weight, void* grad_bias, const void* g, const void* x,
                         const void* weight, const void* mean, const void* rstd, int64_t rows, int64_t cols) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    ln_bwd(static_cast<T*>(grad_x), static_cast<T*>(grad_weight), static_cast<T*>(grad_bias),
           static_cast<const T*>(g), static_cast<const T*>(x), static_cast<const T*>(weight),
           static_cast<const compute_t<T>*>(mean), static_cast<const compute_t<T>*>(rstd), rows, cols);
  });
}

void swiglu_forward(DType dt, void* out, const void* gate, const void* up, int64_t n) {
  if (n == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    swiglu_fwd(static_cast<T*>(out), static_cast<const T*>(gate), static_cast<const T*>(up), n);
  });
}

void swiglu_backward(DType dt, void* grad_gate, void* grad_up, const void* g, const void* gate, const void* up,
                     int64_t n) {
  if (n == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    swiglu_bwd(static_cast<T*>(grad_gate), static_cast<T*>(grad_up), static_cast<const T*>(g),
               static_cast<const T*>(gate), static_cast<const T*>(up), n);
  });
}

void rope_forward(DType dt, void* out, const void* x, const void* cos, const void* sin, const RopeLayout& l,
                  bool inverse) {
  if (l.d == 0) return;
  for (int k = 0; k < l.ndim; ++k)
    if (l.lead[k] == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    using C = compute_t<T>;
    rope_fwd(static_cast<T*>(out), static_cast<const T*>(x), static_cast<const C*>(cos), static_cast<const C*>(sin), l,
             inverse);
  });
}

void embedding_forward(DType dt, void* out, const void* weight, DType index_dt, const void* index, int64_t n,
                       int64_t dim) {
  if (n == 0 || dim == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    with_index_type(index_dt, [&](auto idx) {
      using I = decltype(idx);
      emb_fwd(static_cast<scalar_t*>(out), static_cast<const scalar_t*>(weight), static_cast<const I*>(index), n, dim);
    });
  });
}

void embedding_backward(DType dt, void* grad_weight, const void* grad_out, DType index_dt, const void* index,
                        int64_t n, int64_t vocab, int64_t dim) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    with_index_type(index_dt, [&](auto idx) {
      using I = decltype(idx);
      emb_bwd(static_cast<scalar_t*>(grad_weight), static_cast<const scalar_t*>(grad_out),
              static_cast<const I*>(index), n, vocab, dim);
    });
  });
}

}  // namespace quilt::kernels::cpu
