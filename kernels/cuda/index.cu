// CUDA gather / scatter-add (which also serve index_select / index_add through a stride-0
// index), sort / top-k and cumsum, on the loop descriptors of kernels/cpu/index.h. Index math
// is 64-bit. An index outside [0, dim_size) is never followed (gather reads zero, scatter_add
// skips it) and, when the engine asks, is reported on the device (kernels.h's DeviceError): the
// engine throws at its next synchronisation, with no host sync inside the op.
#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/nn.h"

namespace quilt::kernels::cuda {
namespace {

// Element offsets (per operand) of linear position i of a loop, 64-bit throughout.
template <int N>
__device__ __forceinline__ void offsets_of(const Loop<N>& l, int64_t i, int64_t (&off)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) off[k] = 0;
  for (int d = l.ndim - 1; d >= 0; --d) {
    const int64_t s = l.shape[d];
    const int64_t q = i / s;
    const int64_t idx = i - q * s;
    i = q;
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] += idx * l.strides[k][d];
  }
}

// ---- gather / scatter-add ----

// Operands of l.loop: self (x), index, other (out). For every position p: out[p] =
// x[p + index[p] * self_dim_stride], or zero when index[p] is outside [0, dim_size) (reported to
// `err` as `op`, with the index element's offset).
template <class T, class I>
__global__ void gather_kernel(const __grid_constant__ IndexLoop l, int64_t n, int64_t dim_size, DeviceError* err,
                              DeviceErrorOp op) {
  const T* x = static_cast<const T*>(l.loop.data[0]);
  const I* index = static_cast<const I*>(l.loop.data[1]);
  T* out = static_cast<T*>(l.loop.data[2]);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    int64_t off[3];
    offsets_of(l.loop, i, off);
    const int64_t v = int64_t(index[off[1]]);
    const bool in_range = v >= 0 && v < dim_size;
    if (!in_range) report_device_error(err, op, v, dim_size, off[1]);
    out[off[2]] = in_range ? x[off[0] + v * l.self_dim_stride] : T{};
  }
}

// Operands of l.loop (indexed dim left out): self, index, other. Each thread owns one
// position and walks the indexed dim in order: self[.. index[j] ..] += other[.. j ..], rounded
// to T after every add, as on the CPU. Distinct positions never share a target element.
template <class T, class I>
__global__ void scatter_add_kernel(const __grid_constant__ IndexLoop l, int64_t positions, int64_t dim_size,
                                   DeviceError* err, DeviceErrorOp op) {
  T* self = static_cast<T*>(l.loop.data[0]);
  const I* index = static_cast<const I*>(l.loop.data[1]);
  const T* other = static_cast<const T*>(l.loop.data[2]);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < positions; i += stride) {
    int64_t off[3];
    offsets_of(l.loop, i, off);
    for (int64_t j = 0; j < l.n; ++j) {
      const int64_t v = int64_t(index[off[1] + j * l.index_dim_stride]);
      if (v < 0 || v >= dim_size) {
        report_device_error(err, op, v, dim_size, off[1] + j * l.index_dim_stride);
        continue;
      }
      T& t = self[off[0] + v * l.self_dim_stride];
      t = Num<T>::store(Num<T>::load(t) + Num<T>::load(other[off[2] + j * l.other_dim_stride]));
    }
  }
}

template <class F>
void with_index(const char* what, DType index_dt, F&& f) {
  if (index_dt == DType::i32) f(int32_t{});
  else if (index_dt == DType::i64) f(int64_t{});
  else fail_dtype(what, index_dt);
}

// ---- sort ----

// Sort key of T: 16-bit floats widen to float (exact, order-preserving).
template <class T>
using key_t = std::conditional_t<std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>, float, T>;

template <class K>
__device__ __forceinline__ bool is_nan_key(K k) {
  if constexpr (std::is_floating_point_v<K>) return k != k;
  else return false;
}
// k < j with NaN above every number.
template <class K>
__device__ __forceinline__ bool key_less(K k, K j) {
  if (is_nan_key(k)) return false;
  if (is_nan_key(j)) return true;
  return k < j;
}

// One block sorts one row (blocks stride over rows) in shared memory: keys (p2) then positions
// (p2, int32; -1 marks padding, which sorts last). Bitonic network on (key, position), so equal
// keys keep position order (stable). Writes the first l.k: values (out0), i64 positions (out1).
template <class T>
__global__ void sort_kernel(const __grid_constant__ RowLoop l, int64_t rows, int p2, bool descending) {
  using K = key_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  K* key = reinterpret_cast<K*>(smem);
  int32_t* pos = reinterpret_cast<int32_t*>(smem + size_t(p2) * sizeof(K));
  const T* x = static_cast<const T*>(l.rows.data[2]);
  T* values = static_cast<T*>(l.rows.data[0]);
  int64_t* indices = static_cast<int64_t*>(l.rows.data[1]);
  const int n = int(l.n);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    int64_t off[3];
    offsets_of(l.rows, row, off);
    for (int i = threadIdx.x; i < p2; i += blockDim.x) {
      if (i < n) {
        key[i] = K(Num<T>::load(x[off[2] + int64_t(i) * l.dim_strides[2]]));
        pos[i] = i;
      } else {
        key[i] = K{};
        pos[i] = -1;
      }
    }
    __syncthreads();
    // before(a, b): slot a's element comes first in the sorted row.
    auto before = [&](int a, int b) {
      if (pos[a] < 0) return false;
      if (pos[b] < 0) return true;
      const K ka = key[a], kb = key[b];
      const bool first = descending ? key_less(kb, ka) : key_less(ka, kb);
      const bool second = descending ? key_less(ka, kb) : key_less(kb, ka);
      return first || (!second && pos[a] < pos[b]);
    };
    for (int size = 2; size <= p2; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        for (int i = threadIdx.x; i < p2; i += blockDim.x) {
          const int j = i ^ stride;
          if (j <= i) continue;
          const bool up = (i & size) == 0;  // this pair's run sorts in the row's order
          if (up ? before(j, i) : before(i, j)) {
            const K tk = key[i];
            key[i] = key[j];
            key[j] = tk;
            const int32_t tp = pos[i];
            pos[i] = pos[j];
            pos[j] = tp;
          }
        }
        __syncthreads();
      }
    }
    for (int64_t i = threadIdx.x; i < l.k; i += blockDim.x) {
      values[off[0] + i * l.dim_strides[0]] = Num<T>::store(key[i]);
      indices[off[1] + i * l.dim_strides[1]] = pos[i];
    }
    __syncthreads();  // the next row reuses the shared arrays
  }
}

