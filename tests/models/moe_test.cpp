// The MoE decoder: Hugging Face Qwen3-MoE semantics against an independent float64 reference
// written here, DeepSeek-V3 router options, aux-loss-free balancing, routing kept under
// activation checkpointing.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "engine/checkpoint.h"
#include "engine/engine.h"
#include "models/llama/llama.h"
#include "models/moe/moe.h"

using namespace quilt;

namespace {

using Vec = std::vector<double>;
using Weights = std::map<std::string, std::pair<Shape, Vec>>;  // HF name -> (shape, row-major values)

// A Qwen3-MoE of 2 layers: layer 0 dense (mlp_only_layers), layer 1 sparse with 4 experts, top 2.
LlamaConfig tiny_qwen3_moe() {
  LlamaConfig c;
  c.model_type = "qwen3_moe";
  c.qk_norm = true;
  c.hidden_size = 16;
  c.intermediate_size = 20;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.vocab_size = 24;
  c.max_position_embeddings = 32;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 6;
  c.norm_topk_prob = true;
  c.mlp_only_layers = {0};
  return c;
}

// Fixed numbers: a smooth function of the tensor's name and the element's index.
Vec fixed_values(const std::string& name, int64_t n, double scale, double offset) {
  double h = 0;
  for (char ch : name) h = std::fmod(h * 31.0 + double(static_cast<unsigned char>(ch)), 1000.0);
  Vec v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = offset + scale * std::sin(0.37 * double(i) + 0.011 * h + 0.5);
  return v;
}

Weights hf_weights(const LlamaConfig& c) {
  Weights w;
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_attention_heads, Hk = c.num_key_value_heads;
  auto add = [&](const std::string& n, Shape s, double scale = 0.3, double offset = 0.0) {
    w[n] = {s, fixed_values(n, numel_of(s), scale, offset)};
  };
  add("model.embed_tokens.weight", {c.vocab_size, H}, 1.0);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H}, 0.1, 1.0);
    add(p + "post_attention_layernorm.weight", {H}, 0.1, 1.0);
    add(p + "self_attn.q_proj.weight", {Hq * D, H});
    add(p + "self_attn.k_proj.weight", {Hk * D, H});
    add(p + "self_attn.v_proj.weight", {Hk * D, H});
    add(p + "self_attn.o_proj.weight", {H, Hq * D});
    add(p + "self_attn.q_norm.weight", {D}, 0.1, 1.0);
    add(p + "self_attn.k_norm.weight", {D}, 0.1, 1.0);
    if (c.is_sparse_layer(l)) {
      add(p + "mlp.gate.weight", {c.num_experts, H}, 0.8);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
        add(q + "gate_proj.weight", {c.moe_intermediate_size, H});
        add(q + "up_proj.weight", {c.moe_intermediate_size, H});
        add(q + "down_proj.weight", {H, c.moe_intermediate_size});
      }
    } else {
      add(p + "mlp.gate_proj.weight", {c.intermediate_size, H});
      add(p + "mlp.up_proj.weight", {c.intermediate_size, H});
      add(p + "mlp.down_proj.weight", {H, c.intermediate_size});
    }
  }
  add("model.norm.weight", {H}, 0.1, 1.0);
  add("lm_head.weight", {c.vocab_size, H});
  return w;
}

// ---- the float64 reference: one sequence at a time, plain loops ----

// y (rows, out) = x (rows, in) @ W^T for W (out, in).
Vec lin(const Vec& x, int64_t rows, const Vec& W, int64_t out, int64_t in) {
  Vec y(size_t(rows * out), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < in; ++i) s += x[size_t(r * in + i)] * W[size_t(o * in + i)];
      y[size_t(r * out + o)] = s;
    }
  return y;
}

