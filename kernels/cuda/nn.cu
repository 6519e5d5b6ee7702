// CUDA RMS norm, layer norm (forward and backward each) and embedding (forward, backward) on
// contiguous rows. A warp normalises a row when cols <= 1024, a whole block otherwise; math in
// float (double for f64). Weight/bias gradients are summed deterministically: fixed row blocks
// write per-column partials (nb, cols), a second kernel adds the blocks in order.
// Embedding's backward sorts positions by index (stable radix sort), then one thread per
// (row of the weight, column) sums its positions in order: no atomics, same order as the CPU.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/nn.h"

namespace quilt::kernels::cuda {
namespace {

template <class T>
__device__ __forceinline__ compute_t<T> ld(const T* p, int64_t i) {
  return Num<T>::load(p[i]);
}

// ---- RMS norm ----

// y (rows, cols), rstd (rows), x (rows, cols), w (cols) or null.
template <class T, bool kWarp>
__global__ void rms_norm_forward_kernel(T* __restrict__ y, compute_t<T>* __restrict__ rstd, const T* __restrict__ x,
                                        const T* __restrict__ w, int64_t rows, int64_t cols, compute_t<T> eps) {
  using C = compute_t<T>;
  const RowThread<kWarp> t;
  if (t.row >= rows) return;  // whole warp (warp mode) or whole block (block mode)
  const T* xr = x + t.row * cols;
  T* yr = y + t.row * cols;
  C acc = 0;
  for (int64_t c = t.lane; c < cols; c += t.step) {
    const C v = ld(xr, c);
    acc += v * v;
  }
  const C rs = C(1) / m_sqrt(row_sum<kWarp>(acc) / C(cols) + eps);
  if (t.lane == 0) rstd[t.row] = rs;
  for (int64_t c = t.lane; c < cols; c += t.step) {
    C v = ld(xr, c) * rs;
    if (w) v *= ld(w, c);
    yr[c] = Num<T>::store(v);
  }
}

// gx (rows, cols) = rs * (g * w) - rs^3 * dot(g * w, x) / cols * x per row.
template <class T, bool kWarp>
__global__ void rms_norm_backward_kernel(T* __restrict__ gx, const T* __restrict__ g, const T* __restrict__ x,
                                         const T* __restrict__ w, const compute_t<T>* __restrict__ rstd, int64_t rows,
                                         int64_t cols) {
  using C = compute_t<T>;
  const RowThread<kWarp> t;
  if (t.row >= rows) return;
  const T* gr = g + t.row * cols;
  const T* xr = x + t.row * cols;
  T* out = gx + t.row * cols;
  C acc = 0;
  for (int64_t c = t.lane; c < cols; c += t.step) acc += ld(gr, c) * (w ? ld(w, c) : C(1)) * ld(xr, c);
  const C rs = rstd[t.row];
  const C k = rs * rs * rs * row_sum<kWarp>(acc) / C(cols);
  for (int64_t c = t.lane; c < cols; c += t.step)
    out[c] = Num<T>::store(rs * (ld(gr, c) * (w ? ld(w, c) : C(1))) - k * ld(xr, c));
}

// ---- layer norm ----

// y (rows, cols), mean/rstd (rows), x (rows, cols), w/b (cols) or null. Two passes: the
// variance of centred values does not cancel.
template <class T, bool kWarp>
__global__ void layer_norm_forward_kernel(T* __restrict__ y, compute_t<T>* __restrict__ mean,
                                          compute_t<T>* __restrict__ rstd, const T* __restrict__ x,
                                          const T* __restrict__ w, const T* __restrict__ b, int64_t rows,
                                          int64_t cols, compute_t<T> eps) {
  using C = compute_t<T>;
  const RowThread<kWarp> t;
  if (t.row >= rows) return;
  const T* xr = x + t.row * cols;
  T* yr = y + t.row * cols;
  C acc = 0;
  for (int64_t c = t.lane; c < cols; c += t.step) acc += ld(xr, c);
  const C mu = row_sum<kWarp>(acc) / C(cols);
  C sq = 0;
  for (int64_t c = t.lane; c < cols; c += t.step) {
    const C d = ld(xr, c) - mu;
    sq += d * d;
  }
  const C rs = C(1) / m_sqrt(row_sum<kWarp>(sq) / C(cols) + eps);
  if (t.lane == 0) {
    mean[t.row] = mu;
    rstd[t.row] = rs;
  }
  for (int64_t c = t.lane; c < cols; c += t.step) {
    C v = (ld(xr, c) - mu) * rs;
    if (w) v *= ld(w, c);
    if (b) v += ld(b, c);
    yr[c] = Num<T>::store(v);
  }
}

// gx (rows, cols) = rs * (wg - mean(wg) - xhat * mean(wg * xhat)), wg = g * w, xhat = (x - mu) * rs.
template <class T, bool kWarp>
__global__ void layer_norm_backward_kernel(T* __restrict__ gx, const T* __restrict__ g, const T* __restrict__ x,
                                           const T* __restrict__ w, const compute_t<T>* __restrict__ mean,
                                           const compute_t<T>* __restrict__ rstd, int64_t rows, int64_t cols) {
  using C = compute_t<T>;
  const RowThread<kWarp> t;
  if (t.row >= rows) return;
  const T* gr = g + t.row * cols;
  const T* xr = x + t.row * cols;
  T* out = gx + t.row * cols;
  const C mu = mean[t.row], rs = rstd[t.row];
  C sa = 0, sd = 0;
  for (int64_t c = t.lane; c < cols; c += t.step) {
    const C wg = ld(gr, c) * (w ? ld(w, c) : C(1));
    sa += wg;
    sd += wg * ((ld(xr, c) - mu) * rs);
  }
  const C a = row_sum<kWarp>(sa) / C(cols);
  const C d = row_sum<kWarp>(sd) / C(cols);
  for (int64_t c = t.lane; c < cols; c += t.step) {
    const C wg = ld(gr, c) * (w ? ld(w, c) : C(1));
    const C xhat = (ld(xr, c) - mu) * rs;
    out[c] = Num<T>::store(rs * (wg - a - xhat * d));
  }
}

// ---- weight / bias gradients of both norms ----

// Rows per partial block: nb = ceil(rows / kRowsPerPartial) blocks, at most kMaxPartials; a
// function of `rows` only, so the summation order never depends on the device.
constexpr int64_t kRowsPerPartial = 32;
constexpr int64_t kMaxPartials = 1024;
constexpr int kColThreads = 256;

int64_t partial_blocks(int64_t rows) {
  return std::clamp<int64_t>((rows + kRowsPerPartial - 1) / kRowsPerPartial, 1, kMaxPartials);
}

// pw/pb (nb, cols): block blockIdx.y of rows summed per column. pw += g * xhat, pb += g, with
// xhat = (x - mean) * rstd (layer norm) or x * rstd (rms norm: mean null). pw or pb may be null.
template <class T>
__global__ void norm_param_partials_kernel(compute_t<T>* __restrict__ pw, compute_t<T>* __restrict__ pb,
                                           const T* __restrict__ g, const T* __restrict__ x,
                                           const compute_t<T>* __restrict__ mean,
                                           const compute_t<T>* __restrict__ rstd, int64_t rows, int64_t cols,
                                           int64_t nb) {
  using C = compute_t<T>;
  const int64_t c = int64_t(blockIdx.x) * kColThreads + threadIdx.x;
  if (c >= cols) return;
  const int64_t blk = blockIdx.y;
  const int64_t r0 = rows * blk / nb, r1 = rows * (blk + 1) / nb;
  C aw = 0, ab = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const C gv = ld(g, r * cols + c);
    if (pw) aw += gv * ((ld(x, r * cols + c) - (mean ? mean[r] : C(0))) * rstd[r]);
    ab += gv;
  }
  if (pw) pw[blk * cols + c] = aw;
  if (pb) pb[blk * cols + c] = ab;
}

// out (cols) = sum over k in order of part (nb, cols).
template <class T>
__global__ void sum_partials_kernel(T* __restrict__ out, const compute_t<T>* __restrict__ part, int64_t nb,
                                    int64_t cols) {
  using C = compute_t<T>;
  const int64_t c = int64_t(blockIdx.x) * kColThreads + threadIdx.x;
  if (c >= cols) return;
  C acc = 0;
  for (int64_t k = 0; k < nb; ++k) acc += part[k * cols + c];
  out[c] = Num<T>::store(acc);
}

// Weight (gw) and bias (gb) gradients; either may be null.
template <class T>
void norm_param_grads(T* gw, T* gb, const T* g, const T* x, const compute_t<T>* mean, const compute_t<T>* rstd,
                      int64_t rows, int64_t cols, cudaStream_t s) {
  using C = compute_t<T>;
  if (!gw && !gb) return;
  const unsigned col_blocks = unsigned((cols + kColThreads - 1) / kColThreads);
  if (rows == 0) {  // sums over no rows
    if (gw) QUILT_CHECK_CUDA(cudaMemsetAsync(gw, 0, size_t(cols) * sizeof(T), s));
    if (gb) QUILT_CHECK_CUDA(cudaMemsetAsync(gb, 0, size_t(cols) * sizeof(T), s));
    return;
  }
  const int64_t nb = partial_blocks(rows);
  const size_t one = size_t(nb) * size_t(cols);
  C* part = static_cast<C*>(workspace_alloc(one * sizeof(C) * ((gw ? 1 : 0) + (gb ? 1 : 0)), s));
  C* pw = gw ? part : nullptr;
  C* pb = gb ? part + (gw ? one : 0) : nullptr;
  norm_param_partials_kernel<T><<<dim3(col_blocks, unsigned(nb)), kColThreads, 0, s>>>(pw, pb, g, x, mean, rstd,
                                                                                         rows, cols, nb);
  QUILT_CHECK_LAUNCH();
  if (gw) {
    sum_partials_kernel<T><<<col_blocks, kColThreads, 0, s>>>(gw, pw, nb, cols);
    QUILT_CHECK_LAUNCH();
  }
  if (gb) {
    sum_partials_kernel<T><<<col_blocks, kColThreads, 0, s>>>(gb, pb, nb, cols);
    QUILT_CHECK_LAUNCH();
  }
  workspace_free(part, s);
}

// ---- embedding ----

// out (n, dim) = weight (vocab, dim) rows at index (n); zeros for out-of-range indices, each
// reported to `err` once (by its row's first element).
template <class T, class I>
__global__ void embedding_forward_kernel(T* __restrict__ out, const T* __restrict__ weight, const I* __restrict__ index,
                                         int64_t n, int64_t vocab, int64_t dim, DeviceError* err) {
  const int64_t total = n * dim;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t i = e / dim, j = e - i * dim;
    const int64_t v = int64_t(index[i]);
    const bool in_range = v >= 0 && v < vocab;
    if (!in_range && j == 0) report_device_error(err, DeviceErrorOp::embedding, v, vocab, i);
    out[e] = in_range ? weight[v * dim + j] : Num<T>::store(0.0f);
  }
}

