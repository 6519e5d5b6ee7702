// CUDA reductions (sum, max, min, argmax, sum of squares) over arbitrary strided dims, with
// the CPU's semantics (kernels/cpu/reduce.cpp): accumulation in float (f32/bf16/f16), double
// (f64) or i64 (integers, bool); max/min propagate NaN; argmax gives the first maximum and a
// NaN counts as the maximum.
//
// One kernel, two layouts:
//  - row: the innermost reduced dim is contiguous; threads along x walk the reduced elements
//    of one output, threads along y take different outputs;
//  - column: threads along x take neighbouring outputs (coalesced when the kept dims are
//    contiguous), threads along y split the reduced elements.
// When there are too few outputs to fill the GPU, the reduced range is also split across
// blockIdx.y into partials in a stream-ordered workspace, and the same kernel reduces the
// partials in a second pass. Results are deterministic: the combine order is fixed by the shape.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

#include <cfloat>
#include <climits>

namespace quilt::kernels::cuda {
namespace {

constexpr int kRedThreads = 256;

struct RedGeom {
  int out_ndim = 0;
  int64_t out_shape[kMaxDims] = {};
  int64_t out_strides[kMaxDims] = {};
  int64_t in_out_strides[kMaxDims] = {};
  int red_ndim = 0;
  int64_t red_shape[kMaxDims] = {};
  int64_t red_strides[kMaxDims] = {};
  int64_t nout = 0, nred = 0;
  int64_t chunk = 0;   // reduced elements per blockIdx.y slice
  bool row = false;    // layout (see the file comment)
  bool partial = false;  // write partials to ws[y * nout + o] instead of the output
};

// Accumulator: value, plus the element index for argmax.
template <class A>
struct Acc {
  A v;
  int64_t i;
};

template <class A>
__device__ __forceinline__ bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) return v != v;
  else return false;
}

// What an accumulator starts from; for max and argmax its index (LLONG_MAX) never wins a tie.
template <ReduceOp op, class A>
__device__ __forceinline__ Acc<A> identity() {
  return {reduce_identity<op, A>(), op == ReduceOp::max || op == ReduceOp::argmax ? LLONG_MAX : 0};
}

template <ReduceOp op, class A>
__device__ __forceinline__ Acc<A> combine(const Acc<A>& a, const Acc<A>& b) {
  if constexpr (op == ReduceOp::sum || op == ReduceOp::sum_squares) {
    return {a.v + b.v, 0};
  } else if constexpr (op == ReduceOp::max) {
    return {max_nan(b.v, a.v), 0};
  } else if constexpr (op == ReduceOp::min) {
    return {min_nan(b.v, a.v), 0};
  } else {  // argmax: larger value wins, NaN beats everything, ties go to the smaller index
    const bool an = is_nan(a.v), bn = is_nan(b.v);
    if (an || bn) {
      if (an && bn) return a.i <= b.i ? a : b;
      return an ? a : b;
    }
    if (a.v > b.v) return a;
    if (b.v > a.v) return b;
    return a.i <= b.i ? a : b;
  }
}

__device__ __forceinline__ int64_t offset_of(int64_t i, int nd, const int64_t* shape, const int64_t* strides) {
  int64_t off = 0;
  for (int d = nd - 1; d >= 0; --d) {
    const int64_t q = i / shape[d];
    off += (i - q * shape[d]) * strides[d];
    i = q;
  }
  return off;
}