// RMSNorm of each run of `d` values.
Vec rms(const Vec& x, const Vec& w, int64_t d, double eps) {
  Vec y(x.size());
  for (size_t r = 0; r < x.size() / size_t(d); ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += x[r * size_t(d) + size_t(i)] * x[r * size_t(d) + size_t(i)];
    const double inv = 1.0 / std::sqrt(ss / double(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[r * size_t(d) + size_t(i)] = x[r * size_t(d) + size_t(i)] * inv * w[size_t(i)];
  }
  return y;
}

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// SwiGLU MLP of rows x (rows, H) with HF weights gate/up (I, H), down (H, I).
Vec swiglu_mlp(const Vec& x, int64_t rows, const Vec& g, const Vec& u, const Vec& d, int64_t H, int64_t I) {
  Vec a = lin(x, rows, g, I, H), b = lin(x, rows, u, I, H);
  for (size_t i = 0; i < a.size(); ++i) a[i] = silu(a[i]) * b[i];
  return lin(a, rows, d, H, I);
}

// Mean next-token cross entropy of the model on tokens (B, T) against targets (B, T).
double reference_loss(const LlamaConfig& c, const Weights& W, const std::vector<int64_t>& tok,
                      const std::vector<int64_t>& tgt, int64_t B, int64_t T) {
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_attention_heads, Hk = c.num_key_value_heads;
  const int64_t V = c.vocab_size, E = c.num_experts, K = c.num_experts_per_tok, Im = c.moe_intermediate_size;
  auto w = [&](const std::string& n) -> const Vec& { return W.at(n).second; };
  double total = 0;
  for (int64_t b = 0; b < B; ++b) {
    Vec h(static_cast<size_t>(T * H));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < H; ++i) h[size_t(t * H + i)] = w("model.embed_tokens.weight")[size_t(tok[size_t(b * T + t)] * H + i)];
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      const Vec a = rms(h, w(p + "input_layernorm.weight"), H, c.rms_norm_eps);
      Vec q = rms(lin(a, T, w(p + "self_attn.q_proj.weight"), Hq * D, H), w(p + "self_attn.q_norm.weight"), D, c.rms_norm_eps);
      Vec k = rms(lin(a, T, w(p + "self_attn.k_proj.weight"), Hk * D, H), w(p + "self_attn.k_norm.weight"), D, c.rms_norm_eps);
      const Vec v = lin(a, T, w(p + "self_attn.v_proj.weight"), Hk * D, H);
      // Rotary embedding, rotate-half pairs (i, i + D/2) at position t.
      auto rope = [&](Vec& x, int64_t heads) {
        for (int64_t t = 0; t < T; ++t)
          for (int64_t hh = 0; hh < heads; ++hh)
            for (int64_t i = 0; i < D / 2; ++i) {
              const double f = double(t) * std::pow(c.rope_theta, -2.0 * double(i) / double(D));
              double& x0 = x[size_t((t * heads + hh) * D + i)];
              double& x1 = x[size_t((t * heads + hh) * D + i + D / 2)];
              const double r0 = x0 * std::cos(f) - x1 * std::sin(f), r1 = x1 * std::cos(f) + x0 * std::sin(f);
              x0 = r0;
              x1 = r1;
            }
      };
      rope(q, Hq);
      rope(k, Hk);
      Vec att(size_t(T * Hq * D), 0.0);
      for (int64_t hh = 0; hh < Hq; ++hh) {
        const int64_t kv = hh / (Hq / Hk);
        for (int64_t t = 0; t < T; ++t) {
          Vec s(static_cast<size_t>(t + 1));
          double mx = -INFINITY;
          for (int64_t j = 0; j <= t; ++j) {
            double d = 0;
            for (int64_t i = 0; i < D; ++i) d += q[size_t((t * Hq + hh) * D + i)] * k[size_t((j * Hk + kv) * D + i)];
            s[size_t(j)] = d / std::sqrt(double(D));
            mx = std::max(mx, s[size_t(j)]);
          }
          double z = 0;
          for (double& e : s) z += (e = std::exp(e - mx));
          for (int64_t j = 0; j <= t; ++j)
            for (int64_t i = 0; i < D; ++i)
              att[size_t((t * Hq + hh) * D + i)] += s[size_t(j)] / z * v[size_t((j * Hk + kv) * D + i)];
        }
      }
      const Vec o = lin(att, T, w(p + "self_attn.o_proj.weight"), H, Hq * D);
      for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
      const Vec m = rms(h, w(p + "post_attention_layernorm.weight"), H, c.rms_norm_eps);
      Vec y(size_t(T * H), 0.0);
      if (!c.is_sparse_layer(l)) {
        y = swiglu_mlp(m, T, w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"), w(p + "mlp.down_proj.weight"),
                       H, c.intermediate_size);
      } else {
        const Vec logits = lin(m, T, w(p + "mlp.gate.weight"), E, H);
        for (int64_t t = 0; t < T; ++t) {
          // HF Qwen3-MoE: softmax over all experts, top-k, renormalised over the k, weighted sum.
          Vec pr(static_cast<size_t>(E));
          double mx = -INFINITY, z = 0;
          for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[size_t(t * E + e)]);
          for (int64_t e = 0; e < E; ++e) z += (pr[size_t(e)] = std::exp(logits[size_t(t * E + e)] - mx));
          for (double& x : pr) x /= z;
          std::vector<int64_t> idx(static_cast<size_t>(E));
          std::iota(idx.begin(), idx.end(), 0);
          std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b2) { return pr[size_t(a)] > pr[size_t(b2)]; });
          double norm = 0;
          for (int64_t j = 0; j < K; ++j) norm += pr[size_t(idx[size_t(j)])];
          const Vec row(m.begin() + t * H, m.begin() + (t + 1) * H);
          for (int64_t j = 0; j < K; ++j) {
            const int64_t e = idx[size_t(j)];
            const std::string q2 = p + "mlp.experts." + std::to_string(e) + ".";
            const Vec ye = swiglu_mlp(row, 1, w(q2 + "gate_proj.weight"), w(q2 + "up_proj.weight"),
                                      w(q2 + "down_proj.weight"), H, Im);
            const double g = c.norm_topk_prob ? pr[size_t(e)] / norm : pr[size_t(e)];
            for (int64_t i = 0; i < H; ++i) y[size_t(t * H + i)] += g * ye[size_t(i)];
          }
        }
      }
      for (size_t i = 0; i < h.size(); ++i) h[i] += y[i];
    }
    const Vec logits = lin(rms(h, w("model.norm.weight"), H, c.rms_norm_eps), T, w("lm_head.weight"), V, H);
    for (int64_t t = 0; t < T; ++t) {
      double mx = -INFINITY, z = 0;
      for (int64_t v2 = 0; v2 < V; ++v2) mx = std::max(mx, logits[size_t(t * V + v2)]);
      for (int64_t v2 = 0; v2 < V; ++v2) z += std::exp(logits[size_t(t * V + v2)] - mx);
      total += std::log(z) + mx - logits[size_t(t * V + tgt[size_t(b * T + t)])];
    }
  }
  return total / double(B * T);
}