// keys (n) = index as i64, pos (n) = 0, 1, ..., n - 1: the pairs the radix sort orders.
template <class I>
__global__ void embedding_keys_kernel(int64_t* __restrict__ keys, int64_t* __restrict__ pos,
                                      const I* __restrict__ index, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    keys[i] = int64_t(index[i]);
    pos[i] = i;
  }
}

// gw (vocab, dim): for each run of equal keys in the sorted (keys, pos) (n), the run's first
// position sums g (n, dim) rows pos[k] over the run, in order. Blocks stride over positions
// (x) and column chunks (y); threads of a block take consecutive columns.
template <class T>
__global__ void embedding_backward_kernel(T* __restrict__ gw, const T* __restrict__ g,
                                          const int64_t* __restrict__ keys, const int64_t* __restrict__ pos,
                                          int64_t n, int64_t vocab, int64_t dim) {
  using C = compute_t<T>;
  for (int64_t k = blockIdx.x; k < n; k += gridDim.x) {
    const int64_t v = keys[k];
    if ((k > 0 && keys[k - 1] == v) || v < 0 || v >= vocab) continue;  // not a run's start, or skipped
    for (int64_t j = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; j < dim; j += int64_t(gridDim.y) * blockDim.x) {
      C acc = 0;
      for (int64_t q = k; q < n && keys[q] == v; ++q) acc += ld(g, pos[q] * dim + j);
      gw[v * dim + j] = Num<T>::store(acc);
    }
  }
}

