// SGD with optional momentum, dampening, Nesterov momentum and (coupled, L2) weight decay,
// as torch.optim.SGD computes it. The momentum buffer is f32 (f64 for f64 parameters).
//
//   SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9, .nesterov = true});
#pragma once

#include "engine/optim/optimizer.h"
#include "kernels/cpu/optim.h"

namespace quilt {

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

/// Per step, with g the gradient:
///   d <- g + wd * p
///   momentum > 0: buf <- (first step) ? d : momentum * buf + (1 - dampening) * d
///                 d <- nesterov ? d + momentum * buf : buf
///   p <- p - lr * d
/// State buffer (when momentum > 0): "momentum_buffer". CPU and CUDA (multi-tensor,
/// kernels::cuda::sgd_multi).
class SGD : public Optimizer {
 public:
  SGD(std::vector<ParamGroup> groups, SGDOptions opts = {});
  /// One group holding `params`.
  SGD(std::vector<Tensor> params, SGDOptions opts = {});
  const SGDOptions& options() const { return opts_; }

 protected:
  void update(Tensor& param, const Tensor& grad, std::vector<Tensor>& buffers, int64_t step, double lr,
              double weight_decay) override;
  void update_all_cuda(std::vector<Update>& updates, const kernels::cuda::OptimLaunch& launch) override;
  size_t cuda_table_bytes(std::vector<Update>& updates) override;
  void stage_cuda(std::vector<Update>& updates, const kernels::cuda::StagedTable& table) override;

 private:
  kernels::cpu::SgdHyper hyper(int64_t step, double lr, double weight_decay) const;
  /// The CUDA kernels' list for `updates`.
  std::vector<kernels::cuda::SgdTensor> cuda_list(std::vector<Update>& updates) const;
  SGDOptions opts_;
};

}  // namespace quilt