std::filesystem::path temp_file(const std::string& stem) {
  return std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(::getpid()) + ".safetensors");
}

void save_hf(const Weights& w, const std::filesystem::path& path) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [name, sv] : w) tensors.emplace_back(name, from_vector(sv.second, sv.first));
  save_safetensors(path.string(), tensors, {{"format", "pt"}});
}

// The gradient of our grouped or plain parameter that corresponds to HF tensor `hf` at flat index i.
double our_grad(LlamaForCausalLM& m, const std::string& hf, int64_t i) {
  const std::string tag = ".mlp.experts.";
  const size_t at = hf.find(tag);
  if (at == std::string::npos) return m.parameter(hf).grad().to_vector()[size_t(i)];
  // model.layers.L.mlp.experts.E.gate_proj.weight -> model.layers.L.mlp.experts.gate_proj [E]
  const std::string rest = hf.substr(at + tag.size());
  const size_t dot = rest.find('.');
  const int64_t e = std::stoll(rest.substr(0, dot));
  const std::string w = rest.substr(dot + 1, rest.rfind(".weight") - dot - 1);
  const Tensor g = m.parameter(hf.substr(0, at + tag.size()) + w).grad();
  const int64_t per = g.numel() / g.size(0);
  return g.to_vector()[size_t(e * per + i)];
}

}  // namespace