template <class F>
void with_index(const char* what, DType index_dt, F&& f) {
  if (index_dt == DType::i32) f(int32_t{});
  else if (index_dt == DType::i64) f(int64_t{});
  else fail_dtype(what, index_dt);
}

}  // namespace

void rms_norm_forward(DType dt, void* y, void* rstd, const void* x, const void* weight, int64_t rows, int64_t cols,
                      double eps, void* stream) {
  check_float("rms_norm", dt);
  if (rows == 0) return;  // cols == 0 runs: rstd = 1 / sqrt(0 / 0 + eps) = NaN, as on the CPU
  const RowLaunch L = row_launch("rms_norm", rows, cols);
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    using C = compute_t<T>;
    QUILT_ROW_LAUNCH(L, as_stream(stream), rms_norm_forward_kernel, static_cast<T*>(y), static_cast<C*>(rstd),
                     static_cast<const T*>(x), static_cast<const T*>(weight), rows, cols, C(eps));
  });
}

void rms_norm_backward(DType dt, void* grad_x, void* grad_weight, const void* g, const void* x, const void* weight,
                       const void* rstd, int64_t rows, int64_t cols, void* stream) {
  check_float("rms_norm_backward", dt);
  if (cols == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    using C = compute_t<T>;
    const cudaStream_t s = as_stream(stream);
    if (rows > 0) {
      const RowLaunch L = row_launch("rms_norm_backward", rows, cols);
      QUILT_ROW_LAUNCH(L, s, rms_norm_backward_kernel, static_cast<T*>(grad_x), static_cast<const T*>(g),
                       static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const C*>(rstd), rows,
                       cols);
    }
    norm_param_grads<T>(static_cast<T*>(grad_weight), nullptr, static_cast<const T*>(g), static_cast<const T*>(x),
                        nullptr, static_cast<const C*>(rstd), rows, cols, s);
  });
}