// kSecond: `in` holds partials of type reduce_acc_t (and in_idx their argmax indices).
template <ReduceOp op, class T, class O, bool kSecond>
__global__ void __launch_bounds__(kRedThreads)
    reduce_kernel(const __grid_constant__ RedGeom g, const T* __restrict__ in, const int64_t* __restrict__ in_idx,
                  O* __restrict__ out, reduce_acc_t<T>* __restrict__ ws, int64_t* __restrict__ ws_idx) {
  using A = std::conditional_t<kSecond, T, reduce_acc_t<T>>;
  __shared__ A sv[kRedThreads];
  __shared__ int64_t si[op == ReduceOp::argmax ? kRedThreads : 1];
  const int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
  const int64_t o = g.row ? int64_t(blockIdx.x) * by + ty : int64_t(blockIdx.x) * bx + tx;
  const int64_t lo = int64_t(blockIdx.y) * g.chunk;
  const int64_t hi = lo + g.chunk < g.nred ? lo + g.chunk : g.nred;

  Acc<A> acc = identity<op, A>();
  if (o < g.nout) {
    const int64_t base_off = offset_of(o, g.out_ndim, g.out_shape, g.in_out_strides);
    const T* base = in + base_off;
    const int64_t first = lo + (g.row ? tx : ty), step = g.row ? bx : by;
    const bool one = g.red_ndim == 1;
#pragma unroll 4
    for (int64_t r = first; r < hi; r += step) {
      const int64_t off = one ? r * g.red_strides[0] : offset_of(r, g.red_ndim, g.red_shape, g.red_strides);
      A v = static_cast<A>(Num<T>::load(base[off]));
      if constexpr (op == ReduceOp::sum_squares && !kSecond) v = v * v;
      int64_t idx = 0;
      if constexpr (op == ReduceOp::argmax) idx = kSecond ? in_idx[base_off + off] : r;
      acc = combine<op, A>(acc, Acc<A>{v, idx});
    }
  }

  // Combine across the block's reduced axis with a fixed tree.
  const int me = ty * bx + tx;
  sv[me] = acc.v;
  if constexpr (op == ReduceOp::argmax) si[me] = acc.i;
  const int span = g.row ? bx : by;
  const int pos = g.row ? tx : ty;
  const int unit = g.row ? 1 : bx;
  for (int s = span / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (pos < s) {
      Acc<A> a{sv[me], 0}, b{sv[me + s * unit], 0};
      if constexpr (op == ReduceOp::argmax) { a.i = si[me]; b.i = si[me + s * unit]; }
      const Acc<A> c = combine<op, A>(a, b);
      sv[me] = c.v;
      if constexpr (op == ReduceOp::argmax) si[me] = c.i;
    }
  }
  if (pos != 0 || o >= g.nout) return;
  Acc<A> res{sv[me], 0};
  if constexpr (op == ReduceOp::argmax) res.i = si[me];
  if (g.partial) {
    const int64_t w = int64_t(blockIdx.y) * g.nout + o;
    ws[w] = res.v;
    if constexpr (op == ReduceOp::argmax) ws_idx[w] = res.i;
    return;
  }
  O* dst = out + offset_of(o, g.out_ndim, g.out_shape, g.out_strides);
  if constexpr (op == ReduceOp::argmax) *dst = res.i;
  else *dst = Num<O>::store(res.v);
}

