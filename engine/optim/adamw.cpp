// AdamW: validates hyperparameters, computes bias corrections, calls the fused kernel (CPU)
// or the multi-tensor one (CUDA).
#include "engine/optim/adamw.h"

#include <cmath>

#include "engine/ops/dispatch.h"
#include "kernels/cpu/optim.h"
#include "kernels/cuda/nn.h"

namespace quilt {
namespace {

AdamWOptions checked(AdamWOptions o) {
  QUILT_CHECK(o.lr >= 0, "[adamw] lr must be >= 0, got ", o.lr);
  QUILT_CHECK(o.beta1 >= 0 && o.beta1 < 1, "[adamw] beta1 must be in [0, 1), got ", o.beta1);
  QUILT_CHECK(o.beta2 >= 0 && o.beta2 < 1, "[adamw] beta2 must be in [0, 1), got ", o.beta2);
  QUILT_CHECK(o.eps >= 0, "[adamw] eps must be >= 0, got ", o.eps);
  QUILT_CHECK(o.weight_decay >= 0, "[adamw] weight_decay must be >= 0, got ", o.weight_decay);
  return o;
}

}  // namespace

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions opts)
    : Optimizer("adamw", std::move(groups), checked(opts).lr, opts.weight_decay, {"exp_avg", "exp_avg_sq"}),
      opts_(opts) {}

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions opts)
    : AdamW(std::vector<ParamGroup>{ParamGroup{.params = std::move(params)}}, opts) {}

kernels::cpu::AdamWHyper AdamW::hyper(int64_t step, double lr, double wd) const {
  kernels::cpu::AdamWHyper h;
  h.lr = lr;
  h.beta1 = opts_.beta1;
  h.beta2 = opts_.beta2;
  h.eps = opts_.eps;
  h.weight_decay = wd;
  h.bias_correction1 = 1.0 - std::pow(opts_.beta1, double(step));
  h.bias_correction2 = 1.0 - std::pow(opts_.beta2, double(step));
  return h;
}

void AdamW::update(Tensor& p, const Tensor& grad, std::vector<Tensor>& buffers, int64_t step, double lr,
                   double wd) {
  Tensor& m = buffers[0];
  Tensor& v = buffers[1];
  kernels::cpu::adamw(p.dtype(), grad.dtype(), m.dtype(), p.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(),
                      p.numel(), hyper(step, lr, wd));
}

std::vector<kernels::cpu::AdamWTensor> AdamW::tensor_list(std::vector<Update>& updates) const {
  std::vector<kernels::cpu::AdamWTensor> list;
  list.reserve(updates.size());
  for (Update& u : updates) {
    Tensor& m = u.buffers[0];
    Tensor& v = u.buffers[1];
    list.push_back({.param_dt = u.param.dtype(), .grad_dt = u.grad.dtype(), .state_dt = m.dtype(),
                    .param = u.param.data_ptr(), .grad = u.grad.data_ptr(), .m = m.data_ptr(), .v = v.data_ptr(),
                    .n = u.param.numel(), .hyper = hyper(u.step, u.lr, u.weight_decay)});
  }
  return list;
}

void AdamW::update_all(std::vector<Update>& updates) { kernels::cpu::adamw_multi(tensor_list(updates)); }

void AdamW::update_all_cuda(std::vector<Update>& updates, const kernels::cuda::OptimLaunch& launch) {
  kernels::cuda::adamw_multi(tensor_list(updates), ops::stream_handle(updates.front().param.device()), launch);
}
size_t AdamW::cuda_table_bytes(std::vector<Update>& updates) {
  return kernels::cuda::adamw_table_bytes(tensor_list(updates));
}
void AdamW::stage_cuda(std::vector<Update>& updates, const kernels::cuda::StagedTable& table) {
  kernels::cuda::adamw_stage(tensor_list(updates), table);
}

}  // namespace quilt
