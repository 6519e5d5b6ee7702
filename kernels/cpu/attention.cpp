// CPU attention kernels (see attention.h).
//
// Tiles are kQBlock queries by kKBlock keys (64 x 64: 128 in either was no faster at D = 64,
// and smaller tiles waste less of a causal diagonal), and each tile product is one single-
// threaded Eigen GEMM. Measured one thread at 64x64x64 (AVX-512 Xeon; NT/NN/TN GFLOP/s): Eigen
// 101/114/108, OpenBLAS 91/140/153, oneDNN 111/128/123, BLIS 60/83/79. Eigen is kept: it
// needs no library opened at run time, is one path for f32 and f64, and is safe to call from
// every thread at once; OpenBLAS's NN/TN lead (three of the backward's five products) is the
// next thing to try. Tasks run one per thread in a single OpenMP region with Eigen held to
// that thread, so results do not depend on the thread count.
//
// Forward: one task per (batch, head, query block); the running max m and sum l per row (in
// the compute type) rescale the output accumulator as key tiles arrive; lse = m + log(l).
// Backward: delta = rowsum(dO ∘ O) - dlse first; then per tile P = exp(S - lse) and
// dS = P ∘ (dO Vᵀ - delta), dV += Pᵀ dO, dK += scale · dSᵀ Q, dQ += scale · dS K. With enough
// (batch, kv head) pairs for the threads one task owns a kv head and its query heads, so each
// tile is formed once and nothing is shared; otherwise key blocks (dK, dV) and query blocks (dQ)
// are two passes of finer tasks, each recomputing the tile's P and dS.
#include "kernels/cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/eigen_map.h"
#include "kernels/cpu/vec_math.h"

namespace quilt::kernels::cpu {
namespace {

constexpr int64_t kQBlock = 64;  // queries per tile
constexpr int64_t kKBlock = 64;  // keys per tile
constexpr int64_t kMinThreadWork = int64_t(1) << 20;  // multiply-adds below which a thread is not worth waking

// 64-byte aligned, so that Eigen's reductions over a row start their packets at the same place
// in every run (a std::vector's address, and so the summation order, would vary).
template <class C>
using Buf = std::vector<C, Eigen::aligned_allocator<C>>;

enum class Cover { none, part, full };  // how much of a tile the mask lets through

// A run of n contiguous values in the compute type: the values themselves, or widened into buf.
template <class C, class T>
const C* load(const T* src, int64_t n, Buf<C>& buf) {
  if constexpr (std::is_same_v<T, C>) {
    return src;
  } else {
    buf.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) buf[size_t(i)] = C(src[i]);
    return buf.data();
  }
}

template <class T, class C>
void store(T* dst, const C* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);
}

template <class C>
CMap<C> cmap(const C* p, int64_t rows, int64_t cols) {
  return CMap<C>(p, rows, cols, Eigen::OuterStride<>(cols));
}
template <class C>
MMap<C> mmap(C* p, int64_t rows, int64_t cols) {
  return MMap<C>(p, rows, cols, Eigen::OuterStride<>(cols));
}

// One thread's tiles and accumulators.
template <class C>
struct Scratch {
  Buf<C> q, k, v, o;  // widened tiles (o: the output tile, or dO in the backward)
  Buf<C> s, p;        // scores / probabilities, and dS
  Buf<C> acc, acc2;   // output or dQ accumulator; dK and dV accumulators
  Buf<C> m, l;        // running max and sum per row
};

template <class T>
class Attention {
 public:
  using C = compute_t<T>;
  static constexpr C kNegInf = -std::numeric_limits<C>::infinity();

  explicit Attention(const AttentionArgs& a) : a_(a), group_(a.q_heads / a.kv_heads) {}

