// Mixture-of-experts block: see moe.h.
#include "models/moe/moe.h"

#include <algorithm>
#include <cmath>

#include "dtensor/dtensor.h"
#include "engine/checkpoint.h"
#include "engine/engine.h"
#include "engine/ops/moe.h"
#include "engine/primitive.h"

namespace quilt {
namespace {

// The y = x identity whose backward also starts the gradient of a scalar loss computed
// beside it (the balance loss), so that loss reaches the router without being an output of
// the model — also inside an activation-checkpointed block, where it is recomputed.
class AddAuxLoss final : public AnyDevicePrimitive {
 public:
  explicit AddAuxLoss(double scale) : scale_(scale) {}
  const char* name() const override { return "moe_add_aux_loss"; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override { return {in[0]}; }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    Tensor g_aux;
    if (ctx.needs[1]) g_aux = full(ctx.inputs[1].shape, scale_, {.dtype = ctx.inputs[1].dtype, .device = ctx.inputs[1].device});
    return {ctx.grads[0], g_aux};
  }

 private:
  double scale_;
};

}  // namespace

void MoeOptions::validate() const {
  QUILT_CHECK(hidden_size > 0 && intermediate_size > 0, "[moe] hidden_size (", hidden_size,
              ") and moe_intermediate_size (", intermediate_size, ") must be positive");
  QUILT_CHECK(num_experts > 0 && top_k > 0 && top_k <= num_experts, "[moe] num_experts_per_tok ", top_k,
              " must be in [1, num_experts = ", num_experts, "]");
  QUILT_CHECK(n_group >= 1 && num_experts % n_group == 0, "[moe] n_group ", n_group, " must divide num_experts ",
              num_experts);
  QUILT_CHECK(topk_group >= 1 && topk_group <= n_group, "[moe] topk_group ", topk_group, " must be in [1, n_group = ",
              n_group, "]");
  QUILT_CHECK(n_group == 1 || num_experts / n_group >= 2, "[moe] group-limited routing scores a group by its top-2 "
              "experts, so each of the n_group = ", n_group, " groups needs at least 2 of the ", num_experts, " experts");
  QUILT_CHECK(n_group == 1 || top_k <= topk_group * (num_experts / n_group), "[moe] num_experts_per_tok ", top_k,
              " exceeds the experts of the topk_group = ", topk_group, " eligible groups (", topk_group, " * ",
              num_experts / n_group, ")");
  QUILT_CHECK(n_shared_experts >= 0, "[moe] n_shared_experts must be >= 0, got ", n_shared_experts);
  QUILT_CHECK(load_balance_coeff >= 0 && router_aux_loss_coef >= 0, "[moe] load_balance_coeff (", load_balance_coeff,
              ") and router_aux_loss_coef (", router_aux_loss_coef, ") must be >= 0");
}

// ---- router ----

MoeRouter::MoeRouter(const MoeOptions& o) : Module("MoeRouter"), options(o) {
  register_parameter("weight", Tensor::empty({o.num_experts, o.hidden_size}));
  // Aux-loss-free balancing needs the bias; HF checkpoints of such models carry it too.
  if (o.score_correction_bias || o.load_balance_coeff > 0)
    register_buffer("e_score_correction_bias", zeros({o.num_experts}));
  register_buffer("tokens_per_expert", zeros({o.num_experts}), /*persistent=*/false);
}

void MoeRouter::count(const Tensor& counts) {
  if (!is_training() || in_checkpoint_recompute()) return;
  NoGradGuard ng;
  Tensor& acc = buffer("tokens_per_expert");
  acc.local().add_(cast(counts, acc.dtype()));
}

void MoeRouter::reset_parameter(const std::string& name, Tensor& p, RngKey key) {
  if (name == "weight") init::normal_(p, key, 0.0, options.init_std);
  else Module::reset_parameter(name, p, key);
}

RouterOutput MoeRouter::route(const Tensor& x) {
  const MoeOptions& o = options;
  QUILT_CHECK(x.dim() == 2 && x.size(1) == o.hidden_size, "[moe router] expects tokens (N, ", o.hidden_size,
              "), got ", x.shape());
  const int64_t n = x.size(0), e = o.num_experts;
  // Scores in f32 over all experts (HF: softmax(logits, dtype=float)); f64 models keep f64.
  const DType score_dtype = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor logits = cast(linear(x, local_view(parameter("weight"))), score_dtype);
  Tensor scores = o.scoring == MoeScoring::softmax ? softmax(logits, -1) : sigmoid(logits);
  const bool has_bias = has_buffer("e_score_correction_bias");
  auto choose = [&]() -> std::vector<Tensor> {
    NoGradGuard ng;
    Tensor c = scores.detach();
    if (has_bias) c = c + cast(buffer("e_score_correction_bias").local(), score_dtype);
    if (o.n_group > 1) {
      // A group's score is the sum of its best two experts; only the best topk_group groups' experts stay eligible.
      Tensor g = c.reshape({n, o.n_group, e / o.n_group});
      Tensor group_score = sum(topk(g, 2, -1).first, {-1});
      Tensor best = topk(group_score, o.topk_group, -1).second;                       // (N, topk_group)
      const TensorOptions on{.dtype = DType::f32, .device = c.device()};
      Tensor keep = scatter_add(zeros({n, o.n_group}, on), 1, best, full(best.shape(), 1.0, on));  // 1 on eligible groups
      keep = keep.unsqueeze(-1).expand({n, o.n_group, e / o.n_group}).reshape({n, e});
      c = masked_fill(c, eq(keep, zeros_like(keep)), -INFINITY);
    }
    return {topk(c, o.top_k, -1).second};
  };
  Tensor chosen = keep_choice_for_recompute ? checkpoint_keep(choose)[0] : choose()[0];
  Tensor w = gather(scores, 1, chosen);
  if (o.norm_topk_prob) {
    Tensor denom = sum(w, {-1}, true);
    if (o.scoring == MoeScoring::sigmoid) denom = denom + 1e-20;  // sigmoid scores may all be tiny
    w = w / denom;
  }
  if (o.routed_scaling_factor != 1.0) w = w * o.routed_scaling_factor;
  return {cast(w, x.dtype()), chosen, scores};
}

// ---- experts ----

GroupedExperts::GroupedExperts(const MoeOptions& o)
    : Module("GroupedExperts"), num_experts(o.num_experts), hidden_size(o.hidden_size),
      intermediate_size(o.intermediate_size), init_std(o.init_std) {
  register_parameter("gate_proj", Tensor::empty({num_experts, intermediate_size, hidden_size}));  // (E, I, H)
  register_parameter("up_proj", Tensor::empty({num_experts, intermediate_size, hidden_size}));    // (E, I, H)
  register_parameter("down_proj", Tensor::empty({num_experts, hidden_size, intermediate_size}));  // (E, H, I)
}

void GroupedExperts::reset_parameter(const std::string& name, Tensor& p, RngKey key) {
  if (name == "gate_proj" || name == "up_proj" || name == "down_proj") init::normal_(p, key, 0.0, init_std);
  else Module::reset_parameter(name, p, key);
}

Tensor GroupedExperts::operator()(const Tensor& x, const Tensor& counts) {
  return call_with_hooks({x, counts}, [this](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{forward_grouped(in[0], in[1])};
  })[0];
}

Tensor GroupedExperts::forward_grouped(const Tensor& x, const Tensor& counts) {
  // Weights are (E, out, in) like stacked Linear weights; the grouped product reads them transposed.
  Tensor gate = local_view(parameter("gate_proj")), up = local_view(parameter("up_proj")),
         down = local_view(parameter("down_proj"));
  QUILT_CHECK(counts.dim() == 1 && counts.size(0) == gate.size(0), "[experts] counts ", counts.shape(),
              " do not match the ", gate.size(0), " experts held here");
  Tensor offsets = cumsum(counts, 0);
  Tensor h = swiglu(grouped_mm(x, gate.transpose(1, 2), offsets), grouped_mm(x, up.transpose(1, 2), offsets));
  return grouped_mm(h, down.transpose(1, 2), offsets);
}

SharedExperts::SharedExperts(int64_t hidden, int64_t intermediate, double init_std) : Module("SharedExperts") {
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(hidden, intermediate, false));
  up_proj = register_module("up_proj", std::make_shared<Linear>(hidden, intermediate, false));
  down_proj = register_module("down_proj", std::make_shared<Linear>(intermediate, hidden, false));
  for (auto* l : {gate_proj.get(), up_proj.get(), down_proj.get()}) l->init_std = init_std;
}

