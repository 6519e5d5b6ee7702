// CUDA row softmax / log-softmax (forward, backward) and cross entropy (forward, backward) over
// contiguous (rows, cols) blocks. One pass computes the row's max and sum of exponentials
// together (online rescaling), a second pass writes. A warp takes a row when cols <= 1024,
// a whole block otherwise. Math is in float (double for f64).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace quilt::kernels::cuda {
namespace {

// Running (max, sum of exp(x - max)) of a set of values.
template <class C>
struct MaxSum {
  C m, s;
};

template <class C>
__device__ __forceinline__ MaxSum<C> ms_combine(MaxSum<C> a, MaxSum<C> b) {
  const C m = a.m > b.m ? a.m : b.m;
  if (m == C(-INFINITY)) return {m, a.s + b.s};
  return {m, a.s * m_exp(a.m - m) + b.s * m_exp(b.m - m)};
}

template <class C>
__device__ __forceinline__ void ms_add(MaxSum<C>& a, C x) {
  if (x > a.m) {
    a.s = a.s * m_exp(a.m - x) + C(1);
    a.m = x;
  } else {
    a.s += x == C(-INFINITY) ? C(0) : m_exp(x - a.m);  // a NaN x makes the sum NaN
  }
}

// Max-sum across the threads of a row, reduced as row_sum (common.cuh) does.
template <bool kWarp, class C>
__device__ __forceinline__ MaxSum<C> row_max_sum(MaxSum<C> v) {
  for (int o = 16; o > 0; o >>= 1) {
    const MaxSum<C> other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = ms_combine(v, other);
  }
  if constexpr (kWarp) {
    return v;
  } else {
    __shared__ C shm[32], shs[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) { shm[warp] = v.m; shs[warp] = v.s; }
    __syncthreads();
    MaxSum<C> r{shm[0], shs[0]};
    for (int w = 1; w < nw; ++w) r = ms_combine(r, MaxSum<C>{shm[w], shs[w]});
    return r;
  }
}

template <bool kWarp, class T, class C = compute_t<T>>
__device__ __forceinline__ MaxSum<C> row_stats(const T* x, int64_t cols, const RowThread<kWarp>& t) {
  MaxSum<C> a{C(-INFINITY), C(0)};
  for (int64_t c = t.lane; c < cols; c += t.step) ms_add(a, Num<T>::load(x[c]));
  return row_max_sum<kWarp>(a);
}

template <class T, bool kWarp>
__global__ void softmax_forward_kernel(T* __restrict__ out, const T* __restrict__ in, int64_t rows, int64_t cols,
                                       bool log) {
  using C = compute_t<T>;
  const RowThread<kWarp> t;
  if (t.row >= rows) return;  // whole warp (warp mode) or whole block (block mode)
  const T* x = in + t.row * cols;
  T* y = out + t.row * cols;
  const MaxSum<C> ms = row_stats<kWarp, T>(x, cols, t);
  if (log) {
    const C lse = ms.m + m_log(ms.s);
    for (int64_t c = t.lane; c < cols; c += t.step) y[c] = Num<T>::store(Num<T>::load(x[c]) - lse);
  } else {
    for (int64_t c = t.lane; c < cols; c += t.step) y[c] = Num<T>::store(m_exp(Num<T>::load(x[c]) - ms.m) / ms.s);
  }
}

template <class T, bool kWarp>
__global__ void softmax_backward_kernel(T* __restrict__ gin, const T* __restrict__ gout, const T* __restrict__ out,
                                        int64_t rows, int64_t cols, bool log) {
  using C = compute_t<T>;
  const RowThread<kWarp> t;
  if (t.row >= rows) return;
  const T* g = gout + t.row * cols;
  const T* y = out + t.row * cols;
  T* gi = gin + t.row * cols;
  C acc = 0;
  if (log) {
    for (int64_t c = t.lane; c < cols; c += t.step) acc += Num<T>::load(g[c]);
  } else {
    for (int64_t c = t.lane; c < cols; c += t.step) acc += Num<T>::load(g[c]) * Num<T>::load(y[c]);
  }
  const C total = row_sum<kWarp>(acc);
  if (log) {
    for (int64_t c = t.lane; c < cols; c += t.step)
      gi[c] = Num<T>::store(Num<T>::load(g[c]) - m_exp(Num<T>::load(y[c])) * total);
  } else {
    for (int64_t c = t.lane; c < cols; c += t.step)
      gi[c] = Num<T>::store(Num<T>::load(y[c]) * (Num<T>::load(g[c]) - total));
  }
}

template <class T, bool kWarp>
__global__ void cross_entropy_forward_kernel(float* __restrict__ loss, const T* __restrict__ logits,
                                             const int64_t* __restrict__ target, int64_t rows, int64_t cols,
                                             int64_t ignore_index, DeviceError* err) {
  using C = compute_t<T>;
  const RowThread<kWarp> t;
  if (t.row >= rows) return;
  const int64_t tgt = target[t.row];
  if (tgt == ignore_index) {  // uniform across the row's threads: no reduction is skipped by half of them
    if (t.lane == 0) loss[t.row] = 0.0f;
    return;
  }
  const T* x = logits + t.row * cols;
  const MaxSum<C> ms = row_stats<kWarp, T>(x, cols, t);
  if (t.lane != 0) return;
  if (tgt < 0 || tgt >= cols) {  // out-of-range class: NaN here, and the host is told
    loss[t.row] = NAN;
    report_device_error(err, DeviceErrorOp::cross_entropy, tgt, cols, t.row);
    return;
  }
  loss[t.row] = static_cast<float>(ms.m + m_log(ms.s) - Num<T>::load(x[tgt]));
}

template <class T, bool kWarp>
__global__ void cross_entropy_backward_kernel(T* __restrict__ grad, const T* __restrict__ logits,
                                              const int64_t* __restrict__ target, const float* __restrict__ scale,
                                              int64_t rows, int64_t cols, int64_t ignore_index) {
  using C = compute_t<T>;
  const RowThread<kWarp> t;
  if (t.row >= rows) return;
  const int64_t tgt = target[t.row];
  T* gr = grad + t.row * cols;
  if (tgt == ignore_index) {
    for (int64_t c = t.lane; c < cols; c += t.step) gr[c] = Num<T>::store(C(0));
    return;
  }
  const T* x = logits + t.row * cols;
  const MaxSum<C> ms = row_stats<kWarp, T>(x, cols, t);
  const C lse = ms.m + m_log(ms.s);
  const C k = static_cast<C>(scale[t.row]);
  const bool bad = tgt < 0 || tgt >= cols;
  for (int64_t c = t.lane; c < cols; c += t.step) {
    const C p = m_exp(Num<T>::load(x[c]) - lse) - (c == tgt ? C(1) : C(0));
    gr[c] = Num<T>::store(bad ? C(NAN) : k * p);
  }
}

}  // namespace

