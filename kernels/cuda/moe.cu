// CUDA twins of the MoE row kernels in kernels/cpu/moe.cpp: routing (a stable sort of slots by
// expert), order inversion, permute, the weighted combine, and per-slot dot products.
//
// Routing: one pass counts slots per expert (block-local shared-memory histograms, then one
// integer atomic per block and expert: the counts are exact, so the same every run) and writes
// (expert, slot) pairs; CUB's device radix sort, a stable LSD counting sort over the few key
// bits that E needs, orders the slots by expert with ties in slot order; a one-block scan
// makes the offsets. Permute copies one row per block; the combine gathers each token's k rows
// and sums them in slot order in registers (no atomics: bit-identical every run); slot dots use
// one warp per slot with a fixed shuffle tree. 16-bit types compute in f32 and round once.
#include <cub/device/device_radix_sort.cuh>

#include <climits>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe.h"

namespace quilt::kernels::cuda {
namespace {

constexpr int kRowThreads = 128;          // threads per row of the permute / combine kernels
constexpr int64_t kMaxSmemExperts = 8192;  // shared-memory histogram up to this many experts

// ---- routing ----

// keys[s] = expert of slot s (E when outside [0, E): sorts last, not counted), vals[s] = s.
__global__ void route_count_kernel(const int64_t* idx, int64_t n, int64_t experts, int* keys, int64_t* vals,
                                   int64_t* counts) {
  extern __shared__ unsigned hist[];
  const bool shared = experts <= kMaxSmemExperts;
  if (shared)
    for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < n; s += step) {
    const int64_t e = idx[s];
    const bool ok = e >= 0 && e < experts;
    keys[s] = ok ? int(e) : int(experts);
    vals[s] = s;
    if (ok) {
      if (shared) atomicAdd(&hist[e], 1u);
      else atomicAdd(reinterpret_cast<unsigned long long*>(counts + e), 1ull);
    }
  }
  __syncthreads();
  if (shared)
    for (int64_t e = threadIdx.x; e < experts; e += blockDim.x)
      if (hist[e]) atomicAdd(reinterpret_cast<unsigned long long*>(counts + e), (unsigned long long)hist[e]);
}

// offsets = inclusive cumulative sum of counts (one block).
__global__ void cumsum_kernel(const int64_t* counts, int64_t n, int64_t* offsets) {
  __shared__ int64_t chunk[1024];
  int64_t carry = 0;  // thread 0's
  for (int64_t base = 0; base < n; base += blockDim.x) {
    if (base + threadIdx.x < n) chunk[threadIdx.x] = counts[base + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t cnt = n - base < blockDim.x ? n - base : blockDim.x;
      for (int64_t i = 0; i < cnt; ++i) offsets[base + i] = carry += chunk[i];
    }
    __syncthreads();
  }
}

__global__ void invert_kernel(int64_t n, const int64_t* order, int64_t* slot_row) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < n; p += step) {
    const int64_t s = order[p];
    if (s >= 0 && s < n) slot_row[s] = p;
  }
}

// ---- rows ----

// V values moved as one aligned access when the rows allow it (V = 1 otherwise).
template <class T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <class T, int V>
__global__ void permute_kernel(int64_t n, int64_t h, int64_t k, const int64_t* order, const T* x, int64_t ldx,
                               const T* w, T* out) {
  using C = compute_t<T>;
  const int64_t nv = h / V;
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    const int64_t s = order[p];
    auto* dst = reinterpret_cast<Vec<T, V>*>(out + p * h);
    const bool ok = s >= 0 && s < n;
    const auto* src = reinterpret_cast<const Vec<T, V>*>(x + (ok ? s / k : 0) * ldx);
    const C ws = ok ? (w ? Num<T>::load(w[s]) : C(1)) : C(0);
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      Vec<T, V> r;
      if (!ok) {
#pragma unroll
        for (int j = 0; j < V; ++j) r.v[j] = Num<T>::store(C(0));
      } else if (!w) {
        r = src[i];  // an exact copy
      } else {
        const Vec<T, V> a = src[i];
#pragma unroll
        for (int j = 0; j < V; ++j) r.v[j] = Num<T>::store(ws * Num<T>::load(a.v[j]));
      }
      dst[i] = r;
    }
  }
}

template <class T, int V>
__global__ void unpermute_kernel(int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const T* y,
                                 int64_t ldy, const T* w, T* out) {
  using C = compute_t<T>;
  const int64_t nv = h / V;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    auto* dst = reinterpret_cast<Vec<T, V>*>(out + t * h);
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      C acc[V];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = C(0);
      for (int64_t j = 0; j < k; ++j) {  // slot order: the same sum every run
        const int64_t s = t * k + j, r = slot_row[s];
        if (r < 0) continue;  // no row holds this slot (a bad order): it adds nothing
        const C ws = w ? Num<T>::load(w[s]) : C(1);
        const Vec<T, V> a = reinterpret_cast<const Vec<T, V>*>(y + r * ldy)[i];
#pragma unroll
        for (int q = 0; q < V; ++q) {
          const C v = w ? ws * Num<T>::load(a.v[q]) : Num<T>::load(a.v[q]);
          acc[q] = j == 0 ? v : acc[q] + v;
        }
      }
      Vec<T, V> r;
#pragma unroll
      for (int q = 0; q < V; ++q) r.v[q] = Num<T>::store(acc[q]);
      dst[i] = r;
    }
  }
}