Tensor SharedExperts::forward(const Tensor& x) {
  // On local weights (see local_view): under tensor parallelism gate/up are column shards and
  // down a row shard, so the result is this rank's partial sum, like the routed experts'.
  auto lin = [&](Linear& l, const Tensor& in) { return linear(in, local_view(l.weight())); };
  return lin(*down_proj, swiglu(lin(*gate_proj, x), lin(*up_proj, x)));
}

// ---- the block ----

MoE::MoE(const MoeOptions& o) : Module("MoE"), options_(o) {
  o.validate();
  gate = register_module("gate", std::make_shared<MoeRouter>(o));
  experts = register_module("experts", std::make_shared<GroupedExperts>(o));
  if (o.n_shared_experts > 0)
    shared_experts = register_module(
        "shared_experts", std::make_shared<SharedExperts>(o.hidden_size, o.n_shared_experts * o.intermediate_size,
                                                          o.init_std));
}

Tensor MoE::forward(const Tensor& x) {
  QUILT_CHECK(x.dim() == 3 && x.size(-1) == options_.hidden_size, "[moe] expects (batch, seq, ", options_.hidden_size,
              "), got ", x.shape());
  if (!x.is_distributed()) return forward_local(x);
  // Tensor parallel: every tp rank routes the same (replicated) tokens and computes with its
  // shards of the experts; the output is the partial sum of the shards. The input's gradient
  // is likewise a partial sum, added up by one reduction where the layout changed.
  const DeviceMesh& mesh = mesh_of(x);
  for (const Placement& p : placements_of(x))
    QUILT_CHECK(p.is_replicate(), "[moe] a distributed input must be Replicate on its mesh, got ",
                quilt::str(placements_of(x)), " (lay it out with PrepareModuleInput)");
  Placements partial(size_t(mesh.ndim()), Partial());
  Tensor y = forward_local(to_local(x, partial));
  return from_local(y, mesh, partial, x.shape());
}

