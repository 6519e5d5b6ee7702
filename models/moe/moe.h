// A mixture-of-experts feed-forward block (Qwen3-MoE / DeepSeek-V3 style), the `mlp` of a
// sparse decoder layer, named as Hugging Face names its weights:
//   mlp.gate.weight (E, H)                       the router
//   mlp.gate.e_score_correction_bias (E)         aux-loss-free balancing bias (a buffer)
//   mlp.experts.{gate,up}_proj (E, I, H), mlp.experts.down_proj (E, H, I)
//                                                routed experts as grouped tensors; HF stores
//                                                them per expert: mlp.experts.{e}.gate_proj.weight
//   mlp.shared_experts.{gate,up,down}_proj.weight  a dense SwiGLU on every token (DeepSeek-V3)
//
// The router scores every expert (softmax in f32 over all experts, or sigmoid), picks top-k
// (optionally within the best groups), and the chosen experts' outputs are summed with the
// scores as weights (renormalised over the k when norm_topk_prob, times routed_scaling_factor).
// The correction bias only changes which experts are chosen, never the weights.
//
//   MoeOptions o{.hidden_size = 64, .num_experts = 8, .top_k = 2, .intermediate_size = 32};
//   auto moe = std::make_shared<MoE>(o);
//   Tensor y = (*moe)(x);                         // x (B, T, H) -> (B, T, H)
//   ... optimizer.step(); update_moe_load_balance(*model);   // once per optimizer step
//
// Under tensor parallelism the block takes a Replicate input on the tp mesh and returns a
// Partial output (the plan lays it out again): everything inside runs on this rank's shards.
// Under expert parallelism the experts module's hooks move tokens to the ranks that hold
// their experts (parallel/expert_parallel).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtensor/mesh.h"
#include "engine/nn/layers.h"
#include "engine/nn/module.h"

namespace quilt {

/// How router scores are made from the logits.
enum class MoeScoring { softmax, sigmoid };

struct MoeOptions {
  int64_t hidden_size = 0;
  int64_t num_experts = 8;
  int64_t top_k = 2;
  int64_t intermediate_size = 0;  // of each routed expert
  bool norm_topk_prob = true;     // renormalise the k chosen scores to sum to 1
  MoeScoring scoring = MoeScoring::softmax;
  int64_t n_group = 1;            // group-limited routing: experts in n_group groups ...
  int64_t topk_group = 1;         // ... of which the best topk_group (by the sum of their top-2) are eligible
  double routed_scaling_factor = 1.0;
  int64_t n_shared_experts = 0;   // shared SwiGLU of intermediate n_shared_experts * intermediate_size
  bool score_correction_bias = false;  // a persistent e_score_correction_bias buffer
  double load_balance_coeff = 0.0;     // aux-loss-free bias step per optimizer step; 0: off
  double router_aux_loss_coef = 0.0;   // sequence-level balance loss weight; 0: off
  double init_std = 0.02;
  /// Throws naming the field when the options are inconsistent.
  void validate() const;
};

/// What the router decided for N tokens.
struct RouterOutput {
  Tensor weights;  // (N, k) in the input's dtype: the chosen experts' gate values (differentiable)
  Tensor experts;  // (N, k) i64: the chosen experts
  Tensor scores;   // (N, E) f32 (f64 for f64 inputs): every expert's score (for the balance loss)
};

class MoeRouter : public Module {
 public:
  explicit MoeRouter(const MoeOptions& o);
  /// Routes x (N, H).
  RouterOutput route(const Tensor& x);
  /// Adds the tokens a routing sent to each expert (counts (E), as moe_route gives them) to
  /// tokens_per_expert, in training mode and outside activation-checkpoint recomputation.
  void count(const Tensor& counts);
  void reset_parameter(const std::string& local_name, Tensor& param, RngKey key) override;
  /// Keep the expert choice of the first forward for activation-checkpoint recomputation
  /// (moe.ignore_router_for_ac): the recomputed dispatch then equals the forward's.
  bool keep_choice_for_recompute = true;
  MoeOptions options;
};

/// Routed experts as three grouped tensors (E, out, in), like E stacked nn.Linear weights.
class GroupedExperts : public Module {
 public:
  explicit GroupedExperts(const MoeOptions& o);
  /// x (M, H): rows grouped by expert, counts (E_local) i64 rows per expert -> (M, H);
  /// through the module's hooks (expert parallelism moves rows there).
  Tensor operator()(const Tensor& x, const Tensor& counts);
  using Module::operator();
  /// The computation without the hooks: SwiGLU of each row with its expert's weights.
  Tensor forward_grouped(const Tensor& x, const Tensor& counts);
  void reset_parameter(const std::string& local_name, Tensor& param, RngKey key) override;
  int64_t num_experts, hidden_size, intermediate_size;
  double init_std;
};

/// The shared experts (DeepSeek-V3): one SwiGLU MLP that every token goes through.
class SharedExperts : public Module {
 public:
  SharedExperts(int64_t hidden, int64_t intermediate, double init_std);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
};

class MoE : public Module {
 public:
  explicit MoE(const MoeOptions& o);
  /// x (B, T, H) -> (B, T, H), plain, or a Replicate distributed tensor on a tp mesh (then the
  /// output is Partial on that mesh).
  Tensor forward(const Tensor& x) override;
  const MoeOptions& options() const { return options_; }
  /// The sequence-level balance loss of the last forward (0 when off), for logs.
  double last_aux_loss = 0.0;
  /// The balance loss's gradient is this times its value's (the step sets 1/micro-batches so it
  /// is scaled as the language-model loss is).
  double aux_loss_scale = 1.0;
  std::shared_ptr<MoeRouter> gate;
  std::shared_ptr<GroupedExperts> experts;
  std::shared_ptr<SharedExperts> shared_experts;  // null without shared experts

 private:
  Tensor forward_local(const Tensor& x);
  MoeOptions options_;
};

/// The HF names of grouped expert tensors in `model` as (our name, HF per-expert pattern with
/// "{}" for the expert, expert count), e.g. ("model.layers.1.mlp.experts.gate_proj",
/// "model.layers.1.mlp.experts.{}.gate_proj.weight", 8).
struct ExpertStack {
  std::string name, pattern;
  int64_t count = 0;
};
std::vector<ExpertStack> expert_stacks(Module& model);

/// Every MoE block of `model` with its dotted name.
std::vector<std::pair<std::string, MoE*>> moe_blocks(Module& model);

/// The aux-loss-free balancing step, once per optimizer step: for each router with
/// load_balance_coeff > 0, the tokens it sent to each expert since the last call are summed
/// over the mesh its bias is replicated on (the plan puts it Replicate over every rank that
/// sees different tokens, dp x cp; a plain bias: this rank only) and its bias steps
/// b += coeff * sign(mean - count), recentred to zero mean, so every rank applies the same
/// step from the global load. Resets the counts. Returns the largest (max count / mean count)
/// over the routers before the step (1 is perfectly even; 0 without any router counting).
double update_moe_load_balance(Module& model);

/// Sets MoE::aux_loss_scale on every block.
void set_moe_aux_loss_scale(Module& model, double scale);

}  // namespace quilt
