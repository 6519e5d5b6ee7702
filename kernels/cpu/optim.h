// CPU optimizer kernels: one fused pass over memory per tensor, on raw pointers (OpenMP across
// chunks, vectorised inside), and AdamW over a list of tensors in one parallel region.
// Arithmetic is in float, or double when the state is f64.
//
//   kernels::cpu::adamw(DType::bf16, DType::bf16, DType::f32, p, g, m, v, n, hyper);
//   kernels::cpu::adamw_multi(tensors);  // same results, one region for all of them
#pragma once

#include <cstdint>
#include <span>

#include "kernels/dtype.h"
#include "kernels/elementwise_math.h"

namespace quilt::kernels::cpu {

/// One AdamW step (decoupled weight decay), with bias corrections precomputed by the caller:
///   p <- p * (1 - lr * weight_decay)
///   m <- beta1 * m + (1 - beta1) * g
///   v <- beta2 * v + (1 - beta2) * g^2
///   p <- p - (lr / bias_correction1) * m / (sqrt(v) / sqrt(bias_correction2) + eps)
struct AdamWHyper {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  double bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^t
};

/// The per-element constants of h, in double (AdamWMath::as<S>() narrows them).
inline AdamWMath<double> adamw_math(const AdamWHyper& h) {
  return {.beta1 = h.beta1, .beta2 = h.beta2, .one_beta1 = 1.0 - h.beta1, .one_beta2 = 1.0 - h.beta2,
          .decay = 1.0 - h.lr * h.weight_decay, .step_size = h.lr / h.bias_correction1,
          .inv_sqrt_bc2 = 1.0 / std::sqrt(h.bias_correction2), .eps = h.eps};
}

/// AdamW over n contiguous elements. param: param_dt (f32/bf16/f16/f64); grad: param_dt or f32;
/// m, v: state_dt (f32, or f64 with f64 params), updated in place.
void adamw(DType param_dt, DType grad_dt, DType state_dt, void* param, const void* grad, void* m, void* v,
           int64_t n, const AdamWHyper& h);

/// One tensor of a multi-tensor AdamW step: adamw()'s arguments.
struct AdamWTensor {
  DType param_dt = DType::f32, grad_dt = DType::f32, state_dt = DType::f32;
  void* param = nullptr;
  const void* grad = nullptr;
  void* m = nullptr;
  void* v = nullptr;
  int64_t n = 0;
  AdamWHyper hyper;
};

/// adamw() on every tensor of the list in one parallel region: the tensors' L1-sized blocks
/// are laid end to end and split evenly across threads, so small tensors (norm weights) share a
/// thread's work instead of each paying a region. Bit-identical to one adamw() call per tensor
/// (every block is computed by the same code at the same offsets).
void adamw_multi(std::span<const AdamWTensor> tensors);

/// One SGD step, as torch.optim.SGD defines it:
///   d <- g + weight_decay * p
///   with momentum: buf <- first ? d : momentum * buf + (1 - dampening) * d
///                  d <- nesterov ? d + momentum * buf : buf
///   p <- p - lr * d
struct SgdHyper {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  bool first = false;  // the momentum buffer is uninitialised: take d as is
};

/// The per-element constants of h, in double (SgdMath::as<S>() narrows them).
inline SgdMath<double> sgd_math(const SgdHyper& h) {
  return {.lr = h.lr, .weight_decay = h.weight_decay, .momentum = h.momentum, .damp = 1.0 - h.dampening,
          .first = h.first, .nesterov = h.nesterov};
}

/// Calls f(P{}, G{}, S{}) with P the C++ type of param_dt (a floating dtype), G P or float
/// (grad_dt is param_dt or f32) and S float or double (state_dt f32 or f64).
template <class F>
void dispatch_optim_types(DType param_dt, DType grad_dt, DType state_dt, F&& f) {
  QUILT_DISPATCH_FLOATING(param_dt, [&] {
    using P = scalar_t;
    if (state_dt == DType::f64) {
      if (grad_dt == param_dt) f(P{}, P{}, double{});
      else f(P{}, float{}, double{});
    } else {
      if (grad_dt == param_dt) f(P{}, P{}, float{});
      else f(P{}, float{}, float{});
    }
  });
}

/// SGD over n contiguous elements; `buf` (state_dt) is null when momentum == 0.
void sgd(DType param_dt, DType grad_dt, DType state_dt, void* param, const void* grad, void* buf, int64_t n,
         const SgdHyper& h);

}  // namespace quilt::kernels::cpu
