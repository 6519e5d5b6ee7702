// Gradient norm and clipping. The norm is computed with ops (a per-tensor reduction in f32 —
// f64 for f64 gradients — summed over tensors in f64), so distributed gradients reduce
// through the op dispatcher like any other tensor.
//
//   Tensor norm = clip_grad_norm_(model->parameters(), 1.0);
//   if (!std::isfinite(norm.item<double>())) skip_step();
#pragma once

#include <vector>

#include "engine/tensor.h"

namespace quilt {

/// The norm_type-norm of all gradients of `params` taken together, as a 0-d f64 tensor
/// (0 when no parameter has a gradient). norm_type may be any p > 0 or infinity.
Tensor grad_norm(const std::vector<Tensor>& params, double norm_type = 2.0);

/// grad_norm(), and when it exceeds max_norm, scales every gradient in place by
/// max_norm / (norm + 1e-6). A non-finite norm is returned as is and nothing is scaled,
/// so the caller can skip the step. (For distributed gradients the same rule is applied with
/// tensor ops, so no rank reads the norm on the host.)
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0);

/// The scaling step of clip_grad_norm_ for a norm computed elsewhere (a plain 0-d tensor, the
/// same on every rank): scales every gradient by max_norm / (norm + 1e-6) when the norm is
/// finite and exceeds max_norm. Returns `total`. A norm on a GPU is not read on the host: the
/// coefficient is computed and applied there (so the step can be captured in a CUDA graph).
Tensor clip_grads_to_norm_(const std::vector<Tensor>& params, const Tensor& total, double max_norm);

}  // namespace quilt
