// A tiny Llama and one forward + backward step, shared by the parallelism tests: every
// layout's logits, loss and gradients (as full tensors) compare against the one-rank run.
#pragma once

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "engine/engine.h"
#include "models/llama/llama.h"

namespace quilt::test {

/// 2 layers, hidden 32, 4 heads over 2 kv heads of 8, intermediate 48, vocab 50, seq <= 64.
inline LlamaConfig tiny_llama(bool tie = false) {
  LlamaConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 50;
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = tie;
  return c;
}

/// What one step produced, as plain values.
struct StepResult {
  std::vector<double> logits;
  double loss = 0;
  std::map<std::string, std::vector<double>> grads;  // by parameter name
  bool logits_distributed = false;
};

/// Forward at positions 0..T-1, mean cross entropy against `targets`, backward (then
/// `after_backward`, e.g. waiting for data-parallel reductions); logits and gradients gathered whole.
inline StepResult llama_step(LlamaForCausalLM& model, const Tensor& tokens, const Tensor& targets,
                             const std::function<void()>& after_backward = {}) {
  StepResult r;
  Tensor logits = model(tokens, arange(0, double(tokens.size(1))));
  r.logits_distributed = logits.is_distributed();
  Tensor loss = cross_entropy(logits.reshape({-1, model.config().vocab_size}), targets.reshape({-1}));
  loss.backward();
  if (after_backward) after_backward();
  r.logits = full_tensor(logits).to_vector();
  r.loss = full_tensor(loss).item<double>();
  for (auto& [name, p] : model.named_parameters())
    if (p.grad().defined()) r.grads[name] = full_tensor(p.grad()).to_vector();
  return r;
}

/// Largest |a - b| (infinity when the sizes differ).
inline double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

/// The worst difference over logits, loss and every gradient (infinity when a gradient is missing).
inline double worst_diff(const StepResult& a, const StepResult& b) {
  double w = std::max(max_diff(a.logits, b.logits), std::fabs(a.loss - b.loss));
  if (a.grads.size() != b.grads.size()) return INFINITY;
  for (const auto& [name, g] : a.grads) {
    auto it = b.grads.find(name);
    w = std::max(w, it == b.grads.end() ? INFINITY : max_diff(g, it->second));
  }
  return w;
}

}  // namespace quilt::test