Tensor MoE::forward_local(const Tensor& x) {
  const MoeOptions& o = options_;
  const int64_t b = x.size(0), t = x.size(1), h = x.size(2), k = o.top_k;
  Tensor flat = x.reshape({b * t, h});
  RouterOutput r = gate->route(flat);
  MoeRouting order = moe_route(r.experts, o.num_experts);
  gate->count(order.counts);
  Tensor routed = (*experts)(moe_permute(flat, order.order, k), order.counts);
  Tensor y = moe_unpermute(routed, order.order, r.weights);
  if (shared_experts) y = y + (*shared_experts)(flat);
  y = y.reshape({b, t, h});
  if (o.router_aux_loss_coef > 0 && is_training()) {
    // Sequence-level balance loss (DeepSeek-V3): per sequence, sum_e f_e * P_e with f_e the
    // fraction of its token choices that went to e (scaled so even routing gives 1) and P_e the
    // mean normalised score of e; averaged over sequences, times the coefficient.
    Tensor s = r.scores.reshape({b, t, o.num_experts});
    Tensor p = mean(s / sum(s, {-1}, true), {1});  // (B, E)
    Tensor f;
    {
      NoGradGuard ng;
      f = sum(one_hot(r.experts.reshape({b, t * k}), o.num_experts, DType::f32), {1}) *
          (double(o.num_experts) / double(k * t));  // (B, E)
    }
    Tensor aux = sum(f * p) * (o.router_aux_loss_coef / double(b));
    last_aux_loss = aux.item<double>();
    y = apply1(std::make_shared<AddAuxLoss>(aux_loss_scale), {y, cast(aux, y.dtype())});
  }
  return y;
}

// ---- model-wide helpers ----

std::vector<std::pair<std::string, MoE*>> moe_blocks(Module& model) {
  std::vector<std::pair<std::string, MoE*>> out;
  for (auto& [name, m] : model.named_modules())
    if (auto* moe = dynamic_cast<MoE*>(m)) out.emplace_back(name, moe);
  return out;
}

std::vector<ExpertStack> expert_stacks(Module& model) {
  std::vector<ExpertStack> out;
  for (auto& [name, moe] : moe_blocks(model))
    for (const char* w : {"gate_proj", "up_proj", "down_proj"})
      out.push_back({name + ".experts." + w, name + ".experts.{}." + w + ".weight", moe->options().num_experts});
  return out;
}

void set_moe_aux_loss_scale(Module& model, double scale) {
  for (auto& [name, moe] : moe_blocks(model)) moe->aux_loss_scale = scale;
}

double update_moe_load_balance(Module& model) {
  NoGradGuard ng;
  double worst = 0;
  for (auto& [name, moe] : moe_blocks(model)) {
    MoeRouter& r = *moe->gate;
    if (r.options.load_balance_coeff <= 0) continue;
    Tensor& bias = r.buffer("e_score_correction_bias");
    Tensor& counts = r.buffer("tokens_per_expert");
    Tensor global = counts.local().clone();
    if (bias.is_distributed()) {
      // The bias is Replicate over the ranks that see different tokens: their counts are the
      // Partial parts of the global load, added up once.
      const DeviceMesh& mesh = mesh_of(bias);
      global = redistribute(from_local(global, mesh, Placements(size_t(mesh.ndim()), Partial())),
                            Placements(size_t(mesh.ndim()), Replicate()))
                   .local();
    }
    const Tensor m = mean(global);
    const double mean_count = m.item<double>();
    if (mean_count <= 0) continue;  // no tokens routed since the last step: nothing to learn from
    worst = std::max(worst, max(global).item<double>() / mean_count);
    Tensor step = sign(m - global) * r.options.load_balance_coeff;
    Tensor b = bias.local() + step;
    bias.local().copy_(b - mean(b));
    counts.local().zero_();
  }
  return worst;
}

}  // namespace quilt
