// CPU optimizer kernels: AdamW in L1-sized blocks of Eigen array code, SGD as a simd loop;
// both one pass over memory per tensor, split across OpenMP threads.
#include "kernels/cpu/optim.h"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace quilt::kernels::cpu {
namespace {

// Elements below which a step runs on one thread (an update is ~10 flops per element).
constexpr int64_t kOptimGrain = 1 << 16;

// Elements updated per block: the block's param, grad, m and v stay in L1 between the three
// array statements below, so memory is streamed once per step.
constexpr int64_t kBlock = 1024;

// AdamW on one block of at most kBlock elements, AdamWMath's formulas on Eigen arrays of S.
template <class P, class G, class S>
void adamw_block(P* param, const G* grad, S* m, S* v, int64_t n, const AdamWHyper& h) {
  using Arr = Eigen::Array<S, Eigen::Dynamic, 1>;
  alignas(64) S pbuf[kBlock];
  alignas(64) S gbuf[kBlock];
  S* p = nullptr;
  const S* g = nullptr;
  if constexpr (std::is_same_v<P, S>) {
    p = param;
  } else {
    for (int64_t i = 0; i < n; ++i) pbuf[i] = S(static_cast<compute_t<P>>(param[i]));
    p = pbuf;
  }
  if constexpr (std::is_same_v<G, S>) {
    g = grad;
  } else {
    for (int64_t i = 0; i < n; ++i) gbuf[i] = S(static_cast<compute_t<G>>(grad[i]));
    g = gbuf;
  }
  const AdamWMath<S> w = adamw_math(h).as<S>();
  Eigen::Map<Arr> pa(p, n), ma(m, n), va(v, n);
  Eigen::Map<const Arr> ga(g, n);
  ma = w.moment1(ma, ga);
  va = w.moment2(va, ga);
  pa = w.param(pa, ma, va.sqrt());
  if constexpr (!std::is_same_v<P, S>)
    for (int64_t i = 0; i < n; ++i) param[i] = P(pbuf[i]);
}

template <class P, class G, class S>
void adamw_typed(P* param, const G* grad, S* m, S* v, int64_t n, const AdamWHyper& h) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  parallel_range(blocks, kOptimGrain / kBlock, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const int64_t off = k * kBlock, len = std::min(kBlock, n - off);
      adamw_block<P, G, S>(param + off, grad + off, m + off, v + off, len, h);
    }
  });
}

// adamw_block on block `k` of one tensor of the list (a pointer per dtype combination).
template <class P, class G, class S>
void adamw_block_of(const AdamWTensor& t, int64_t k) {
  const int64_t off = k * kBlock, len = std::min(kBlock, t.n - off);
  adamw_block<P, G, S>(static_cast<P*>(t.param) + off, static_cast<const G*>(t.grad) + off,
                       static_cast<S*>(t.m) + off, static_cast<S*>(t.v) + off, len, t.hyper);
}
using BlockFn = void (*)(const AdamWTensor&, int64_t);

template <class P, class G, class S>
void sgd_typed(P* __restrict param, const G* __restrict grad, S* __restrict buf, int64_t n, const SgdHyper& h) {
  const SgdMath<S> step = sgd_math(h).as<S>();
  parallel_range(n, kOptimGrain, [&](int64_t b, int64_t e) {
#pragma omp simd
    for (int64_t i = b; i < e; ++i)
      param[i] = P(step(S(static_cast<compute_t<P>>(param[i])), S(static_cast<compute_t<G>>(grad[i])), buf, i));
  });
}

}  // namespace

void adamw(DType param_dt, DType grad_dt, DType state_dt, void* param, const void* grad, void* m, void* v,
           int64_t n, const AdamWHyper& h) {
  dispatch_optim_types(param_dt, grad_dt, state_dt, [&](auto p, auto g, auto s) {
    using P = decltype(p);
    using G = decltype(g);
    using S = decltype(s);
    adamw_typed<P, G, S>(static_cast<P*>(param), static_cast<const G*>(grad), static_cast<S*>(m),
                         static_cast<S*>(v), n, h);
  });
}

void adamw_multi(std::span<const AdamWTensor> tensors) {
  // first[i]: index of tensor i's first block in the concatenated list of blocks.
  std::vector<int64_t> first(tensors.size() + 1, 0);
  std::vector<BlockFn> fns(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensor& t = tensors[i];
    first[i + 1] = first[i] + (t.n + kBlock - 1) / kBlock;
    dispatch_optim_types(t.param_dt, t.grad_dt, t.state_dt, [&](auto p, auto g, auto s) {
      fns[i] = &adamw_block_of<decltype(p), decltype(g), decltype(s)>;
    });
  }
  parallel_range(first.back(), kOptimGrain / kBlock, [&](int64_t b, int64_t e) {
    size_t i = size_t(std::upper_bound(first.begin(), first.end(), b) - first.begin()) - 1;
    for (int64_t k = b; k < e; ++k) {
      while (k >= first[i + 1]) ++i;
      fns[i](tensors[i], k - first[i]);
    }
  });
}

void sgd(DType param_dt, DType grad_dt, DType state_dt, void* param, const void* grad, void* buf, int64_t n,
         const SgdHyper& h) {
  dispatch_optim_types(param_dt, grad_dt, state_dt, [&](auto p, auto g, auto s) {
    using P = decltype(p);
    using G = decltype(g);
    using S = decltype(s);
    sgd_typed<P, G, S>(static_cast<P*>(param), static_cast<const G*>(grad), static_cast<S*>(buf), n, h);
  });
}

}  // namespace quilt::kernels::cpu