// One warp per slot: lane sums over columns lane, lane + 32, ..., then a fixed butterfly.
template <class T>
__global__ void slot_dot_kernel(int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const T* a,
                                int64_t lda, const T* b, int64_t ldb, T* d) {
  using C = compute_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32), n = tokens * k;
  for (int64_t s = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; s < n; s += warps) {
    const int64_t r = slot_row[s];
    C acc = C(0);
    if (r >= 0) {
      const T* pa = a + (s / k) * lda;
      const T* pb = b + r * ldb;
      for (int64_t i = lane; i < h; i += 32) acc += Num<T>::load(pa[i]) * Num<T>::load(pb[i]);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) d[s] = Num<T>::store(acc);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Vector width for rows of h values `ld` apart at these pointers: 16 bytes when all allow it.
template <class T>
constexpr int kVec = 16 / sizeof(T) > 0 ? int(16 / sizeof(T)) : 1;
template <class T>
bool can_vec(int64_t h, std::initializer_list<int64_t> lds, std::initializer_list<const void*> ptrs) {
  if (h % kVec<T> != 0) return false;
  for (int64_t ld : lds)
    if (ld % kVec<T> != 0) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

unsigned row_grid(int64_t rows) { return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t(sm_count()) * 64))); }

}  // namespace

void moe_route(const int64_t* expert_idx, int64_t n, int64_t num_experts, int64_t* order, int64_t* counts,
               int64_t* offsets, void* stream) {
  const cudaStream_t s = as_stream(stream);
  if (num_experts <= 0) return;
  if (num_experts >= INT_MAX || n > INT_MAX)
    fail_msg("moe_route", ("n = " + std::to_string(n) + " slots or E = " + std::to_string(num_experts) +
                           " experts do not fit the sort's 32-bit counts").c_str());
  QUILT_CHECK_CUDA(cudaMemsetAsync(counts, 0, size_t(num_experts) * sizeof(int64_t), s));
  if (n > 0) {
    int* keys = static_cast<int*>(workspace_alloc(size_t(n) * sizeof(int) * 2, s));
    auto* vals = static_cast<int64_t*>(workspace_alloc(size_t(n) * sizeof(int64_t), s));
    const size_t smem = num_experts <= kMaxSmemExperts ? size_t(num_experts) * sizeof(unsigned) : 0;
    route_count_kernel<<<grid_for(n, 256 * 8), 256, smem, s>>>(expert_idx, n, num_experts, keys, vals, counts);
    cudaError_t err = cudaGetLastError();
    int end_bit = 1;
    while (end_bit < 31 && (int64_t(1) << end_bit) <= num_experts) ++end_bit;  // keys lie in [0, E]
    size_t temp_bytes = 0;
    void* temp = nullptr;
    if (err == cudaSuccess)
      err = cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, keys + n, vals, order, int(n), 0, end_bit, s);
    if (err == cudaSuccess) {
      temp = workspace_alloc(std::max<size_t>(temp_bytes, 16), s);
      err = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, keys + n, vals, order, int(n), 0, end_bit, s);
      workspace_free(temp, s);
    }
    workspace_free(vals, s);
    workspace_free(keys, s);
    QUILT_CHECK_CUDA(err);
  }
  cumsum_kernel<<<1, 1024, 0, s>>>(counts, num_experts, offsets);
  QUILT_CHECK_LAUNCH();
}

void moe_invert_order(int64_t n, const int64_t* order, int64_t* slot_row, void* stream) {
  const cudaStream_t s = as_stream(stream);
  if (n == 0) return;
  QUILT_CHECK_CUDA(cudaMemsetAsync(slot_row, 0xff, size_t(n) * sizeof(int64_t), s));  // -1
  invert_kernel<<<grid_for(n, 256), 256, 0, s>>>(n, order, slot_row);
  QUILT_CHECK_LAUNCH();
}

void moe_permute(DType dt, int64_t n, int64_t h, int64_t k, const int64_t* order, const void* x, int64_t ldx,
                 const void* w, void* out, void* stream) {
  const cudaStream_t s = as_stream(stream);
  if (n == 0 || h == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    const T* xp = static_cast<const T*>(x);
    const T* wp = static_cast<const T*>(w);
    T* op = static_cast<T*>(out);
    if (can_vec<T>(h, {ldx}, {x, out}))
      permute_kernel<T, kVec<T>><<<row_grid(n), kRowThreads, 0, s>>>(n, h, k, order, xp, ldx, wp, op);
    else
      permute_kernel<T, 1><<<row_grid(n), kRowThreads, 0, s>>>(n, h, k, order, xp, ldx, wp, op);
    QUILT_CHECK_LAUNCH();
  });
}

void moe_unpermute(DType dt, int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const void* y,
                   int64_t ldy, const void* w, void* out, void* stream) {
  const cudaStream_t s = as_stream(stream);
  if (tokens == 0 || h == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    const T* yp = static_cast<const T*>(y);
    const T* wp = static_cast<const T*>(w);
    T* op = static_cast<T*>(out);
    if (can_vec<T>(h, {ldy}, {y, out}))
      unpermute_kernel<T, kVec<T>><<<row_grid(tokens), kRowThreads, 0, s>>>(tokens, h, k, slot_row, yp, ldy, wp, op);
    else
      unpermute_kernel<T, 1><<<row_grid(tokens), kRowThreads, 0, s>>>(tokens, h, k, slot_row, yp, ldy, wp, op);
    QUILT_CHECK_LAUNCH();
  });
}

void moe_slot_dot(DType dt, int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const void* a,
                  int64_t lda, const void* b, int64_t ldb, void* d, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const int64_t n = tokens * k;
  if (n == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    using T = scalar_t;
    slot_dot_kernel<T><<<grid_for(n, 8), 256, 0, s>>>(tokens, h, k, slot_row, static_cast<const T*>(a), lda,
                                                      static_cast<const T*>(b), ldb, static_cast<T*>(d));
    QUILT_CHECK_LAUNCH();
  });
}

}  // namespace quilt::kernels::cuda
