// Elementwise binary ops with NumPy broadcasting and type promotion, comparisons, where.
// A Python-style scalar operand takes the tensor's dtype.
//
//   Tensor y = where(mask, a * 2.0, b - a);
#pragma once

#include "engine/tensor.h"

namespace quilt {

/// Result dtype of a binary op on two tensors (float beats int beats bool; wider wins).
DType promote_types(DType a, DType b);

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, double exponent);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);
/// cond ? a : b elementwise (cond is bool; all three broadcast).
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
/// x with `value` where mask is true.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
/// Scalar broadcast to `like`'s dtype and device as a 0-d tensor.
Tensor scalar_like(double v, const Tensor& like);
/// Sums `grad` over broadcast dims so it has `shape` (the backward of broadcasting).
Tensor sum_to(const Tensor& grad, const Shape& shape);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);

}  // namespace quilt
