// CUDA binary elementwise ops and where. Same formulas as kernels/cpu/elementwise.cpp:
// maximum/minimum propagate NaN, predicates give bool.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace quilt::kernels::cuda {
namespace {

template <BinaryOp op, class C>
__device__ __forceinline__ auto binary_math(C a, C b) {
  if constexpr (op == BinaryOp::add) return C(a + b);
  else if constexpr (op == BinaryOp::sub) return C(a - b);
  else if constexpr (op == BinaryOp::mul) return C(a * b);
  else if constexpr (op == BinaryOp::div) {
    if constexpr (std::is_integral_v<C>) return C(b == 0 ? 0 : a / b);
    else return C(a / b);
  } else if constexpr (op == BinaryOp::pow) {
    if constexpr (std::is_integral_v<C>) return C(m_pow(double(a), double(b)));  // as std::pow(int, int)
    else return m_pow(a, b);
  } else if constexpr (op == BinaryOp::maximum) {
    if constexpr (std::is_floating_point_v<C>) return (a != a || b != b) ? C(NAN) : (a > b ? a : b);
    else return a > b ? a : b;
  } else if constexpr (op == BinaryOp::minimum) {
    if constexpr (std::is_floating_point_v<C>) return (a != a || b != b) ? C(NAN) : (a < b ? a : b);
    else return a < b ? a : b;
  } else if constexpr (op == BinaryOp::eq) return a == b;
  else if constexpr (op == BinaryOp::ne) return a != b;
  else if constexpr (op == BinaryOp::lt) return a < b;
  else if constexpr (op == BinaryOp::le) return a <= b;
  else if constexpr (op == BinaryOp::gt) return a > b;
  else if constexpr (op == BinaryOp::ge) return a >= b;
  else if constexpr (op == BinaryOp::logical_and) return static_cast<bool>(a) && static_cast<bool>(b);
  else return static_cast<bool>(a) || static_cast<bool>(b);
}

template <BinaryOp op, class T>
struct BinaryFn {
  __device__ __forceinline__ auto operator()(T a, T b) const {
    const auto r = binary_math<op>(Num<T>::load(a), Num<T>::load(b));
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
