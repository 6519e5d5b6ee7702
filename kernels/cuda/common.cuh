// Internal to kernels/cuda: storage <-> compute conversions, one elementwise engine (a flat
// vectorised kernel and a strided one) shared by unary, binary, where, copy and fill, and the
// row-per-warp / row-per-block helpers of softmax and the norms. The math itself is
// kernels/elementwise_math.h's. Each .cu instantiates only the (op, dtype) pairs it
// dispatches to.
//
//   Elementwise<float, float, float>::launch(loop, AddFn{}, stream);   // out = f(a, b)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/dtype.h"
#include "kernels/elementwise_math.h"
#include "kernels/loop.h"

namespace quilt::kernels::cuda {

inline constexpr int kBlock = 256;  // threads per block of the elementwise kernels

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

/// Reports bad input found by a kernel (kernels.h's DeviceError): the first report since the
/// host last took the slot wins; later ones are dropped. `e` null: the caller asked for none.
__device__ __forceinline__ void report_device_error(DeviceError* e, DeviceErrorOp op, int64_t value, int64_t bound,
                                                    int64_t position) {
  if (!e) return;
  if (atomicCAS(&e->op, 0, static_cast<int32_t>(op)) == 0) {
    e->value = value;
    e->bound = bound;
    e->position = position;
  }
}
/// Multiprocessors of the current device (cached per device).
int sm_count();
/// Throws "[what] has no CUDA kernel for <dtype>" (the engine's checks normally come first).
[[noreturn]] void fail_dtype(const char* what, DType dt);
/// Throws "[what] <message>".
[[noreturn]] void fail_msg(const char* what, const char* message);
/// Throws fail_dtype's message unless dt is a floating type.
inline void check_float(const char* what, DType dt) {
  if (!is_floating(dt)) fail_dtype(what, dt);
}

/// Blocks for a grid-stride loop over `work` items of `per_block` each, capped at a few waves.
inline unsigned grid_for(int64_t work, int64_t per_block) {
  const int64_t want = (work + per_block - 1) / per_block;
  const int64_t cap = int64_t(sm_count()) * 32;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(want, cap)));
}

template <class T>
inline constexpr bool is_float_v = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                   std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;

// ---- storage <-> compute ------------------------------------------------------------------
// Num<T>::load widens a stored value to compute_t<T>; Num<T>::store narrows any arithmetic
// value to T. 16-bit floats go through float with round-to-nearest-even, as on the CPU.
template <class T>
struct Num {
  using C = compute_t<T>;
  __device__ __forceinline__ static C load(T v) { return v; }
  template <class V>
  __device__ __forceinline__ static T store(V v) { return static_cast<T>(v); }
};
template <>
struct Num<BFloat16> {
  using C = float;
  __device__ __forceinline__ static float load(BFloat16 v) { return __uint_as_float(uint32_t(v.bits) << 16); }
  template <class V>
  __device__ __forceinline__ static BFloat16 store(V v) {
    BFloat16 r;
    r.bits = __bfloat16_as_ushort(__float2bfloat16_rn(static_cast<float>(v)));
    return r;
  }
};
template <>
struct Num<Half> {
  using C = float;
  __device__ __forceinline__ static float load(Half v) { return __half2float(__ushort_as_half(v.bits)); }
  template <class V>
  __device__ __forceinline__ static Half store(V v) {
    Half r;
    r.bits = __half_as_ushort(__float2half_rn(static_cast<float>(v)));
    return r;
  }
};

// ---- the elementwise engine ------------------------------------------------------------------
/// V values of T loaded or stored as one aligned vector access.
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

/// An input of the flat kernel: contiguous (step 1) or one value broadcast to all (step 0).
template <class T>
struct In {
  const T* p;
  int64_t step;
};

template <int V, class T>
__device__ __forceinline__ Pack<T, V> load_pack(const In<T>& in, int64_t base) {
  if (in.step == 0) {
    Pack<T, V> r;
    const T s = in.p[0];
#pragma unroll
    for (int j = 0; j < V; ++j) r.v[j] = s;
    return r;
  }
  return *reinterpret_cast<const Pack<T, V>*>(in.p + base);
}

template <int V, class F, class O, class... P>
__device__ __forceinline__ void pack_apply(const F& f, Pack<O, V>& o, const P&... p) {
#pragma unroll
  for (int j = 0; j < V; ++j) o.v[j] = f(p.v[j]...);
}

