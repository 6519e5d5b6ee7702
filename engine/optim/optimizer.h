// Optimizer: parameter groups (each with its own lr and weight decay), step(), zero_grad(),
// and a state dict of named tensors and scalars that a checkpoint saves and restores exactly.
// Updates run on each parameter's local data (data_ptr() and its .grad), so a distributed
// parameter — a tensor whose storage is this rank's shard — needs nothing special.
//
//   AdamW opt({{.params = decay_params}, {.params = norm_params, .weight_decay = 0.0}},
//             {.lr = 3e-4, .weight_decay = 0.1});
//   loss.backward();  opt.step();  opt.zero_grad();
//   OptimizerState s = opt.state_dict();   ...   opt.load_state_dict(s);
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/nn/module.h"
#include "engine/tensor.h"
#include "kernels/cuda/nn.h"

namespace quilt {

/// Parameters that share hyperparameters; unset values take the optimizer's defaults.
struct ParamGroup {
  std::vector<Tensor> params;
  std::optional<double> lr = std::nullopt;
  std::optional<double> weight_decay = std::nullopt;
};

/// What state_dict() returns and load_state_dict() takes. Keys:
///   scalars  "step", "param_groups.<g>.lr", "param_groups.<g>.weight_decay",
///            "state.<param key>.step"
///   tensors  "state.<param key>.<buffer>"  (e.g. exp_avg, exp_avg_sq, momentum_buffer)
/// A parameter's key is its Tensor::name() (the module's dotted name) when every parameter has
/// a distinct non-empty name, else its position over all groups ("0", "1", ...).
struct OptimizerState {
  OrderedDict<Tensor> tensors;
  OrderedDict<double> scalars;
};

/// Base of AdamW and SGD: owns groups, per-parameter state and the step count.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// Updates every parameter that has a gradient (others, and their state, are left alone).
  void step();
  /// Drops every parameter's .grad (or zero-fills it when !set_to_none).
  void zero_grad(bool set_to_none = true);

  /// Steps taken so far (by step() or restored by load_state_dict()).
  int64_t step_count() const { return step_count_; }
  size_t num_groups() const { return groups_.size(); }
  const std::vector<Tensor>& group_params(size_t g) const;
  double group_lr(size_t g) const;
  void set_group_lr(size_t g, double lr);
  double group_weight_decay(size_t g) const;
  void set_group_weight_decay(size_t g, double wd);
  /// Sets the lr of every group (what an LR schedule does each step).
  void set_lr(double lr);
  /// The state-dict key of parameter `i` of group `g`.
  const std::string& param_key(size_t g, size_t i) const;
  /// Named state, sharing storage with the optimizer's buffers (save it before the next step).
  OptimizerState state_dict() const;
  /// Restores state from state_dict() output. Throws one error naming every unknown key,
  /// missing buffer and shape mismatch; nothing changes then. Parameters absent from the
  /// dict start fresh.
  void load_state_dict(const OptimizerState& state);
  /// "adamw", "sgd": names the optimizer in errors.
  const char* name() const { return name_; }

  /// CUDA graphs. From now on the CUDA updates keep their tensor tables at fixed device
  /// addresses, filled inside the step from pinned host memory (so a captured step's copy
  /// reads what stage_replay() staged), and, when `skip` (a 0-d bool tensor on the parameters'
  /// device) is given, leave every tensor untouched when it holds true at update time. The
  /// first step() after this call must run eagerly: it sizes the tables.
  void prepare_graph_steps(Tensor skip = Tensor());
  /// Before each replay of a captured step(): the step's host side again (step counts + 1, the
  /// groups' current lr and weight decay) for the parameters that step updated, staged into
  /// the tables the replay copies. Nothing reading the tables may be in flight.
  void stage_replay();
  /// After a step whose update the device skipped (`skip` true): the step counts it advanced
  /// go back, as if step() had not been called.
  void unstep();

 protected:
  /// Buffers of one parameter, in buffer_names order, plus its own step count.
  struct ParamState {
    int64_t step = 0;
    std::vector<Tensor> buffers;
  };
  /// `buffer_names`: the per-parameter state tensors this optimizer keeps (zeros at start).
  Optimizer(const char* name, std::vector<ParamGroup> groups, double default_lr, double default_weight_decay,
            std::vector<std::string> buffer_names);
  /// Applies one update to local data: `param` is contiguous (the shard of a distributed
  /// parameter), `grad` contiguous with its shape and device, of its dtype or f32; `buffers`
  /// are the matching local state buffers (state_dtype); `step` counts this update (1 first).
  virtual void update(Tensor& param, const Tensor& grad, std::vector<Tensor>& buffers, int64_t step, double lr,
                      double weight_decay) = 0;
  /// One update() argument set; step() gathers those of every parameter with a gradient.
  struct Update {
    Tensor param, grad;
    std::vector<Tensor> buffers;
    int64_t step = 0;
    double lr = 0, weight_decay = 0;
  };
  /// Applies every update of one step (all groups, in parameter order). The default calls
  /// update() on each; an optimizer with a multi-tensor kernel overrides it. CPU tensors only.
  virtual void update_all(std::vector<Update>& updates);
  /// The same for parameters on one CUDA device (`updates` non-empty, all on that device):
  /// multi-tensor kernels, queued on the device's current stream, run as `launch` says (tables
  /// and skip flag under CUDA graphs). The default throws "[<name>] has no CUDA implementation".
  virtual void update_all_cuda(std::vector<Update>& updates, const kernels::cuda::OptimLaunch& launch);
  /// The bytes of update_all_cuda's tensor tables for `updates` (a staged table's size).
  virtual size_t cuda_table_bytes(std::vector<Update>& updates);
  /// Writes update_all_cuda's tables for `updates` into `table` (host side) without launching.
  virtual void stage_cuda(std::vector<Update>& updates, const kernels::cuda::StagedTable& table);
  /// Dtype of state buffers for `param`: f64 for f64 parameters, f32 otherwise (also for bf16).
  static DType state_dtype(const Tensor& param) { return param.dtype() == DType::f64 ? DType::f64 : DType::f32; }

 private:
  struct Group {
    std::vector<Tensor> params;
    std::vector<std::string> keys;
    std::vector<ParamState> state;
    double lr = 0;
    double weight_decay = 0;
  };
  // Which parameter state an update advanced.
  struct StateRef {
    Group* group;
    size_t index;
  };
  // Under CUDA graphs, per device: the staged table (pinned host and device sides) and the
  // last step's updates, which stage_replay() restages and which keep their tensors alive.
  struct GraphDevice {
    Tensor host, device;
    kernels::cuda::StagedTable table;
    std::vector<Update> updates;
    std::vector<StateRef> refs;
  };
  const Group& group(size_t g) const;
  Tensor new_buffer(const Tensor& param) const;
  kernels::cuda::OptimLaunch graph_launch(int device, std::vector<Update>& updates);

  const char* name_;
  std::vector<Group> groups_;
  std::vector<std::string> buffer_names_;
  int64_t step_count_ = 0;
  bool graph_steps_ = false;
  Tensor skip_;
  std::map<int, GraphDevice> graph_;
};

}  // namespace quilt
