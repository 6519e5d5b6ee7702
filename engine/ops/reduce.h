// Reductions over some dims or all of them. Empty `dims` = every dim.
//
//   Tensor m = mean(x, {-1}, /*keepdim=*/true);
#pragma once

#include "engine/tensor.h"

namespace quilt {

/// Sum over `dims` (all when empty); ints sum in i64, floats in their own dtype.
Tensor sum(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
/// Maximum over `dims`; the gradient is split evenly between tied maxima.
Tensor max(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
Tensor min(const Tensor& x, const Shape& dims = {}, bool keepdim = false);
/// Index of the first maximum along `dim` (i64).
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
/// Index of the first maximum of the flattened tensor (0-d i64).
Tensor argmax(const Tensor& x);
/// Sum of squares, in float64 for accuracy of gradient norms (returns x's dtype).
Tensor sum_squares(const Tensor& x);

}  // namespace quilt