// Output contiguous, each input contiguous or broadcast; `vec` says every contiguous pointer
// is aligned to its Pack, so full packs move as 16-byte (or narrower) vector accesses.
template <int V, class F, class O, class... I>
__global__ void __launch_bounds__(kBlock) ew_flat_kernel(int64_t n, bool vec, F f, O* __restrict__ out, In<I>... in) {
  const int64_t stride = int64_t(gridDim.x) * kBlock * V;
  for (int64_t base = (int64_t(blockIdx.x) * kBlock + threadIdx.x) * V; base < n; base += stride) {
    if (vec && base + V <= n) {
      Pack<O, V> o;
      pack_apply<V>(f, o, load_pack<V>(in, base)...);
      *reinterpret_cast<Pack<O, V>*>(out + base) = o;
    } else {
      const int64_t end = base + V < n ? base + V : n;
      for (int64_t i = base; i < end; ++i) out[i] = f(in.p[i * in.step]...);
    }
  }
}

// Element offsets (per operand, in elements) of linear index i of a loop. The index math is
// 32-bit (much cheaper than 64-bit division): launch_strided cuts bigger loops into pieces.
template <int N>
__device__ __forceinline__ void loop_offsets(const Loop<N>& l, uint32_t i, int64_t (&off)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) off[k] = 0;
  for (int d = l.ndim - 1; d >= 0; --d) {
    const uint32_t s = static_cast<uint32_t>(l.shape[d]);
    const uint32_t q = i / s;
    const uint32_t idx = i - q * s;
    i = q;
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] += int64_t(idx) * l.strides[k][d];
  }
}

template <class O, class... I>
struct StridedApply {
  template <class F, size_t... K>
  __device__ __forceinline__ static void run(const Loop<1 + sizeof...(I)>& l, const int64_t* off, const F& f,
                                             std::index_sequence<K...>) {
    O* o = static_cast<O*>(l.data[0]) + off[0];
    *o = f(static_cast<const I*>(l.data[K + 1])[off[K + 1]]...);
  }
};

template <class F, class O, class... I>
__global__ void __launch_bounds__(kBlock)
    ew_strided_kernel(const __grid_constant__ Loop<1 + sizeof...(I)> l, uint32_t n, F f) {
  constexpr int N = 1 + sizeof...(I);
  int64_t off[N];
  const uint32_t stride = gridDim.x * kBlock;
  for (uint32_t i = blockIdx.x * kBlock + threadIdx.x; i < n; i += stride) {
    loop_offsets(l, i, off);
    StridedApply<O, I...>::run(l, off, f, std::index_sequence_for<I...>{});
  }
}

inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

/// out = f(in...) over a loop whose operand 0 has type O and operand k+1 type I_k.
template <class O, class... I>
struct Elementwise {
  static constexpr int N = 1 + sizeof...(I);
  static constexpr size_t kWidest = std::max({sizeof(O), sizeof(I)...});
  static constexpr int V = static_cast<int>(16 / kWidest);  // elements per vector access

  template <class F>
  static void launch(const Loop<N>& l, const F& f, cudaStream_t stream) {
    const int64_t n = l.numel();
    if (n == 0) return;
    if (flat(l)) {
      launch_flat(l, f, n, stream, std::index_sequence_for<I...>{});
      return;
    }
    launch_strided(l, f, stream);
  }

 private:
  // One run: output stride 1, every input stride 1 or 0 (broadcast scalar).
  static bool flat(const Loop<N>& l) {
    if (l.ndim == 0) return true;
    if (l.ndim != 1 || l.strides[0][0] != 1) return false;
    for (int k = 1; k < N; ++k)
      if (l.strides[k][0] != 0 && l.strides[k][0] != 1) return false;
    return true;
  }
  // Loops of 2^31 elements or more are cut along their outermost dim (peeled one index at a
  // time when even one outer index is too big) so the kernel's index math stays 32-bit.
  template <class F>
  static void launch_strided(const Loop<N>& l, const F& f, cudaStream_t stream) {
    constexpr int64_t kMax = (int64_t(1) << 31) - 1;
    constexpr size_t es[N] = {sizeof(O), sizeof(I)...};
    const int64_t n = l.numel();
    if (n <= kMax) {
      // a grid-stride loop, so the grid never exceeds 2^31 threads and i + stride fits in 32 bits
      ew_strided_kernel<F, O, I...><<<grid_for(n, kBlock), kBlock, 0, stream>>>(l, static_cast<uint32_t>(n), f);
      QUILT_CHECK_LAUNCH();
      return;
    }
    const int64_t inner = n / l.shape[0];
    const int64_t per = inner > kMax ? 1 : kMax / inner;
    for (int64_t start = 0; start < l.shape[0]; start += per) {
      Loop<N> sub = l;
      for (int k = 0; k < N; ++k)
        sub.data[k] = static_cast<char*>(l.data[k]) + start * l.strides[k][0] * int64_t(es[k]);
      if (per == 1 && l.ndim > 1) {  // drop the outer dim
        sub.ndim = l.ndim - 1;
        for (int d = 0; d < sub.ndim; ++d) {
          sub.shape[d] = l.shape[d + 1];
          for (int k = 0; k < N; ++k) sub.strides[k][d] = l.strides[k][d + 1];
        }
      } else {
        sub.shape[0] = std::min(per, l.shape[0] - start);
      }
      launch_strided(sub, f, stream);
    }
  }

