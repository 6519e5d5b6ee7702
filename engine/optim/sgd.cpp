// SGD: validates hyperparameters and calls the fused kernel (CPU) or the multi-tensor one (CUDA).
#include "engine/optim/sgd.h"

#include "engine/ops/dispatch.h"
#include "kernels/cpu/optim.h"
#include "kernels/cuda/nn.h"

namespace quilt {
namespace {

SGDOptions checked(SGDOptions o) {
  QUILT_CHECK(o.lr >= 0, "[sgd] lr must be >= 0, got ", o.lr);
  QUILT_CHECK(o.momentum >= 0, "[sgd] momentum must be >= 0, got ", o.momentum);
  QUILT_CHECK(o.weight_decay >= 0, "[sgd] weight_decay must be >= 0, got ", o.weight_decay);
  QUILT_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
              "[sgd] nesterov needs momentum > 0 and dampening 0, got momentum ", o.momentum, ", dampening ",
              o.dampening);
  return o;
}

std::vector<std::string> buffers_for(const SGDOptions& o) {
  if (o.momentum > 0) return {"momentum_buffer"};
  return {};
}

}  // namespace

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions opts)
    : Optimizer("sgd", std::move(groups), checked(opts).lr, opts.weight_decay, buffers_for(opts)), opts_(opts) {}

SGD::SGD(std::vector<Tensor> params, SGDOptions opts)
    : SGD(std::vector<ParamGroup>{ParamGroup{.params = std::move(params)}}, opts) {}

kernels::cpu::SgdHyper SGD::hyper(int64_t step, double lr, double wd) const {
  kernels::cpu::SgdHyper h;
  h.lr = lr;
  h.momentum = opts_.momentum;
  h.dampening = opts_.dampening;
  h.weight_decay = wd;
  h.nesterov = opts_.nesterov;
  h.first = step == 1;
  return h;
}

void SGD::update(Tensor& p, const Tensor& grad, std::vector<Tensor>& buffers, int64_t step, double lr,
                 double wd) {
  void* buf = buffers.empty() ? nullptr : buffers[0].data_ptr();
  const DType sdt = buffers.empty() ? state_dtype(p) : buffers[0].dtype();
  kernels::cpu::sgd(p.dtype(), grad.dtype(), sdt, p.data_ptr(), grad.data_ptr(), buf, p.numel(),
                    hyper(step, lr, wd));
}

std::vector<kernels::cuda::SgdTensor> SGD::cuda_list(std::vector<Update>& updates) const {
  std::vector<kernels::cuda::SgdTensor> list;
  list.reserve(updates.size());
  for (Update& u : updates) {
    const bool has_buf = !u.buffers.empty();
    list.push_back({.param_dt = u.param.dtype(), .grad_dt = u.grad.dtype(),
                    .state_dt = has_buf ? u.buffers[0].dtype() : state_dtype(u.param), .param = u.param.data_ptr(),
                    .grad = u.grad.data_ptr(), .buf = has_buf ? u.buffers[0].data_ptr() : nullptr,
                    .n = u.param.numel(), .hyper = hyper(u.step, u.lr, u.weight_decay)});
  }
  return list;
}

void SGD::update_all_cuda(std::vector<Update>& updates, const kernels::cuda::OptimLaunch& launch) {
  kernels::cuda::sgd_multi(cuda_list(updates), ops::stream_handle(updates.front().param.device()), launch);
}
size_t SGD::cuda_table_bytes(std::vector<Update>& updates) { return kernels::cuda::sgd_table_bytes(cuda_list(updates)); }
void SGD::stage_cuda(std::vector<Update>& updates, const kernels::cuda::StagedTable& table) {
  kernels::cuda::sgd_stage(cuda_list(updates), table);
}

}  // namespace quilt
