// Gradient norm from ops; clipping scales gradients in place.
#include "engine/optim/clip_grad.h"

#include <cmath>

#include "engine/autograd.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/reduce.h"
#include "engine/ops/unary.h"
#include "engine/ops/view.h"

namespace quilt {

Tensor grad_norm(const std::vector<Tensor>& params, double norm_type) {
  QUILT_CHECK(norm_type > 0, "[grad_norm] norm_type must be > 0, got ", norm_type);
  NoGradGuard ng;
  const bool inf = std::isinf(norm_type);
  Tensor total;
  Device dev = Device::cpu();
  for (const Tensor& p : params) {
    Tensor g = p.defined() ? p.grad() : Tensor();
    if (!g.defined() || g.numel() == 0) continue;
    dev = g.device();
    // Reduce each tensor in f32 (bf16/f16 are widened first), then combine in f64.
    Tensor x = g.dtype() == DType::f64 || g.dtype() == DType::f32 ? g : cast(g, DType::f32);
    Tensor part;
    if (inf) part = max(abs(x));
    else if (norm_type == 2.0) part = sum_squares(x);
    else if (norm_type == 1.0) part = sum(abs(x));
    else part = sum(pow(abs(x), norm_type));
    part = cast(part, DType::f64);
    if (!total.defined()) total = part;
    else total = inf ? maximum(total, part) : add(total, part);
  }
  if (!total.defined()) return zeros({}, {.dtype = DType::f64, .device = dev});
  if (inf || norm_type == 1.0) return total;
  if (norm_type == 2.0) return sqrt(total);
  return pow(total, 1.0 / norm_type);
}

namespace {

// Scales every gradient by a coefficient computed on the norm's own device (1 when the norm is
// within bounds or not finite): no host read, for a norm that lives on several ranks or on a GPU.
Tensor clip_on_device(const std::vector<Tensor>& params, const Tensor& total, double max_norm) {
  if (std::isinf(max_norm)) return total;  // no clipping: the gradients are left alone
  NoGradGuard ng;
  Tensor clip = logical_and(isfinite(total), gt(total, scalar_like(max_norm, total)));
  Tensor coef = where(clip, max_norm / (total + 1e-6), ones_like(total));
  for (const Tensor& p : params) {
    Tensor g = p.defined() ? p.grad() : Tensor();
    if (!g.defined()) continue;
    // A plain norm scales each gradient's local shard (as mul_ does); a distributed one, the whole.
    if (!total.is_distributed() && g.is_distributed()) g = g.local();
    g.copy_(g * cast(coef, g.dtype()));
  }
  return total;
}

}  // namespace

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  QUILT_CHECK(max_norm >= 0, "[clip_grad_norm_] max_norm must be >= 0, got ", max_norm);
  Tensor total = grad_norm(params, norm_type);
  if (total.is_distributed()) return clip_on_device(params, total, max_norm);
  return clip_grads_to_norm_(params, total, max_norm);
}

Tensor clip_grads_to_norm_(const std::vector<Tensor>& params, const Tensor& total, double max_norm) {
  if (total.device().is_cuda()) return clip_on_device(params, total, max_norm);
  const double norm = total.item<double>();
  if (!std::isfinite(norm) || norm <= max_norm) return total;
  const double coef = max_norm / (norm + 1e-6);
  NoGradGuard ng;
  for (const Tensor& p : params) {
    Tensor g = p.defined() ? p.grad() : Tensor();
    if (g.defined()) g.mul_(coef);  // a distributed gradient scales its local shard
  }
  return total;
}

}  // namespace quilt
