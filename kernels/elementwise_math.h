// Per-element math written once for the CPU kernels (kernels/cpu/) and the CUDA kernels
// (kernels/cuda/): the unary and binary ops, casts, the reductions' identities and NaN
// rules, the random draws, and the SGD and AdamW updates. Everything takes and returns compute
// types (compute_t<T>: float for bf16 and f16); each device loads and stores its 16-bit types
// itself. The CPU's Eigen forms of the unary ops (kernels/cpu/elementwise.cpp) are its
// vectorised fast path and stay there.
//
//   const float y = UnaryMath<UnaryOp::gelu>{}(x);         // on either device
//   const bool lt = BinaryMath<BinaryOp::lt>{}(a, b);
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/dtype.h"
#include "kernels/host_device.h"
#include "kernels/loop.h"
#include "kernels/philox.h"

namespace quilt::kernels {

inline constexpr double kInvSqrt2 = 0.70710678118654752440;
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;

// ---- math functions -------------------------------------------------------------------------
// m_exp(x), the rest and m_pow: on the GPU the float function for float (expf) and the double
// one otherwise; on the CPU std::'s overload, so an integer goes through double as in
// std::exp(int).
#if defined(__CUDA_ARCH__)
#define QUILT_MATH_FN(name)                                        \
  template <class X>                                               \
  QUILT_HD auto m_##name(X x) {                                    \
    if constexpr (std::is_same_v<X, float>) return ::name##f(x);   \
    else return ::name(x);                                         \
  }
#else
#define QUILT_MATH_FN(name) \
  template <class X>        \
  QUILT_HD auto m_##name(X x) { return std::name(x); }
#endif
QUILT_MATH_FN(exp)
QUILT_MATH_FN(log)
QUILT_MATH_FN(sqrt)
QUILT_MATH_FN(tanh)
QUILT_MATH_FN(erf)
QUILT_MATH_FN(sin)
QUILT_MATH_FN(cos)
#undef QUILT_MATH_FN

template <class X>
QUILT_HD auto m_pow(X a, X b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<X, float>) return ::powf(a, b);
  else return ::pow(double(a), double(b));
#else
  return std::pow(a, b);
#endif
}

/// a * b rounded on its own: __dmul_rn on the GPU, so nvcc cannot fuse it into an add (where
/// it is used, g++ has no add to fuse it with).
QUILT_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

/// max(a, b) that gives NaN when either is (as torch.maximum); b on a tie.
template <class C>
QUILT_HD C max_nan(C a, C b) {
  if constexpr (std::is_floating_point_v<C>) return (a != a || b != b) ? C(NAN) : (a > b ? a : b);
  else return a > b ? a : b;
}
/// min(a, b) that gives NaN when either is (as torch.minimum); b on a tie.
template <class C>
QUILT_HD C min_nan(C a, C b) {
  if constexpr (std::is_floating_point_v<C>) return (a != a || b != b) ? C(NAN) : (a < b ? a : b);
  else return a < b ? a : b;
}

// ---- elementwise ops ------------------------------------------------------------------------

