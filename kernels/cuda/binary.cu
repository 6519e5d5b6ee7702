// CUDA binary elementwise ops (kernels/elementwise_math.h's BinaryMath: maximum/minimum
// propagate NaN, predicates give bool) and where.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace quilt::kernels::cuda {
namespace {

template <BinaryOp op, class T>
struct BinaryFn {
  __device__ __forceinline__ auto operator()(T a, T b) const {
    const auto r = BinaryMath<op>{}(Num<T>::load(a), Num<T>::load(b));
    if constexpr (is_predicate(op)) return r;
    else return Num<T>::store(r);
  }
};

template <class T>
struct WhereFn {
  __device__ __forceinline__ T operator()(bool c, T a, T b) const { return c ? a : b; }
};

template <BinaryOp op, class T>
void run(const Loop<3>& l, cudaStream_t s) {
  using O = std::conditional_t<is_predicate(op), bool, T>;
  Elementwise<O, T, T>::launch(l, BinaryFn<op, T>{}, s);
}

// div and pow exist for the floating dtypes only: the engine computes them in f32 for integer
// and bool inputs (engine/ops/binary.cpp), which keeps a dozen kernels out of the build.
template <class T>
void binary_typed(BinaryOp op, DType dt, const Loop<3>& l, cudaStream_t s) {
  switch (op) {
#define Q(name) case BinaryOp::name: return run<BinaryOp::name, T>(l, s);
    Q(add) Q(sub) Q(mul) Q(maximum) Q(minimum) Q(eq) Q(ne) Q(lt) Q(le) Q(gt) Q(ge) Q(logical_and) Q(logical_or)
#undef Q
    case BinaryOp::div:
      if constexpr (is_float_v<T>) return run<BinaryOp::div, T>(l, s);
      break;
    case BinaryOp::pow:
      if constexpr (is_float_v<T>) return run<BinaryOp::pow, T>(l, s);
      break;
  }
  fail_dtype(op_name(op), dt);
}

}  // namespace

void binary(BinaryOp op, DType dt, const Loop<3>& loop, void* stream) {
  QUILT_DISPATCH_ALL(dt, [&] { binary_typed<scalar_t>(op, dt, loop, as_stream(stream)); });
}

void where(DType dt, const Loop<4>& loop, void* stream) {
  QUILT_DISPATCH_ALL(dt, [&] { Elementwise<scalar_t, bool, scalar_t, scalar_t>::launch(loop, WhereFn<scalar_t>{}, as_stream(stream)); });
}

}  // namespace quilt::kernels::cuda
