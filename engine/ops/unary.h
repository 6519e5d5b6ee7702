// Elementwise unary ops; each differentiable one has its backward beside it in unary.cpp.
//
//   Tensor y = silu(x) * gelu(x);
#pragma once

#include "engine/tensor.h"

namespace quilt {

Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
/// x * sigmoid(x).
Tensor silu(const Tensor& x);
/// Exact GELU: x * Phi(x).
Tensor gelu(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor abs(const Tensor& x);
/// -1, 0 or 1 (zero gradient).
Tensor sign(const Tensor& x);
Tensor sin(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor square(const Tensor& x);
/// Logical not (bool result).
Tensor logical_not(const Tensor& x);
/// True where x is finite, false at NaN and ±inf (bool result; integers are all finite).
Tensor isfinite(const Tensor& x);
/// d gelu(x) / dx (used by gelu's backward).
Tensor gelu_grad(const Tensor& x);

Tensor operator-(const Tensor& x);

}  // namespace quilt