void layer_norm_forward(DType dt, void* y, void* mean, void* rstd, const void* x, const void* weight,
                        const void* bias, int64_t rows, int64_t cols, double eps, void* stream) {
  check_float("layer_norm", dt);
  if (rows == 0) return;
  const RowLaunch L = row_launch("layer_norm", rows, cols);
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    using C = compute_t<T>;
    QUILT_ROW_LAUNCH(L, as_stream(stream), layer_norm_forward_kernel, static_cast<T*>(y), static_cast<C*>(mean),
                     static_cast<C*>(rstd), static_cast<const T*>(x), static_cast<const T*>(weight),
                     static_cast<const T*>(bias), rows, cols, C(eps));
  });
}

void layer_norm_backward(DType dt, void* grad_x, void* grad_weight, void* grad_bias, const void* g, const void* x,
                         const void* weight, const void* mean, const void* rstd, int64_t rows, int64_t cols,
                         void* stream) {
  check_float("layer_norm_backward", dt);
  if (cols == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    using C = compute_t<T>;
    const cudaStream_t s = as_stream(stream);
    if (rows > 0) {
      const RowLaunch L = row_launch("layer_norm_backward", rows, cols);
      QUILT_ROW_LAUNCH(L, s, layer_norm_backward_kernel, static_cast<T*>(grad_x), static_cast<const T*>(g),
                       static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const C*>(mean),
                       static_cast<const C*>(rstd), rows, cols);
    }
    norm_param_grads<T>(static_cast<T*>(grad_weight), static_cast<T*>(grad_bias), static_cast<const T*>(g),
                        static_cast<const T*>(x), static_cast<const C*>(mean), static_cast<const C*>(rstd), rows,
                        cols, s);
  });
}