TEST_CASE("moe: a Qwen3-MoE checkpoint gives the loss and gradients of an independent float64 reference") {
  const LlamaConfig cfg = tiny_qwen3_moe();
  const Weights w = hf_weights(cfg);
  const auto path = temp_file("quilt_qwen3_moe");
  save_hf(w, path);
  const int64_t B = 2, T = 5;
  const std::vector<int64_t> tok = {3, 17, 5, 9, 22, 0, 11, 11, 4, 19}, tgt = {17, 5, 9, 22, 1, 11, 11, 4, 19, 7};
  const double want = reference_loss(cfg, w, tok, tgt, B, T);

  LlamaForCausalLM m(cfg);
  CHECK(m.model->layers->at<LlamaDecoderLayer>("0").mlp->type_name() == "LlamaMLP");
  CHECK(m.model->layers->at<LlamaDecoderLayer>("1").mlp->type_name() == "MoE");
  m.to(DType::f64);
  load_hf_weights(m, path.string());
  std::filesystem::remove(path);
  Tensor tokens = from_vector(std::vector<double>(tok.begin(), tok.end()), {B, T}, {.dtype = DType::i64});
  Tensor targets = from_vector(std::vector<double>(tgt.begin(), tgt.end()), {B, T}, {.dtype = DType::i64});
  Tensor loss = cross_entropy(m(tokens).reshape({-1, cfg.vocab_size}), targets.reshape({-1}));
  loss.backward();
  // The float64 model agrees to ~1e-9 relative (its kernels sum in another order, and a few
  // constants pass through f32); any semantic difference would show at 1e-3 or more.
  CAPTURE(loss.item<double>() - want);
  CHECK(loss.item<double>() == doctest::Approx(want).epsilon(1e-8));

  // Gradients: central differences of the reference at a spread of elements of every HF tensor.
  int checked = 0;
  double worst = 0;
  for (const auto& [name, sv] : w) {
    const int64_t n = int64_t(sv.second.size());
    for (int64_t i : {int64_t(0), n / 3, (2 * n) / 3, n - 1}) {
      Weights plus = w, minus = w;
      const double eps = 1e-6;
      plus[name].second[size_t(i)] += eps;
      minus[name].second[size_t(i)] -= eps;
      const double fd = (reference_loss(cfg, plus, tok, tgt, B, T) - reference_loss(cfg, minus, tok, tgt, B, T)) / (2 * eps);
      const double got = our_grad(m, name, i);
      worst = std::max(worst, std::abs(got - fd) / std::max(1.0, std::abs(fd)));
      ++checked;
    }
  }
  CHECK(checked == 4 * int(w.size()));
  CHECK(worst < 1e-7);

  // The f32 model gives the same loss within f32 rounding.
  LlamaForCausalLM m32(cfg);
  save_hf(w, path);
  load_hf_weights(m32, path.string());
  std::filesystem::remove(path);
  Tensor l32 = cross_entropy(m32(tokens).reshape({-1, cfg.vocab_size}), targets.reshape({-1}));
  CHECK(l32.item<double>() == doctest::Approx(want).epsilon(1e-5));
}

TEST_CASE("moe: norm_topk_prob false keeps the softmax values of the chosen experts as their weights") {
  MoeOptions o{.hidden_size = 8, .num_experts = 4, .top_k = 2, .intermediate_size = 4, .norm_topk_prob = false};
  MoeRouter r(o);
  r.init_weights(5);
  Tensor x = randn({6, 8}, RngKey(1, "x"));
  RouterOutput out = r.route(x);
  Tensor p = softmax(linear(x, r.parameter("weight")), -1);
  CHECK(max(abs(out.weights - gather(p, 1, out.experts))).item<double>() < 1e-7);
  // The chosen ones are the two largest, largest first.
  CHECK(max(abs(gather(p, 1, out.experts) - topk(p, 2, -1).first)).item<double>() == 0.0);
}

