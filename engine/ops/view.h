// View and copy ops as free functions (the Tensor methods forward here).
// Views share storage; their backward maps the gradient back through the view.
//
//   Tensor t = permute(x, {0, 2, 1});   Tensor c = contiguous(t);
#pragma once

#include "engine/tensor.h"

namespace quilt {

Tensor view(const Tensor& x, const Shape& shape);
/// A view when the strides allow, a copy otherwise; one dim may be -1.
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor permute(const Tensor& x, const Shape& dims);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& x, int64_t dim, int64_t index);
Tensor expand(const Tensor& x, const Shape& shape);
Tensor broadcast_to(const Tensor& x, const Shape& shape);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor flatten(const Tensor& x, int64_t start = 0, int64_t end = -1);
/// A view with explicit sizes/strides/offset into x's storage (no checks beyond bounds).
Tensor as_strided(const Tensor& x, const Shape& shape, const Shape& strides, int64_t offset);
Tensor contiguous(const Tensor& x);
/// Copy with dtype/device change (differentiable; the gradient casts back).
Tensor to(const Tensor& x, DType dtype);
Tensor to(const Tensor& x, Device device, bool non_blocking = false);  // see Tensor::to
Tensor cast(const Tensor& x, DType dtype);
Tensor clone(const Tensor& x);

}  // namespace quilt
