// CUDA copy/cast between any two of the seven dtypes, strided. The conversion is the CPU's
// (kernels/elementwise_math.h's CastMath), so casts give the CPU's values bit for bit.
// Same-dtype copies move raw bytes: cudaMemcpyAsync when both sides are one contiguous run, a
// kernel otherwise.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace quilt::kernels::cuda {
namespace {

template <class O, class I>
struct CastFn {
  __device__ __forceinline__ O operator()(I x) const {
    const auto v = CastMath<O, I>{}(Num<I>::load(x));
    if constexpr (std::is_same_v<O, bool>) return v;
    else return Num<O>::store(v);
  }
};

struct RawCopyFn {
  template <class T>
  __device__ __forceinline__ T operator()(T x) const { return x; }
};

// Same-dtype copy by element width (bf16 and f16 share one kernel, and so on).
void copy_raw(size_t width, const Loop<2>& l, cudaStream_t s) {
  switch (width) {
    case 1: return Elementwise<uint8_t, uint8_t>::launch(l, RawCopyFn{}, s);
    case 2: return Elementwise<uint16_t, uint16_t>::launch(l, RawCopyFn{}, s);
    case 4: return Elementwise<uint32_t, uint32_t>::launch(l, RawCopyFn{}, s);
    default: return Elementwise<uint64_t, uint64_t>::launch(l, RawCopyFn{}, s);
  }
}

}  // namespace

void copy(DType out_dt, DType in_dt, const Loop<2>& loop, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const int64_t n = loop.numel();
  if (n == 0) return;
  if (out_dt == in_dt) {
    if (loop.contiguous()) {
      QUILT_CHECK_CUDA(cudaMemcpyAsync(loop.data[0], loop.data[1], size_t(n) * dtype_size(out_dt),
                                       cudaMemcpyDeviceToDevice, s));
      return;
    }
    copy_raw(dtype_size(out_dt), loop, s);
    return;
  }
  QUILT_DISPATCH_ALL(out_dt, [&] {
    using O = scalar_t;
    QUILT_DISPATCH_ALL(in_dt, [&] {
      using I = scalar_t;
      if constexpr (!std::is_same_v<O, I>) Elementwise<O, I>::launch(loop, CastFn<O, I>{}, s);
    });
  });
}

}  // namespace quilt::kernels::cuda