TEST_CASE("moe: DeepSeek-V3 routing (sigmoid, group-limited, correction bias, scaling) matches a float64 reference") {
  MoeOptions o{.hidden_size = 8, .num_experts = 8, .top_k = 2, .intermediate_size = 4, .norm_topk_prob = true,
               .scoring = MoeScoring::sigmoid, .n_group = 4, .topk_group = 2, .routed_scaling_factor = 2.5,
               .score_correction_bias = true};
  MoeRouter r(o);
  r.init_weights(6);
  r.to(DType::f64);
  const Vec bias = {0.3, -0.2, 0.0, 0.1, -0.4, 0.25, 0.05, -0.1};
  r.buffer("e_score_correction_bias").copy_(from_vector(bias, {8}));
  const int64_t N = 16;
  Tensor x = randn({N, 8}, RngKey(2, "x"), {.dtype = DType::f64});
  RouterOutput out = r.route(x);
  const Vec logits = linear(x, r.parameter("weight")).to_vector();
  const std::vector<double> chosen = out.experts.to_vector(), weights = out.weights.to_vector();
  for (int64_t t = 0; t < N; ++t) {
    Vec s(8), c(8);
    for (int e = 0; e < 8; ++e) {
      s[size_t(e)] = 1.0 / (1.0 + std::exp(-logits[size_t(t * 8 + e)]));
      c[size_t(e)] = s[size_t(e)] + bias[size_t(e)];
    }
    // Groups of 2: score = sum of the group's top-2 (here both); keep the best 2 groups.
    std::vector<int> g = {0, 1, 2, 3};
    std::stable_sort(g.begin(), g.end(), [&](int a, int b) { return c[size_t(2 * a)] + c[size_t(2 * a + 1)] > c[size_t(2 * b)] + c[size_t(2 * b + 1)]; });
    std::vector<int> eligible = {2 * g[0], 2 * g[0] + 1, 2 * g[1], 2 * g[1] + 1};
    std::stable_sort(eligible.begin(), eligible.end());
    std::stable_sort(eligible.begin(), eligible.end(), [&](int a, int b) { return c[size_t(a)] > c[size_t(b)]; });
    const int e0 = eligible[0], e1 = eligible[1];
    CHECK(int(chosen[size_t(t * 2)]) == e0);
    CHECK(int(chosen[size_t(t * 2 + 1)]) == e1);
    // Weights from the scores without the bias, renormalised, scaled.
    const double z = s[size_t(e0)] + s[size_t(e1)] + 1e-20;
    CHECK(weights[size_t(t * 2)] == doctest::Approx(2.5 * s[size_t(e0)] / z).epsilon(1e-12));
    CHECK(weights[size_t(t * 2 + 1)] == doctest::Approx(2.5 * s[size_t(e1)] / z).epsilon(1e-12));
  }
}

TEST_CASE("moe: the correction bias changes which experts are chosen, never their weights") {
  MoeOptions o{.hidden_size = 8, .num_experts = 4, .top_k = 1, .intermediate_size = 4, .norm_topk_prob = false,
               .score_correction_bias = true};
  MoeRouter r(o);
  r.init_weights(7);
  Tensor x = randn({32, 8}, RngKey(3, "x"));
  RouterOutput a = r.route(x);
  // A large bias on expert 3 sends every token there; its weight is still expert 3's own softmax value.
  r.buffer("e_score_correction_bias").copy_(from_vector(Vec{0, 0, 0, 10}, {4}));
  RouterOutput b = r.route(x);
  CHECK(min(b.experts).item<double>() == 3.0);
  Tensor p = softmax(linear(x, r.parameter("weight")), -1);
  CHECK(max(abs(b.weights - p.narrow(1, 3, 1))).item<double>() < 1e-7);
  CHECK(max(abs(a.weights - gather(p, 1, a.experts))).item<double>() < 1e-7);
}

TEST_CASE("moe: shared experts add a dense SwiGLU of every token to the routed sum") {
  MoeOptions o{.hidden_size = 8, .num_experts = 4, .top_k = 2, .intermediate_size = 4, .n_shared_experts = 2};
  MoE with(o);
  with.init_weights(8);
  CHECK(with.parameter("shared_experts.gate_proj.weight").shape() == Shape{8, 8});
  Tensor x = randn({2, 3, 8}, RngKey(4, "x"));
  Tensor y = with(x);
  Tensor flat = x.reshape({6, 8});
  Tensor shared = (*with.shared_experts)(flat);
  // Routed part alone, by the block's own pieces.
  RouterOutput r = with.gate->route(flat);
  Tensor routed = zeros({6, 8});
  const Vec chosen = r.experts.to_vector();
  for (int64_t t = 0; t < 6; ++t)
    for (int64_t j = 0; j < 2; ++j) {
      const int64_t e = int64_t(chosen[size_t(t * 2 + j)]);
      auto wt = [&](const char* n) { return with.parameter(std::string("experts.") + n).select(0, e); };
      Tensor row = flat.narrow(0, t, 1);
      Tensor ye = linear(swiglu(linear(row, wt("gate_proj")), linear(row, wt("up_proj"))), wt("down_proj"));
      routed = index_add(routed, 0, full({1}, double(t), {.dtype = DType::i64}), ye * r.weights.narrow(0, t, 1).narrow(1, j, 1));
    }
  CHECK(max(abs(y.reshape({6, 8}) - (routed + shared))).item<double>() < 1e-5);
}

