// CUDA random fills that draw exactly the CPU kernels' numbers: element i of a block gets
// Philox(seed, key, global index of i) and the same arithmetic as kernels/cpu/elementwise.cpp,
// written with explicit rounding intrinsics so nvcc cannot re-associate or fuse it differently.
// (The CPU build with -march=native fuses `a + w * u` into one FMA; so do we.)
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/philox.h"

namespace quilt::kernels::cuda {
namespace {

__device__ __forceinline__ uint64_t global_index(const RandomArgs& a, int64_t i) {
  uint64_t g = 0;
  for (int d = a.ndim - 1; d >= 0; --d) {
    const int64_t idx = i % a.shape[d];
    i /= a.shape[d];
    g += static_cast<uint64_t>(idx + a.offsets[d]) * static_cast<uint64_t>(a.global_strides[d]);
  }
  return g;
}

// `flat`: the block is a whole contiguous tensor, so the global index is i itself.
template <class T, bool kNormal>
__global__ void __launch_bounds__(kBlock)
    random_kernel(T* __restrict__ out, const __grid_constant__ RandomArgs a, int64_t n, bool flat, double width) {
  const int64_t stride = int64_t(gridDim.x) * kBlock;
  for (int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x; i < n; i += stride) {
    const uint64_t g = flat ? static_cast<uint64_t>(i) : global_index(a, i);
    const Philox4 r = philox_block(a.seed, a.key, g);
    double v;
    if constexpr (kNormal) {
      const double u1 = uint2_to_unit(r.v[0], r.v[1]);
      const double u2 = uint2_to_unit(r.v[2], r.v[3]);
      const double z = __dmul_rn(sqrt(-2.0 * log(u1)), cos(__dmul_rn(6.283185307179586, u2)));
      v = __fma_rn(a.b, z, a.a);
    } else {
      // (0, 1] -> [0, 1): 1 - u (exact in double)
      const double u = std::is_same_v<T, double> ? 1.0 - uint2_to_unit(r.v[0], r.v[1])
                                                 : 1.0 - double(uint_to_unit(r.v[0]));
      v = __fma_rn(u, width, a.a);
    }
    out[i] = Num<T>::store(static_cast<compute_t<T>>(v));
  }
}

bool is_flat(const RandomArgs& a) {
  int64_t expect = 1;
  for (int d = a.ndim - 1; d >= 0; --d) {
    if (a.offsets[d] != 0) return false;
    if (a.shape[d] != 1 && a.global_strides[d] != expect) return false;
    expect *= a.shape[d];
  }
  return true;
}

int64_t numel(const RandomArgs& a) {
  int64_t n = 1;
  for (int d = 0; d < a.ndim; ++d) n *= a.shape[d];
  return n;
}

template <bool kNormal>
void launch(DType dt, void* out, const RandomArgs& args, cudaStream_t s) {
  const int64_t n = numel(args);
  if (n == 0) return;
  QUILT_DISPATCH_FLOATING(dt, [&] {
    random_kernel<scalar_t, kNormal><<<grid_for(n, kBlock), kBlock, 0, s>>>(
        static_cast<scalar_t*>(out), args, n, is_flat(args), args.b - args.a);
    QUILT_CHECK_LAUNCH();
  });
}

}  // namespace

void random_uniform(DType dt, void* out, const RandomArgs& args, void* stream) {
  if (!is_floating(dt)) fail_dtype("rand", dt);
  launch<false>(dt, out, args, as_stream(stream));
}

void random_normal(DType dt, void* out, const RandomArgs& args, void* stream) {
  if (!is_floating(dt)) fail_dtype("randn", dt);
  launch<true>(dt, out, args, as_stream(stream));
}

}  // namespace quilt::kernels::cuda