/// y = op(x) in x's compute type C (bool for logical_not).
template <UnaryOp op>
struct UnaryMath {
  template <class C>
  QUILT_HD auto operator()(C x) const -> std::conditional_t<op == UnaryOp::logical_not, bool, C> {
    if constexpr (op == UnaryOp::neg) return -x;
    else if constexpr (op == UnaryOp::abs) return x < C(0) ? C(-x) : x;
    else if constexpr (op == UnaryOp::sign) return C((C(0) < x) - (x < C(0)));
    else if constexpr (op == UnaryOp::square) return x * x;
    else if constexpr (op == UnaryOp::relu) return x > C(0) ? x : C(0);
    else if constexpr (op == UnaryOp::exp) return m_exp(x);
    else if constexpr (op == UnaryOp::log) return m_log(x);
    else if constexpr (op == UnaryOp::sqrt) return m_sqrt(x);
    else if constexpr (op == UnaryOp::rsqrt) return C(1) / m_sqrt(x);
    else if constexpr (op == UnaryOp::tanh) return m_tanh(x);
    else if constexpr (op == UnaryOp::sigmoid) return C(1) / (C(1) + m_exp(-x));
    else if constexpr (op == UnaryOp::silu) return x / (C(1) + m_exp(-x));
    else if constexpr (op == UnaryOp::gelu) return C(0.5) * x * (C(1) + m_erf(x * C(kInvSqrt2)));
    else if constexpr (op == UnaryOp::gelu_grad)
      return C(0.5) * (C(1) + m_erf(x * C(kInvSqrt2))) + x * C(kInvSqrt2Pi) * m_exp(C(-0.5) * x * x);
    else if constexpr (op == UnaryOp::sin) return m_sin(x);
    else if constexpr (op == UnaryOp::cos) return m_cos(x);
    else return !static_cast<bool>(x);  // logical_not
  }
};

/// op(a, b) in the inputs' compute type C, or bool for the predicates. Integer division by
/// zero gives 0.
template <BinaryOp op>
struct BinaryMath {
  template <class C>
  QUILT_HD auto operator()(C a, C b) const {
    if constexpr (op == BinaryOp::add) return C(a + b);
    else if constexpr (op == BinaryOp::sub) return C(a - b);
    else if constexpr (op == BinaryOp::mul) return C(a * b);
    else if constexpr (op == BinaryOp::div) {
      if constexpr (std::is_integral_v<C>) return C(b == 0 ? 0 : a / b);
      else return C(a / b);
    } else if constexpr (op == BinaryOp::pow) return C(m_pow(a, b));
    else if constexpr (op == BinaryOp::maximum) return max_nan(a, b);
    else if constexpr (op == BinaryOp::minimum) return min_nan(a, b);
    else if constexpr (op == BinaryOp::eq) return a == b;
    else if constexpr (op == BinaryOp::ne) return a != b;
    else if constexpr (op == BinaryOp::lt) return a < b;
    else if constexpr (op == BinaryOp::le) return a <= b;
    else if constexpr (op == BinaryOp::gt) return a > b;
    else if constexpr (op == BinaryOp::ge) return a >= b;
    else if constexpr (op == BinaryOp::logical_and) return static_cast<bool>(a) && static_cast<bool>(b);
    else return static_cast<bool>(a) || static_cast<bool>(b);
  }
};

/// Type a cast from I to O goes through: double when either side is f64, i64 when both are
/// integers, float otherwise.
template <class O, class I>
using cast_compute_t = std::conditional_t<std::is_same_v<O, double> || std::is_same_v<I, double>, double,
                       std::conditional_t<std::is_integral_v<O> && std::is_integral_v<I>, int64_t, float>>;

/// A cast from I to O (and fill's value, as a cast from f64): takes x widened to compute_t<I>,
/// gives bool for a bool O (x != 0), else the value in cast_compute_t<O, I> for the caller to
/// store as O.
template <class O, class I>
struct CastMath {
  using C = cast_compute_t<O, I>;
  QUILT_HD auto operator()(compute_t<I> x) const {
    const C v = static_cast<C>(x);
    if constexpr (std::is_same_v<O, bool>) return v != C(0);
    else return v;
  }
};

// ---- reductions -----------------------------------------------------------------------------

/// Accumulator of a reduction over T: double for f64, i64 for integers and bool, float otherwise.
template <class T>
using reduce_acc_t = std::conditional_t<std::is_same_v<T, double>, double,
                     std::conditional_t<std::is_integral_v<T>, int64_t, float>>;

/// What a reduction starts from, and gives over no elements: 0 for the sums, the far end of
/// A's range for max (and argmax) and min.
template <ReduceOp op, class A>
QUILT_HD A reduce_identity() {
  using L = std::numeric_limits<A>;
  if constexpr (op == ReduceOp::max || op == ReduceOp::argmax) return L::has_infinity ? -L::infinity() : L::lowest();
  else if constexpr (op == ReduceOp::min) return L::has_infinity ? L::infinity() : L::max();
  else return A(0);
}