TEST_CASE("moe: aux-loss-free balancing evens out a skewed router's load, once per step") {
  MoeOptions o{.hidden_size = 8, .num_experts = 4, .top_k = 1, .intermediate_size = 4, .load_balance_coeff = 0.002};
  MoE moe(o);
  moe.init_weights(9);
  // Skew: expert 0's router row aligned with the inputs' mean direction.
  Tensor w = moe.gate->parameter("weight");
  {
    NoGradGuard ng;
    w.narrow(0, 0, 1).fill_(0.5);
  }
  Tensor x = randn({1, 64, 8}, RngKey(10, "x")) + 0.5;
  moe(x);
  const double first = update_moe_load_balance(moe);
  CHECK(first > 2.0);  // most of the 64 tokens on one expert
  // Counts were reset, and a step without a forward moves nothing.
  CHECK(sum(moe.gate->buffer("tokens_per_expert")).item<double>() == 0.0);
  const Vec before = moe.gate->buffer("e_score_correction_bias").to_vector();
  CHECK(update_moe_load_balance(moe) == 0.0);
  CHECK(moe.gate->buffer("e_score_correction_bias").to_vector() == before);
  // The sign steps overshoot and come back, so the load is judged over the last steps.
  double late = 0;
  for (int step = 0; step < 200; ++step) {
    moe(x);
    const double load = update_moe_load_balance(moe);
    if (step >= 180) late += load / 20;
  }
  CHECK(late < 1.5);
  CHECK(late < first / 2);
  // The bias stays centred.
  CHECK(std::abs(sum(moe.gate->buffer("e_score_correction_bias")).item<double>()) < 1e-5);
  // Two forwards before one step count both (micro-batches), and evaluation counts nothing.
  moe(x);
  moe(x);
  CHECK(sum(moe.gate->buffer("tokens_per_expert")).item<double>() == 128.0);
  moe.eval();
  moe(x);
  CHECK(sum(moe.gate->buffer("tokens_per_expert")).item<double>() == 128.0);
}

TEST_CASE("moe: one balancing step after two micro-batches steps the bias once, from their summed counts") {
  MoeOptions o{.hidden_size = 8, .num_experts = 4, .top_k = 2, .intermediate_size = 4, .load_balance_coeff = 0.01};
  MoE moe(o);
  moe.init_weights(15);
  moe(randn({2, 5, 8}, RngKey(16, "a")));
  moe(randn({2, 5, 8}, RngKey(16, "b")));
  const Vec counts = moe.gate->buffer("tokens_per_expert").to_vector();
  CHECK(std::accumulate(counts.begin(), counts.end(), 0.0) == 2 * 10 * 2);
  update_moe_load_balance(moe);
  // The expected bias: one sign step of 0.01 from the summed counts, recentred.
  const double m = std::accumulate(counts.begin(), counts.end(), 0.0) / 4;
  Vec want(4);
  double mean_step = 0;
  for (int e = 0; e < 4; ++e) mean_step += (want[size_t(e)] = 0.01 * double((m > counts[size_t(e)]) - (m < counts[size_t(e)]))) / 4;
  const Vec got = moe.gate->buffer("e_score_correction_bias").to_vector();
  for (int e = 0; e < 4; ++e) CHECK(got[size_t(e)] == doctest::Approx(want[size_t(e)] - mean_step).epsilon(1e-6));
}

TEST_CASE("moe: a checkpoint missing an expert is refused, naming the expert") {
  const LlamaConfig cfg = tiny_qwen3_moe();
  Weights w = hf_weights(cfg);
  w.erase("model.layers.1.mlp.experts.2.up_proj.weight");
  const auto path = temp_file("quilt_qwen3_moe_missing");
  save_hf(w, path);
  LlamaForCausalLM m(cfg);
  CHECK_THROWS_WITH(load_hf_weights(m, path.string()),
                    doctest::Contains("'model.layers.1.mlp.experts.2.up_proj.weight' (expert 2 of "
                                      "'model.layers.1.mlp.experts.up_proj') is not in"));
  std::filesystem::remove(path);
}