void softmax_forward(DType dt, void* out, const void* in, int64_t rows, int64_t cols, bool log, void* stream) {
  check_float(log ? "log_softmax" : "softmax", dt);
  if (rows == 0 || cols == 0) return;
  const RowLaunch L = row_launch("softmax", rows, cols);
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    QUILT_ROW_LAUNCH(L, as_stream(stream), softmax_forward_kernel, static_cast<T*>(out), static_cast<const T*>(in),
                     rows, cols, log);
  });
}

void softmax_backward(DType dt, void* grad_in, const void* grad_out, const void* out, int64_t rows, int64_t cols,
                      bool log, void* stream) {
  check_float("softmax_backward", dt);
  if (rows == 0 || cols == 0) return;
  const RowLaunch L = row_launch("softmax_backward", rows, cols);
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    QUILT_ROW_LAUNCH(L, as_stream(stream), softmax_backward_kernel, static_cast<T*>(grad_in),
                     static_cast<const T*>(grad_out), static_cast<const T*>(out), rows, cols, log);
  });
}

void cross_entropy_forward(DType dt, float* loss, const void* logits, const int64_t* target, int64_t rows,
                           int64_t cols, int64_t ignore_index, void* stream) {
  check_float("cross_entropy", dt);
  if (rows == 0) return;
  if (cols == 0) fail_msg("cross_entropy", "needs at least one class");
  const RowLaunch L = row_launch("cross_entropy", rows, cols);
  DeviceError* err = device_error_slot();
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    QUILT_ROW_LAUNCH(L, as_stream(stream), cross_entropy_forward_kernel, loss, static_cast<const T*>(logits), target,
                     rows, cols, ignore_index, err);
  });
}

void cross_entropy_backward(DType dt, void* grad_logits, const void* logits, const int64_t* target,
                            const float* scale, int64_t rows, int64_t cols, int64_t ignore_index, void* stream) {
  check_float("cross_entropy_backward", dt);
  if (rows == 0 || cols == 0) return;
  const RowLaunch L = row_launch("cross_entropy_backward", rows, cols);
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    QUILT_ROW_LAUNCH(L, as_stream(stream), cross_entropy_backward_kernel, static_cast<T*>(grad_logits),
                     static_cast<const T*>(logits), target, scale, rows, cols, ignore_index);
  });
}

}  // namespace quilt::kernels::cuda
