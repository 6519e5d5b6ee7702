// AdamW (Loshchilov & Hutter): Adam with decoupled weight decay and bias correction, as
// torch.optim.AdamW computes it. Moments m and v are kept in f32 even for bf16/f16 parameters
// (f64 for f64 ones); a step updates every parameter in one fused pass and one parallel region
// over all of them (kernels::cpu::adamw_multi).
//
//   AdamW opt(model->parameters(), {.lr = 3e-4, .beta2 = 0.95, .weight_decay = 0.1});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include "engine/optim/optimizer.h"
#include "kernels/cpu/optim.h"

namespace quilt {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

/// Per step t (per parameter, counting its own updates), with g the gradient:
///   p <- p * (1 - lr * wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
///   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
/// State buffers: "exp_avg" (m), "exp_avg_sq" (v). CPU and CUDA (one multi-tensor launch per
/// dtype combination, kernels::cuda::adamw_multi).
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> groups, AdamWOptions opts = {});
  /// One group holding `params`.
  AdamW(std::vector<Tensor> params, AdamWOptions opts = {});
  const AdamWOptions& options() const { return opts_; }

 protected:
  void update(Tensor& param, const Tensor& grad, std::vector<Tensor>& buffers, int64_t step, double lr,
              double weight_decay) override;
  void update_all(std::vector<Update>& updates) override;
  void update_all_cuda(std::vector<Update>& updates, const kernels::cuda::OptimLaunch& launch) override;
  size_t cuda_table_bytes(std::vector<Update>& updates) override;
  void stage_cuda(std::vector<Update>& updates, const kernels::cuda::StagedTable& table) override;

 private:
  kernels::cpu::AdamWHyper hyper(int64_t step, double lr, double weight_decay) const;
  /// The multi-tensor kernels' list for `updates` (the CPU and CUDA kernels take the same one).
  std::vector<kernels::cpu::AdamWTensor> tensor_list(std::vector<Update>& updates) const;
  AdamWOptions opts_;
};

}  // namespace quilt