  template <class F, size_t... K>
  static void launch_flat(const Loop<N>& l, const F& f, int64_t n, cudaStream_t stream, std::index_sequence<K...>) {
    const int64_t step[N] = {1, (l.ndim == 0 ? 0 : l.strides[K + 1][0])...};
    bool vec = aligned_to(l.data[0], sizeof(O) * V);
    ((vec = vec && (step[K + 1] == 0 || aligned_to(l.data[K + 1], sizeof(I) * V))), ...);
    ew_flat_kernel<V, F, O, I...><<<grid_for(n, int64_t(kBlock) * V), kBlock, 0, stream>>>(
        n, vec, f, static_cast<O*>(l.data[0]), In<I>{static_cast<const I*>(l.data[K + 1]), step[K + 1]}...);
    QUILT_CHECK_LAUNCH();
  }
};

// ---- row kernels: a warp per row when cols <= kWarpMaxCols, a whole block otherwise --------
inline constexpr int kRowsPerWarpBlock = 4;  // warp mode: blockDim (32, 4), one row per warp
inline constexpr int64_t kWarpMaxCols = 1024;

/// Where a thread of a row kernel sits: its row, its first column and the column step.
template <bool kWarp>
struct RowThread {
  int64_t row;
  int lane, step;
  __device__ __forceinline__ RowThread() {
    if constexpr (kWarp) {
      row = int64_t(blockIdx.x) * kRowsPerWarpBlock + threadIdx.y;
      lane = threadIdx.x;
      step = 32;
    } else {
      row = blockIdx.x;
      lane = threadIdx.x;
      step = blockDim.x;
    }
  }
};

/// Sum across the threads of a row (warp shuffles, then shared memory in block mode); every
/// thread gets the total. Block mode reuses one shared array, so it syncs before writing it (a
/// second call may follow the first).
template <bool kWarp, class C>
__device__ __forceinline__ C row_sum(C v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if constexpr (kWarp) {
    return v;
  } else {
    __shared__ C sh[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    C r = sh[0];
    for (int w = 1; w < nw; ++w) r += sh[w];
    return r;
  }
}

/// Launch shape for a (rows, cols) job: warp per row for short rows, block per row otherwise.
struct RowLaunch {
  bool warp;
  dim3 grid, block;
};

inline RowLaunch row_launch(const char* what, int64_t rows, int64_t cols) {
  if (rows > (int64_t(1) << 31) - 1) fail_msg(what, "has more than 2^31 - 1 rows");
  if (cols <= kWarpMaxCols)
    return {true, dim3(unsigned((rows + kRowsPerWarpBlock - 1) / kRowsPerWarpBlock)), dim3(32, kRowsPerWarpBlock)};
  const unsigned threads = cols <= 4096 ? 256u : cols <= 16384 ? 512u : 1024u;
  return {false, dim3(unsigned(rows)), dim3(threads)};
}

/// Launches kernel<T, true> (warp per row) or kernel<T, false> (block per row) as RowLaunch `L`
/// says; T must name the element type where it is used.
#define QUILT_ROW_LAUNCH(L, stream, kernel, ...)                                  \
  do {                                                                           \
    if ((L).warp) kernel<T, true><<<(L).grid, (L).block, 0, stream>>>(__VA_ARGS__); \
    else kernel<T, false><<<(L).grid, (L).block, 0, stream>>>(__VA_ARGS__);      \
    QUILT_CHECK_LAUNCH();                                                        \
  } while (0)

}  // namespace quilt::kernels::cuda