  // Runs f(task, scratch) for tasks [0, n) in one parallel region, one task at a time per
  // thread; `work` (multiply-adds in all) limits the threads on small calls.
  template <class F>
  static void for_tasks(int64_t n, int64_t work, F&& f) {
    if (n <= 0) return;
    const int64_t useful = std::max<int64_t>(1, work / kMinThreadWork);
    const int threads = int(std::min({int64_t(omp_in_parallel() ? 1 : omp_get_max_threads()), n, useful}));
#pragma omp parallel num_threads(threads)
    {
      omp_set_num_threads(1);  // Eigen stays on this thread (see the top)
      Scratch<C> sc;
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; ++i) f(i, sc);
    }
  }

  void forward(T* out, C* lse, const T* q, const T* k, const T* v) const {
    const int64_t nqb = blocks(a_.t, kQBlock), bh = a_.batch * a_.q_heads;
    // Later query blocks see more keys under a causal mask: hand them out first.
    for_tasks(bh * nqb, work(), [&](int64_t i, Scratch<C>& sc) {
      const int64_t h = i % bh, q0 = (nqb - 1 - i / bh) * kQBlock;
      forward_block(h / a_.q_heads, h % a_.q_heads, q0, out, lse, q, k, v, sc);
    });
  }

  int64_t pairs() const {
    int64_t n = 0;
    for (int64_t b = 0; b < a_.batch; ++b)
      for (int64_t q0 = 0; q0 < a_.t; q0 += kQBlock)
        for (int64_t k0 = 0; k0 < a_.s; k0 += kKBlock) {
          const int64_t nq = std::min(kQBlock, a_.t - q0), nk = std::min(kKBlock, a_.s - k0);
          if (cover(b, q0, nq, k0, nk) != Cover::none) n += nq * nk;
        }
    return n * a_.q_heads;
  }

  void backward(T* dq, T* dk, T* dv, const T* dout, const C* dlse, const T* q, const T* k, const T* v, const T* out,
                const C* lse) const {
    const int64_t rows = a_.batch * a_.q_heads * a_.t, bkv = a_.batch * a_.kv_heads;
    std::vector<C> delta(static_cast<size_t>(rows));
    for_tasks(blocks(rows, 1024), rows * a_.dv, [&](int64_t i, Scratch<C>&) {
      for (int64_t r = i * 1024; r < std::min(rows, (i + 1) * 1024); ++r) {
        C acc = dlse ? -dlse[r] : C(0);
        for (int64_t j = 0; j < a_.dv; ++j) acc += C(dout[r * a_.dv + j]) * C(out[r * a_.dv + j]);
        delta[size_t(r)] = acc;
      }
    });
    const Grads g{dq, dk, dv, dout, q, k, v, lse, delta.data()};
    const int64_t nkb = blocks(a_.s, kKBlock), nqb = blocks(a_.t, kQBlock);
    if (bkv >= 2 * int64_t(omp_get_max_threads())) {
      for_tasks(bkv, work(), [&](int64_t i, Scratch<C>& sc) {
        Buf<C> dqa(size_t(group_ * a_.t * a_.d), C(0));
        for (int64_t k0 = 0; k0 < a_.s; k0 += kKBlock)
          kv_block(i / a_.kv_heads, i % a_.kv_heads, k0, g, dqa.data(), sc);  // dQ of its query heads in dqa
        store(dq + i * group_ * a_.t * a_.d, dqa.data(), group_ * a_.t * a_.d);
      });
      return;
    }
    // Early key blocks are seen by more queries under a causal mask: hand them out first.
    for_tasks(bkv * nkb, work(), [&](int64_t i, Scratch<C>& sc) {
      const int64_t h = i % bkv;
      kv_block(h / a_.kv_heads, h % a_.kv_heads, (i / bkv) * kKBlock, g, nullptr, sc);
    });
    const int64_t bh = a_.batch * a_.q_heads;
    for_tasks(bh * nqb, work(), [&](int64_t i, Scratch<C>& sc) {
      const int64_t h = i % bh;
      q_block(h / a_.q_heads, h % a_.q_heads, (nqb - 1 - i / bh) * kQBlock, g, sc);
    });
  }

 private:
  struct Grads {
    T *dq, *dk, *dv;
    const T *dout, *q, *k, *v;
    const C *lse, *delta;
  };

  static int64_t blocks(int64_t n, int64_t b) { return (n + b - 1) / b; }
  // Multiply-adds of one pass over every tile (masks aside).
  int64_t work() const { return a_.batch * a_.q_heads * a_.t * a_.s * (a_.d + a_.dv); }
  int64_t q_row(int64_t b, int64_t h) const { return (b * a_.q_heads + h) * a_.t; }  // first row in q, out
  int64_t k_row(int64_t b, int64_t kvh) const { return (b * a_.kv_heads + kvh) * a_.s; }

  // What the mask lets through of queries [q0, q0 + nq) against keys [k0, k0 + nk) of batch b.
  Cover cover(int64_t b, int64_t q0, int64_t nq, int64_t k0, int64_t nk) const {
    bool full = true;
    if (a_.causal && a_.q_pos) {  // nothing seen when every key comes after every query
      const int32_t* qp = a_.q_pos + b * a_.t + q0;
      const int32_t* kp = a_.k_pos + b * a_.s + k0;
      const auto [qlo, qhi] = std::minmax_element(qp, qp + nq);
      const auto [klo, khi] = std::minmax_element(kp, kp + nk);
      if (*klo > *qhi) return Cover::none;
      full = *khi <= *qlo;
    } else if (a_.causal) {
      if (k0 > q0 + nq - 1 + a_.causal_offset) return Cover::none;
      full = k0 + nk - 1 <= q0 + a_.causal_offset;
    }
    if (a_.q_doc) {
      const int32_t* qd = a_.q_doc + b * a_.t + q0;
      const int32_t* kd = a_.k_doc + b * a_.s + k0;
      const auto [qlo, qhi] = std::minmax_element(qd, qd + nq);
      const auto [klo, khi] = std::minmax_element(kd, kd + nk);
      if (*qhi < *klo || *khi < *qlo) return Cover::none;  // no document in common
      full = full && *qlo == *qhi && *klo == *khi && *qlo == *klo;
    }
    return full ? Cover::full : Cover::part;
  }

  // Scores (nq, nk) = scale · Q Kᵀ, with those the mask hides set to -inf.
  MMap<C> scores(Cover cv, int64_t b, int64_t q0, int64_t nq, int64_t k0, int64_t nk, const C* Q, const C* K,
                 Scratch<C>& sc) const {
    sc.s.resize(size_t(nq * nk));
    MMap<C> S = mmap(sc.s.data(), nq, nk);
    S.noalias() = C(a_.scale) * (cmap(Q, nq, a_.d) * cmap(K, nk, a_.d).transpose());
    if (cv == Cover::part) {
      const int32_t* qd = a_.q_doc ? a_.q_doc + b * a_.t + q0 : nullptr;
      const int32_t* kd = a_.k_doc ? a_.k_doc + b * a_.s + k0 : nullptr;
      const bool by_pos = a_.causal && a_.q_pos;
      const int32_t* qp = by_pos ? a_.q_pos + b * a_.t + q0 : nullptr;
      const int32_t* kp = by_pos ? a_.k_pos + b * a_.s + k0 : nullptr;
      for (int64_t i = 0; i < nq; ++i) {
        C* row = sc.s.data() + i * nk;
        int64_t seen = nk;  // keys [seen, nk) are hidden by the causal rule by index
        if (by_pos) {
          for (int64_t j = 0; j < nk; ++j)
            if (kp[j] > qp[i]) row[j] = kNegInf;
        } else if (a_.causal) {
          seen = std::clamp<int64_t>(q0 + i + a_.causal_offset - k0 + 1, 0, nk);
          std::fill(row + seen, row + nk, kNegInf);
        }
        if (qd)
          for (int64_t j = 0; j < seen; ++j)
            if (qd[i] != kd[j]) row[j] = kNegInf;
      }
    }
    return S;
  }

  // exp(x - c) over a row, exactly 0 where x is -inf (Eigen's vectorised exp leaves a denormal).
  // In f32 where the lanes are our own exp (AVX2), in sixteen lanes: its clamp makes exp(-inf) 0
  // with no select.
  static void exp_row(C* p, int64_t n, C c, bool masked) {
    if constexpr (std::is_same_v<C, float> && vec::kFastExp16 && vec::kExp16IsScalar) {
      const vec::F32x16 c16 = vec::splat16(c);
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) vec::store16(p + i, vec::exp16(vec::load16(p + i) - c16));
      for (; i < n; ++i) p[i] = vec::exp(p[i] - c);
      return;
    }
    Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>> row(p, n);
    if (masked) row = (row > kNegInf).select((row - c).exp(), C(0));
    else row = (row - c).exp();
  }

  void forward_block(int64_t b, int64_t h, int64_t q0, T* out, C* lse, const T* q, const T* k, const T* v,
                     Scratch<C>& sc) const {
    const int64_t d = a_.d, dv = a_.dv, nq = std::min(kQBlock, a_.t - q0);
    const int64_t qr = q_row(b, h) + q0, kr = k_row(b, h / group_);
    const C* Q = load(q + qr * d, nq * d, sc.q);
    sc.acc.assign(size_t(nq * dv), C(0));
    sc.m.assign(size_t(nq), kNegInf);
    sc.l.assign(size_t(nq), C(0));
    MMap<C> O = mmap(sc.acc.data(), nq, dv);
    for (int64_t k0 = 0; k0 < a_.s; k0 += kKBlock) {
      const int64_t nk = std::min(kKBlock, a_.s - k0);
      const Cover cv = cover(b, q0, nq, k0, nk);
      if (cv == Cover::none) continue;
      const C* K = load(k + (kr + k0) * d, nk * d, sc.k);
      const C* V = load(v + (kr + k0) * dv, nk * dv, sc.v);
      MMap<C> S = scores(cv, b, q0, nq, k0, nk, Q, K, sc);
      for (int64_t i = 0; i < nq; ++i) {
        auto row = S.row(i).array();
        const C mx = std::max(sc.m[size_t(i)], row.maxCoeff());
        if (mx == kNegInf) {  // nothing seen yet
          row.setZero();
          continue;
        }
        const C alpha = std::exp(sc.m[size_t(i)] - mx);
        exp_row(S.data() + i * nk, nk, mx, cv == Cover::part);
        sc.l[size_t(i)] = sc.l[size_t(i)] * alpha + row.sum();
        sc.m[size_t(i)] = mx;
        if (alpha != C(1)) O.row(i) *= alpha;
      }
      O.noalias() += S * cmap(V, nk, dv);
    }
    for (int64_t i = 0; i < nq; ++i) {
      const C l = sc.l[size_t(i)];
      if (l > C(0)) {
        O.row(i) /= l;
        lse[qr + i] = sc.m[size_t(i)] + std::log(l);
      } else {  // a query that sees no key
        O.row(i).setZero();
        lse[qr + i] = kNegInf;
      }
    }
    store(out + qr * dv, sc.acc.data(), nq * dv);
  }

  // P = exp(S - lse) into sc.s and dS = P ∘ (dO Vᵀ - delta) into sc.p, both (nq, nk); returns dS.
  MMap<C> grad_tile(Cover cv, int64_t b, int64_t q0, int64_t nq, int64_t k0, int64_t nk, const C* Q, const C* dO,
                    const C* K, const C* V, const C* lse, const C* delta, Scratch<C>& sc) const {
    MMap<C> P = scores(cv, b, q0, nq, k0, nk, Q, K, sc);
    for (int64_t i = 0; i < nq; ++i) {
      if (lse[i] == kNegInf) P.row(i).setZero();  // a query that sees no key: no gradient
      else exp_row(P.data() + i * nk, nk, lse[i], cv == Cover::part);
    }
    sc.p.resize(size_t(nq * nk));
    MMap<C> dS = mmap(sc.p.data(), nq, nk);
    dS.noalias() = cmap(dO, nq, a_.dv) * cmap(V, nk, a_.dv).transpose();
    for (int64_t i = 0; i < nq; ++i) dS.row(i).array() = P.row(i).array() * (dS.row(i).array() - delta[i]);
    return dS;
  }

  // dK and dV of keys [k0, k0 + nk) of kv head (b, kvh), summed over the group's query heads and
  // the query blocks that see them. With dqa ((group, T, D) of this kv head) each tile's dQ is
  // added there too.
  void kv_block(int64_t b, int64_t kvh, int64_t k0, const Grads& g, C* dqa, Scratch<C>& sc) const {
    const int64_t d = a_.d, dv = a_.dv, nk = std::min(kKBlock, a_.s - k0), kr = k_row(b, kvh) + k0;
    const C* K = load(g.k + kr * d, nk * d, sc.k);
    const C* V = load(g.v + kr * dv, nk * dv, sc.v);
    sc.acc.assign(size_t(nk * d), C(0));
    sc.acc2.assign(size_t(nk * dv), C(0));
    MMap<C> dK = mmap(sc.acc.data(), nk, d), dV = mmap(sc.acc2.data(), nk, dv);
    for (int64_t hg = 0; hg < group_; ++hg) {
      const int64_t h = kvh * group_ + hg;
      for (int64_t q0 = 0; q0 < a_.t; q0 += kQBlock) {
        const int64_t nq = std::min(kQBlock, a_.t - q0);
        const Cover cv = cover(b, q0, nq, k0, nk);
        if (cv == Cover::none) continue;
        const int64_t qr = q_row(b, h) + q0;
        const C* Q = load(g.q + qr * d, nq * d, sc.q);
        const C* dO = load(g.dout + qr * dv, nq * dv, sc.o);
        const MMap<C> dS = grad_tile(cv, b, q0, nq, k0, nk, Q, dO, K, V, g.lse + qr, g.delta + qr, sc);
        dV.noalias() += mmap(sc.s.data(), nq, nk).transpose() * cmap(dO, nq, dv);
        dK.noalias() += C(a_.scale) * (dS.transpose() * cmap(Q, nq, d));
        if (dqa) mmap(dqa + (hg * a_.t + q0) * d, nq, d).noalias() += C(a_.scale) * (dS * cmap(K, nk, d));
      }
    }
    store(g.dk + kr * d, sc.acc.data(), nk * d);
    store(g.dv + kr * dv, sc.acc2.data(), nk * dv);
  }

  // dQ of queries [q0, q0 + nq) of head (b, h) over the key blocks they see.
  void q_block(int64_t b, int64_t h, int64_t q0, const Grads& g, Scratch<C>& sc) const {
    const int64_t d = a_.d, dv = a_.dv, nq = std::min(kQBlock, a_.t - q0);
    const int64_t qr = q_row(b, h) + q0, kr = k_row(b, h / group_);
    const C* Q = load(g.q + qr * d, nq * d, sc.q);
    const C* dO = load(g.dout + qr * dv, nq * dv, sc.o);
    sc.acc.assign(size_t(nq * d), C(0));
    MMap<C> dQ = mmap(sc.acc.data(), nq, d);
    for (int64_t k0 = 0; k0 < a_.s; k0 += kKBlock) {
      const int64_t nk = std::min(kKBlock, a_.s - k0);
      const Cover cv = cover(b, q0, nq, k0, nk);
      if (cv == Cover::none) continue;
      const C* K = load(g.k + (kr + k0) * d, nk * d, sc.k);
      const C* V = load(g.v + (kr + k0) * dv, nk * dv, sc.v);
      const MMap<C> dS = grad_tile(cv, b, q0, nq, k0, nk, Q, dO, K, V, g.lse + qr, g.delta + qr, sc);
      dQ.noalias() += C(a_.scale) * (dS * cmap(K, nk, d));
    }
    store(g.dq + qr * d, sc.acc.data(), nq * d);
  }

  const AttentionArgs& a_;
  int64_t group_;
};

}  // namespace

void attention_forward(DType dt, const AttentionArgs& a, void* out, void* lse, const void* q, const void* k,
                       const void* v) {
  if (a.batch == 0 || a.q_heads == 0 || a.t == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using C = compute_t<scalar_t>;
    Attention<scalar_t>(a).forward(static_cast<scalar_t*>(out), static_cast<C*>(lse),
                                   static_cast<const scalar_t*>(q), static_cast<const scalar_t*>(k),
                                   static_cast<const scalar_t*>(v));
  });
}

int64_t attention_forward_pairs(const AttentionArgs& a) { return Attention<float>(a).pairs(); }

void attention_backward(DType dt, const AttentionArgs& a, void* dq, void* dk, void* dv, const void* dout,
                        const void* dlse, const void* q, const void* k, const void* v, const void* out,
                        const void* lse) {
  if (a.batch == 0 || a.q_heads == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    using C = compute_t<T>;
    Attention<T>(a).backward(static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv),
                             static_cast<const T*>(dout), static_cast<const C*>(dlse), static_cast<const T*>(q),
                             static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(out),
                             static_cast<const C*>(lse));
  });
}

}  // namespace quilt::kernels::cpu
