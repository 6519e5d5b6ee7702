// CUDA random fills that draw exactly the CPU kernels' numbers: element i of a block gets
// Philox(seed, key, global index of i) and kernels/elementwise_math.h's draws, scaled as in
// kernels/cpu/elementwise.cpp with an explicit FMA (the CPU build with -march=native fuses
// `a + w * u` into one; nvcc is not left to choose).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/philox.h"

namespace quilt::kernels::cuda {
namespace {

// `flat`: the block is a whole contiguous tensor, so the global index is i itself.
template <class T, bool kNormal>
__global__ void __launch_bounds__(kBlock)
    random_kernel(T* __restrict__ out, const __grid_constant__ RandomArgs a, int64_t n, bool flat, double width) {
  const int64_t stride = int64_t(gridDim.x) * kBlock;
  for (int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x; i < n; i += stride) {
    const uint64_t g = flat ? static_cast<uint64_t>(i) : a.global_index(i);
    const Philox4 r = philox_block(a.seed, a.key, g);
    double v;
    if constexpr (kNormal) v = __fma_rn(a.b, normal_draw(r), a.a);
    else v = __fma_rn(uniform_draw<T>(r), width, a.a);
    out[i] = Num<T>::store(static_cast<compute_t<T>>(v));
  }
}

// Element i (of a whole contiguous tensor) gets int_draw of Philox(seed, key, i), as on the CPU.
template <class T>
__global__ void __launch_bounds__(kBlock)
    random_int_kernel(T* __restrict__ out, int64_t n, int64_t low, uint64_t range, uint64_t seed, uint64_t key) {
  const int64_t stride = int64_t(gridDim.x) * kBlock;
  for (int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x; i < n; i += stride) {
    const int64_t v = int_draw(philox_block(seed, key, static_cast<uint64_t>(i)), low, range);
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

template <bool kNormal>
void launch(DType dt, void* out, const RandomArgs& args, cudaStream_t s) {
  const int64_t n = args.numel();
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

void random_int(DType dt, void* out, int64_t n, int64_t low, int64_t high, uint64_t seed, uint64_t key, void* stream) {
  if (n == 0) return;
  const uint64_t range = static_cast<uint64_t>(high - low);
  QUILT_DISPATCH_ALL(dt, [&] {
    random_int_kernel<scalar_t><<<grid_for(n, kBlock), kBlock, 0, as_stream(stream)>>>(static_cast<scalar_t*>(out), n,
                                                                                       low, range, seed, key);
    QUILT_CHECK_LAUNCH();
  });
}

}  // namespace quilt::kernels::cuda