int64_t pow2_at_least(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Picks the layout and block shape; returns the block and the grid's x extent.
dim3 shape_block(RedGeom& g, unsigned& gx) {
  int bx, by;
  if (g.row) {
    bx = int(std::min<int64_t>(kRedThreads, std::max<int64_t>(32, pow2_at_least((g.nred + 3) / 4))));
    by = kRedThreads / bx;
    gx = unsigned((g.nout + by - 1) / by);
  } else {
    by = int(std::min<int64_t>(8, pow2_at_least(std::max<int64_t>(1, g.nred))));
    bx = kRedThreads / by;
    gx = unsigned((g.nout + bx - 1) / bx);
  }
  return dim3(unsigned(bx), unsigned(by));
}

template <ReduceOp op, class T, class O>
void reduce_typed(const ReduceLoop& l, cudaStream_t s) {
  using A = reduce_acc_t<T>;
  RedGeom g;
  g.out_ndim = l.out_ndim;
  g.red_ndim = l.red_ndim;
  g.nout = g.nred = 1;
  for (int d = 0; d < l.out_ndim; ++d) {
    g.out_shape[d] = l.out_shape[d];
    g.out_strides[d] = l.out_strides[d];
    g.in_out_strides[d] = l.in_out_strides[d];
    g.nout *= l.out_shape[d];
  }
  for (int d = 0; d < l.red_ndim; ++d) {
    g.red_shape[d] = l.red_shape[d];
    g.red_strides[d] = l.red_strides[d];
    g.nred *= l.red_shape[d];
  }
  if (g.nout == 0) return;
  g.row = g.nout == 1 || (l.red_ndim > 0 && l.red_strides[l.red_ndim - 1] == 1);
  unsigned gx = 0;
  const dim3 block = shape_block(g, gx);
  // Split the reduced range when the outputs alone give too few blocks.
  const int64_t threads_on_red = g.row ? block.x : block.y;
  const int64_t target = 4 * int64_t(sm_count());
  int64_t split = 1;
  if (int64_t(gx) < target) {
    split = std::min<int64_t>((target + gx - 1) / gx, std::max<int64_t>(1, g.nred / (threads_on_red * 8)));
    split = std::clamp<int64_t>(split, 1, 65535);
  }
  g.chunk = std::max<int64_t>(1, (g.nred + split - 1) / split);
  split = std::max<int64_t>(1, (g.nred + g.chunk - 1) / g.chunk);
  const T* in = static_cast<const T*>(l.in);
  O* out = static_cast<O*>(l.out);
  if (split == 1) {
    reduce_kernel<op, T, O, false><<<dim3(gx, 1), block, 0, s>>>(g, in, nullptr, out, nullptr, nullptr);
    QUILT_CHECK_LAUNCH();
    return;
  }
  // Pass 1: partials (split, nout) into a stream-ordered workspace.
  const size_t nparts = size_t(split) * size_t(g.nout);
  const size_t idx_bytes = op == ReduceOp::argmax ? nparts * sizeof(int64_t) : 0;
  void* ws = workspace_alloc(nparts * sizeof(A) + idx_bytes + 16, s);
  A* wv = static_cast<A*>(ws);
  int64_t* wi = op == ReduceOp::argmax
                    ? reinterpret_cast<int64_t*>(static_cast<char*>(ws) + (nparts * sizeof(A) + 15) / 16 * 16)
                    : nullptr;
  g.partial = true;
  reduce_kernel<op, T, O, false><<<dim3(gx, unsigned(split)), block, 0, s>>>(g, in, nullptr, out, wv, wi);
  QUILT_CHECK_LAUNCH();
  // Pass 2: reduce the partials; kept dims index them contiguously, the split is the reduced dim.
  RedGeom g2;
  g2.out_ndim = g.out_ndim;
  int64_t stride = 1;
  for (int d = g.out_ndim - 1; d >= 0; --d) {
    g2.out_shape[d] = g.out_shape[d];
    g2.out_strides[d] = g.out_strides[d];
    g2.in_out_strides[d] = stride;
    stride *= g.out_shape[d];
  }
  g2.red_ndim = 1;
  g2.red_shape[0] = split;
  g2.red_strides[0] = g.nout;
  g2.nout = g.nout;
  g2.nred = split;
  g2.row = g.nout == 1;
  g2.chunk = split;
  unsigned gx2 = 0;
  const dim3 block2 = shape_block(g2, gx2);
  constexpr ReduceOp op2 = op == ReduceOp::sum_squares ? ReduceOp::sum : op;  // partials are already squared
  reduce_kernel<op2, A, O, true><<<dim3(gx2, 1), block2, 0, s>>>(g2, wv, wi, out, nullptr, nullptr);
  QUILT_CHECK_LAUNCH();
  workspace_free(ws, s);
}

const char* reduce_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
    case ReduceOp::argmax: return "argmax";
    case ReduceOp::sum_squares: return "sum_squares";
  }
  return "reduce";
}

template <class T, class O>
void reduce_op(ReduceOp op, const ReduceLoop& l, cudaStream_t s) {
  switch (op) {
    case ReduceOp::sum: return reduce_typed<ReduceOp::sum, T, O>(l, s);
    case ReduceOp::sum_squares: return reduce_typed<ReduceOp::sum_squares, T, O>(l, s);
    case ReduceOp::max: return reduce_typed<ReduceOp::max, T, O>(l, s);
    case ReduceOp::min: return reduce_typed<ReduceOp::min, T, O>(l, s);
    case ReduceOp::argmax: return;
  }
}

}  // namespace

void reduce(ReduceOp op, DType in_dt, DType out_dt, const ReduceLoop& loop, void* stream) {
  const cudaStream_t s = as_stream(stream);
  if (op == ReduceOp::argmax) {
    if (out_dt != DType::i64) fail_msg("argmax", "writes i64 indices on CUDA");
    QUILT_DISPATCH_ALL(in_dt, [&] { reduce_typed<ReduceOp::argmax, scalar_t, int64_t>(loop, s); });
    return;
  }
  // Output dtypes the engine asks for: the input's own, or i64 for integer and bool inputs.
  if (out_dt == in_dt) {
    QUILT_DISPATCH_ALL(in_dt, [&] { reduce_op<scalar_t, scalar_t>(op, loop, s); });
  } else if (out_dt == DType::i64 && (in_dt == DType::i32 || in_dt == DType::b8)) {
    if (in_dt == DType::i32) reduce_op<int32_t, int64_t>(op, loop, s);
    else reduce_op<bool, int64_t>(op, loop, s);
  } else {
    fail_dtype(reduce_name(op), out_dt);
  }
}

}  // namespace quilt::kernels::cuda
