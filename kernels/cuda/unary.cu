// CUDA unary elementwise ops and fill: kernels/elementwise_math.h's UnaryMath, computed in
// float for bf16/f16. Math ops exist for the floating dtypes only (the engine checks this
// first); neg/abs/sign/square/relu also for integers, logical_not for every dtype.
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace quilt::kernels::cuda {
namespace {

template <UnaryOp op, class T>
struct UnaryFn {
  __device__ __forceinline__ auto operator()(T x) const {
    if constexpr (op == UnaryOp::logical_not) return UnaryMath<op>{}(Num<T>::load(x));
    else return Num<T>::store(UnaryMath<op>{}(Num<T>::load(x)));
  }
};

template <UnaryOp op, class T>
void run(const Loop<2>& l, cudaStream_t s) {
  using O = std::conditional_t<op == UnaryOp::logical_not, bool, T>;
  Elementwise<O, T>::launch(l, UnaryFn<op, T>{}, s);
}

template <class T>
void unary_typed(UnaryOp op, DType dt, const Loop<2>& l, cudaStream_t s) {
  constexpr bool kFloat = is_float_v<T>;
  constexpr bool kBool = std::is_same_v<T, bool>;
  switch (op) {
    case UnaryOp::logical_not: return run<UnaryOp::logical_not, T>(l, s);
#define Q_INT(name) \
    case UnaryOp::name: if constexpr (!kBool) return run<UnaryOp::name, T>(l, s); else break;
    Q_INT(neg) Q_INT(abs) Q_INT(sign) Q_INT(square) Q_INT(relu)
#undef Q_INT
#define Q_FLOAT(name) \
    case UnaryOp::name: if constexpr (kFloat) return run<UnaryOp::name, T>(l, s); else break;
    Q_FLOAT(exp) Q_FLOAT(log) Q_FLOAT(sqrt) Q_FLOAT(rsqrt) Q_FLOAT(tanh) Q_FLOAT(sigmoid) Q_FLOAT(silu)
    Q_FLOAT(gelu) Q_FLOAT(gelu_grad) Q_FLOAT(sin) Q_FLOAT(cos)
#undef Q_FLOAT
  }
  fail_dtype(op_name(op), dt);
}

template <class T>
struct FillFn {
  T v;
  __device__ __forceinline__ T operator()() const { return v; }
};

}  // namespace

void unary(UnaryOp op, DType dt, const Loop<2>& loop, void* stream) {
  QUILT_DISPATCH_ALL(dt, [&] { unary_typed<scalar_t>(op, dt, loop, as_stream(stream)); });
}

void fill(DType dt, double value, const Loop<1>& loop, void* stream) {
  QUILT_DISPATCH_ALL(dt, [&] {
    using T = scalar_t;
    // Converted on the host, as the CPU kernel converts it (a cast from f64).
    const T v = T(CastMath<T, double>{}(value));
    const int64_t n = loop.numel();
    if (n == 0) return;
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &v, sizeof(T));
    bool splat = true;  // every byte equal: a memset does it
    for (size_t i = 1; i < sizeof(T); ++i) splat = splat && bytes[i] == bytes[0];
    if (loop.contiguous() && splat) {
      QUILT_CHECK_CUDA(cudaMemsetAsync(loop.data[0], bytes[0], size_t(n) * sizeof(T), as_stream(stream)));
      return;
    }
    Elementwise<T>::launch(loop, FillFn<T>{v}, as_stream(stream));
  });
}

}  // namespace quilt::kernels::cuda