void embedding_forward(DType dt, void* out, const void* weight, DType index_dt, const void* index, int64_t n,
                       int64_t vocab, int64_t dim, void* stream) {
  check_float("embedding", dt);
  if (n == 0 || dim == 0) return;
  DeviceError* err = device_error_slot();
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    with_index("embedding", index_dt, [&](auto tag) {
      using I = decltype(tag);
      embedding_forward_kernel<T, I><<<grid_for(n * dim, kBlock), kBlock, 0, as_stream(stream)>>>(
          static_cast<T*>(out), static_cast<const T*>(weight), static_cast<const I*>(index), n, vocab, dim, err);
      QUILT_CHECK_LAUNCH();
    });
  });
}

void embedding_backward(DType dt, void* grad_weight, const void* grad_out, DType index_dt, const void* index,
                        int64_t n, int64_t vocab, int64_t dim, void* stream) {
  check_float("embedding_backward", dt);
  const cudaStream_t s = as_stream(stream);
  const size_t es = dt == DType::f64 ? 8 : dt == DType::f32 ? 4 : 2;
  if (vocab > 0 && dim > 0) QUILT_CHECK_CUDA(cudaMemsetAsync(grad_weight, 0, size_t(vocab) * size_t(dim) * es, s));
  if (n == 0 || dim == 0 || vocab == 0) return;
  // keys_in, pos_in, keys_out, pos_out: (n) i64 each, then the radix sort's own scratch.
  size_t sort_bytes = 0;
  QUILT_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const int64_t*>(nullptr),
                                                   static_cast<int64_t*>(nullptr), static_cast<const int64_t*>(nullptr),
                                                   static_cast<int64_t*>(nullptr), n, 0, 64, s));
  const size_t pairs = size_t(n) * sizeof(int64_t);
  const size_t sort_off = (4 * pairs + 255) / 256 * 256;  // cub wants its scratch aligned
  char* ws = static_cast<char*>(workspace_alloc(sort_off + sort_bytes, s));
  int64_t* keys_in = reinterpret_cast<int64_t*>(ws);
  int64_t* pos_in = reinterpret_cast<int64_t*>(ws + pairs);
  int64_t* keys = reinterpret_cast<int64_t*>(ws + 2 * pairs);
  int64_t* pos = reinterpret_cast<int64_t*>(ws + 3 * pairs);
  with_index("embedding_backward", index_dt, [&](auto tag) {
    using I = decltype(tag);
    embedding_keys_kernel<I><<<grid_for(n, kBlock), kBlock, 0, s>>>(keys_in, pos_in, static_cast<const I*>(index), n);
    QUILT_CHECK_LAUNCH();
  });
  // Radix sort is stable: equal indices keep their positions in order.
  QUILT_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(ws + sort_off, sort_bytes, keys_in, keys, pos_in, pos, n, 0, 64,
                                                   s));
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    constexpr int kThreads = 128;
    const int64_t col_blocks = std::min<int64_t>((dim + kThreads - 1) / kThreads, 65535);
    const int64_t pos_blocks = std::min<int64_t>(n, (int64_t(1) << 31) - 1);
    embedding_backward_kernel<T><<<dim3(unsigned(pos_blocks), unsigned(col_blocks)), kThreads, 0, s>>>(
        static_cast<T*>(grad_weight), static_cast<const T*>(grad_out), keys, pos, n, vocab, dim);
    QUILT_CHECK_LAUNCH();
  });
  workspace_free(ws, s);
}

}  // namespace quilt::kernels::cuda