TEST_CASE("moe: under activation checkpointing the router's choice is kept, counted once, and gradients are bit-identical") {
  MoeOptions o{.hidden_size = 8, .num_experts = 4, .top_k = 2, .intermediate_size = 4, .load_balance_coeff = 0.01};
  auto grads_of = [&](bool ac) {
    MoE moe(o);
    moe.init_weights(11);
    Tensor x = randn({2, 6, 8}, RngKey(12, "x")).set_requires_grad(true);
    Tensor y = ac ? checkpoint([&](const Tensor& in) { return moe(in); }, x) : moe(x);
    (y * y).sum().backward();
    std::vector<Vec> g;
    for (const Tensor& p : moe.parameters()) g.push_back(p.grad().to_vector());
    g.push_back(x.grad().to_vector());
    g.push_back(moe.gate->buffer("tokens_per_expert").to_vector());
    return g;
  };
  const auto plain = grads_of(false), with_ac = grads_of(true);
  REQUIRE(plain.size() == with_ac.size());
  for (size_t i = 0; i < plain.size(); ++i) CHECK(plain[i] == with_ac[i]);
}

TEST_CASE("moe: the sequence-level balance loss reaches the router, scaled as the step asks") {
  MoeOptions o{.hidden_size = 8, .num_experts = 4, .top_k = 2, .intermediate_size = 4, .router_aux_loss_coef = 0.1};
  auto router_grad = [&](double coef, double scale) {
    MoeOptions oo = o;
    oo.router_aux_loss_coef = coef;
    MoE moe(oo);
    moe.init_weights(13);
    moe.aux_loss_scale = scale;
    moe(randn({2, 6, 8}, RngKey(14, "x"))).sum().backward();
    return std::make_pair(moe.gate->parameter("weight").grad(), moe.last_aux_loss);
  };
  auto [g0, a0] = router_grad(0.0, 1.0);
  auto [g1, a1] = router_grad(0.1, 1.0);
  auto [g2, a2] = router_grad(0.1, 0.5);
  CHECK(a0 == 0.0);
  CHECK(a1 > 0.0);
  CHECK(a1 == a2);
  // The aux part of the gradient halves with the scale.
  CHECK(max(abs((g2 - g0) * 2.0 - (g1 - g0))).item<double>() < 1e-6);
  CHECK(max(abs(g1 - g0)).item<double>() > 1e-6);
}

TEST_CASE("moe: bad router options are refused naming the field") {
  auto msg = [](MoeOptions o) {
    try {
      o.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  MoeOptions o{.hidden_size = 8, .num_experts = 8, .top_k = 2, .intermediate_size = 4};
  MoeOptions a = o;
  a.top_k = 9;
  CHECK(msg(a).find("num_experts_per_tok 9") != std::string::npos);
  MoeOptions b = o;
  b.n_group = 3;
  CHECK(msg(b).find("n_group 3 must divide num_experts 8") != std::string::npos);
  MoeOptions c = o;
  c.n_group = 4;
  c.topk_group = 5;
  CHECK(msg(c).find("topk_group 5") != std::string::npos);
  LlamaConfig l = tiny_qwen3_moe();
  l.mlp_only_layers = {7};
  CHECK_THROWS_WITH(l.validate(), doctest::Contains("mlp_only_layers names layer 7"));
}

TEST_CASE("moe: config.json round-trips the MoE fields, and layers are sparse as Qwen3-MoE and DeepSeek-V3 say") {
  LlamaConfig c = tiny_qwen3_moe();
  c.num_hidden_layers = 6;
  c.mlp_only_layers = {4};
  c.decoder_sparse_step = 2;
  c.first_k_dense_replace = 2;
  const LlamaConfig back = LlamaConfig::from_json(c.to_json());
  CHECK(back.model_type == "qwen3_moe");
  CHECK(back.qk_norm);
  CHECK(back.num_experts == 4);
  CHECK(back.mlp_only_layers == std::vector<int64_t>{4});
  std::vector<int64_t> sparse;
  for (int64_t l = 0; l < 6; ++l)
    if (back.is_sparse_layer(l)) sparse.push_back(l);
  CHECK(sparse == std::vector<int64_t>{3, 5});  // odd layers (step 2), from layer 2, not 4
  CHECK_THROWS_WITH(LlamaConfig::from_json(R"({"model_type": "mixtral"})"), doctest::Contains("model_type 'mixtral'"));
}
