// Internal to kernels/cpu: OpenMP chunking and the strided-loop walker.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "kernels/loop.h"

namespace quilt::kernels::cpu {

inline constexpr int64_t kGrain = 32768;  // elements below which a loop runs on one thread

/// Calls f(begin, end) over [0, n) split among OpenMP threads when n is large.
template <class F>
void parallel_range(int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads <= 1 || n <= grain) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t chunks = std::min<int64_t>(threads, (n + grain - 1) / grain);
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = n * c / chunks, e = n * (c + 1) / chunks;
    if (b < e) f(b, e);
  }
}

/// Walks elements [begin, end) of a loop in row-major order, calling
/// inner(ptrs, n, inner_strides) for each run along the last dim; ptrs are char* per operand.
template <int N, class F>
void walk(const Loop<N>& l, const size_t (&elsize)[N], int64_t begin, int64_t end, F&& inner) {
  if (l.ndim == 0) {
    char* p[N];
    int64_t s[N];
    for (int k = 0; k < N; ++k) { p[k] = static_cast<char*>(l.data[k]); s[k] = 0; }
    if (begin < end) inner(p, int64_t{1}, s);
    return;
  }
  const int last = l.ndim - 1;
  int64_t idx[kMaxDims];
  int64_t rem = begin;
  for (int d = last; d >= 0; --d) { idx[d] = rem % l.shape[d]; rem /= l.shape[d]; }
  int64_t off[N];
  int64_t istr[N];
  for (int k = 0; k < N; ++k) {
    off[k] = 0;
    for (int d = 0; d <= last; ++d) off[k] += idx[d] * l.strides[k][d];
    istr[k] = l.strides[k][last];
  }
  int64_t pos = begin;
  while (pos < end) {
    const int64_t n = std::min(l.shape[last] - idx[last], end - pos);
    char* p[N];
    for (int k = 0; k < N; ++k) p[k] = static_cast<char*>(l.data[k]) + off[k] * int64_t(elsize[k]);
    inner(p, n, istr);
    pos += n;
    idx[last] += n;
    for (int k = 0; k < N; ++k) off[k] += n * l.strides[k][last];
    for (int d = last; d > 0 && idx[d] == l.shape[d]; --d) {
      idx[d] = 0;
      ++idx[d - 1];
      for (int k = 0; k < N; ++k) off[k] += l.strides[k][d - 1] - l.shape[d] * l.strides[k][d];
    }
  }
}

/// Parallel walk over the whole loop.
template <int N, class F>
void parallel_walk(const Loop<N>& l, const size_t (&elsize)[N], F&& inner) {
  parallel_range(l.numel(), kGrain, [&](int64_t b, int64_t e) { walk(l, elsize, b, e, inner); });
}

}  // namespace quilt::kernels::cpu