// ---- cumsum ----

template <class T>
using scan_acc_t = std::conditional_t<std::is_same_v<T, double>, double,
                                      std::conditional_t<std::is_floating_point_v<compute_t<T>>, float, int64_t>>;

// One thread per row: out0[j] = sum of in[0..j] (or in[j..n-1] when reverse), accumulated in
// scan_acc_t as on the CPU. Rows run in parallel; a single long row runs on one thread.
template <class T, class O>
__global__ void cumsum_kernel(const __grid_constant__ RowLoop l, int64_t rows, bool reverse) {
  using A = scan_acc_t<T>;
  O* out = static_cast<O*>(l.rows.data[0]);
  const T* in = static_cast<const T*>(l.rows.data[2]);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += stride) {
    int64_t off[3];
    offsets_of(l.rows, r, off);
    A acc = A(0);
    for (int64_t step = 0; step < l.n; ++step) {
      const int64_t j = reverse ? l.n - 1 - step : step;
      acc += A(Num<T>::load(in[off[2] + j * l.dim_strides[2]]));
      out[off[0] + j * l.dim_strides[0]] = Num<O>::store(acc);
    }
  }
}

}  // namespace

void gather(DType dt, DType index_dt, const IndexLoop& l, int64_t dim_size, DeviceErrorOp report_as, void* stream) {
  const int64_t n = l.loop.numel();
  if (n == 0) return;
  DeviceError* err = report_as == DeviceErrorOp::none ? nullptr : device_error_slot();
  QUILT_DISPATCH_ALL(dt, [&] {
    using T = scalar_t;
    with_index("gather", index_dt, [&](auto tag) {
      using I = decltype(tag);
      gather_kernel<T, I><<<grid_for(n, kBlock), kBlock, 0, as_stream(stream)>>>(l, n, dim_size, err, report_as);
      QUILT_CHECK_LAUNCH();
    });
  });
}

void scatter_add(DType dt, DType index_dt, const IndexLoop& l, int64_t dim_size, DeviceErrorOp report_as,
                 void* stream) {
  if (dt == DType::b8) fail_dtype("scatter_add", dt);
  const int64_t positions = l.loop.numel();
  if (positions == 0 || l.n == 0) return;
  DeviceError* err = report_as == DeviceErrorOp::none ? nullptr : device_error_slot();
  QUILT_DISPATCH_ALL(dt, [&] {
    using T = scalar_t;
    with_index("scatter_add", index_dt, [&](auto tag) {
      using I = decltype(tag);
      scatter_add_kernel<T, I><<<grid_for(positions, kBlock), kBlock, 0, as_stream(stream)>>>(l, positions,
                                                                                              dim_size, err, report_as);
      QUILT_CHECK_LAUNCH();
    });
  });
}

void sort(DType dt, const RowLoop& l, bool descending, void* stream) {
  const int64_t rows = l.rows.numel();
  if (rows == 0 || l.k == 0) return;
  if (l.n > kSortMaxRow) fail_msg("sort", "has no CUDA kernel for rows longer than 4096 elements yet");
  int p2 = 1;
  while (p2 < l.n) p2 <<= 1;
  const int threads = std::clamp(p2 / 2, 32, 1024);
  const unsigned grid = unsigned(std::min<int64_t>(rows, int64_t(INT_MAX)));
  QUILT_DISPATCH_ALL(dt, [&] {
    using T = scalar_t;
    const size_t smem = size_t(p2) * (sizeof(key_t<T>) + sizeof(int32_t));
    sort_kernel<T><<<grid, threads, smem, as_stream(stream)>>>(l, rows, p2, descending);
    QUILT_CHECK_LAUNCH();
  });
}

void cumsum(DType in_dt, DType out_dt, const RowLoop& l, bool reverse, void* stream) {
  const int64_t rows = l.rows.numel();
  if (rows == 0 || l.n == 0) return;
  QUILT_DISPATCH_ALL(in_dt, [&] {
    using T = scalar_t;
    if (out_dt == in_dt) {
      cumsum_kernel<T, T><<<grid_for(rows, kBlock), kBlock, 0, as_stream(stream)>>>(l, rows, reverse);
    } else if (out_dt == DType::i64) {
      cumsum_kernel<T, int64_t><<<grid_for(rows, kBlock), kBlock, 0, as_stream(stream)>>>(l, rows, reverse);
    } else {
      fail_dtype("cumsum", out_dt);
    }
    QUILT_CHECK_LAUNCH();
  });
}

}  // namespace quilt::kernels::cuda