// ---- random draws ---------------------------------------------------------------------------

/// Uniform in [0, 1) from a Philox block: 53 bits for a double output, 24 otherwise.
template <class T>
QUILT_HD double uniform_draw(const Philox4& r) {
  // (0, 1] -> [0, 1): 1 - u, exact in double
  if constexpr (std::is_same_v<T, double>) return 1.0 - uint2_to_unit(r.v[0], r.v[1]);
  else return 1.0 - double(uint_to_unit(r.v[0]));
}

/// Standard normal from a Philox block (Box-Muller, its cosine half).
QUILT_HD double normal_draw(const Philox4& r) {
  const double u1 = uint2_to_unit(r.v[0], r.v[1]);
  const double u2 = uint2_to_unit(r.v[2], r.v[3]);
  return mul_rn(m_sqrt(-2.0 * m_log(u1)), m_cos(mul_rn(6.283185307179586, u2)));
}

/// An integer in [low, low + range) from a Philox block: its first 64 bits modulo range.
QUILT_HD int64_t int_draw(const Philox4& r, int64_t low, uint64_t range) {
  const uint64_t x = (static_cast<uint64_t>(r.v[0]) << 32) | r.v[1];
  return low + static_cast<int64_t>(x % range);
}

// ---- optimizer updates ----------------------------------------------------------------------

/// One element of an SGD step (kernels/cpu/optim.h's SgdHyper) in the state type S.
template <class S>
struct SgdMath {
  S lr, weight_decay, momentum, damp;  // damp = 1 - dampening
  bool first, nesterov;

  template <class S2>
  QUILT_HD SgdMath<S2> as() const {
    return {S2(lr), S2(weight_decay), S2(momentum), S2(damp), first, nesterov};
  }
  /// The new parameter from p and its gradient g; with a momentum buffer (buf non-null) buf[i]
  /// is read and updated.
  QUILT_HD S operator()(S p, S g, S* buf, int64_t i) const {
    S d = g + weight_decay * p;
    if (buf) {
      const S bi = first ? d : momentum * buf[i] + damp * d;
      buf[i] = bi;
      d = nesterov ? d + momentum * bi : bi;
    }
    return p - lr * d;
  }
};

/// One AdamW step (kernels/cpu/optim.h's AdamWHyper) with its constants in S. The three
/// updates are generic so that the CUDA kernel applies them to one element and the CPU kernel
/// to whole Eigen arrays (vectorised sqrt and division, which a scalar loop does not get:
/// std::sqrt may set errno).
template <class S>
struct AdamWMath {
  S beta1, beta2, one_beta1, one_beta2;
  S decay;         // 1 - lr * weight_decay
  S step_size;     // lr / bias_correction1
  S inv_sqrt_bc2;  // 1 / sqrt(bias_correction2)
  S eps;

  template <class S2>
  QUILT_HD AdamWMath<S2> as() const {
    return {S2(beta1), S2(beta2), S2(one_beta1), S2(one_beta2), S2(decay), S2(step_size), S2(inv_sqrt_bc2), S2(eps)};
  }
  /// The new first moment from m and the gradient g.
  template <class M, class G>
  QUILT_HD auto moment1(const M& m, const G& g) const { return beta1 * m + one_beta1 * g; }
  /// The new second moment from v and the gradient g.
  template <class V, class G>
  QUILT_HD auto moment2(const V& v, const G& g) const { return beta2 * v + one_beta2 * (g * g); }
  /// The new parameter from p, the new first moment m and the square root of the new second.
  template <class P, class M, class R>
  QUILT_HD auto param(const P& p, const M& m, const R& sqrt_v) const {
    return p * decay - step_size * m / (sqrt_v * inv_sqrt_bc2 + eps);
  }
};

}  // namespace quilt::kernels
