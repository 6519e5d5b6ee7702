// Standard layers: construction (uninitialised parameters), forward in public ops, init rules.
#include "engine/nn/layers.h"

#include "engine/checkpoint.h"

#include <sstream>

#include "engine/ops/matmul.h"
#include "engine/ops/nn.h"

namespace quilt {
namespace {

TensorOptions param_options(TensorOptions opts, const char* layer) {
  QUILT_CHECK(is_floating(opts.dtype), "[", layer, "] parameters must be floating, got ", dtype_name(opts.dtype));
  opts.requires_grad = false;  // register_parameter sets it on the leaf
  return opts;
}

void check_positive(int64_t v, const char* layer, const char* what) {
  QUILT_CHECK(v > 0, "[", layer, "] ", what, " must be positive, got ", v);
}

std::string fmt_double(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

// ---- Linear ----

Linear::Linear(int64_t in, int64_t out, bool bias, TensorOptions opts)
    : Module("Linear"), in_features(in), out_features(out) {
  check_positive(in, "Linear", "in_features");
  check_positive(out, "Linear", "out_features");
  opts = param_options(opts, "Linear");
  weight_ = &register_parameter("weight", Tensor::empty({out, in}, opts));
  bias_ = &register_parameter("bias", bias ? Tensor::empty({out}, opts) : Tensor());
}

Tensor Linear::forward(const Tensor& x) { return checkpointable_linear(x, *weight_, *bias_); }

void Linear::reset_parameter(const std::string& name, Tensor& p, RngKey key) {
  if (name == "weight") init::normal_(p, key, 0.0, init_std);
  else if (name == "bias") init::zeros_(p);
  else Module::reset_parameter(name, p, key);
}

std::string Linear::extra_repr() const {
  return "in_features=" + std::to_string(in_features) + ", out_features=" + std::to_string(out_features) +
         ", bias=" + (bias_->defined() ? "true" : "false");
}

// ---- Embedding ----

Embedding::Embedding(int64_t num, int64_t dim, TensorOptions opts)
    : Module("Embedding"), num_embeddings(num), embedding_dim(dim) {
  check_positive(num, "Embedding", "num_embeddings");
  check_positive(dim, "Embedding", "embedding_dim");
  weight_ = &register_parameter("weight", Tensor::empty({num, dim}, param_options(opts, "Embedding")));
}

Tensor Embedding::forward(const Tensor& indices) { return embedding(*weight_, indices); }

void Embedding::reset_parameter(const std::string& name, Tensor& p, RngKey key) {
  if (name == "weight") init::normal_(p, key, 0.0, init_std);
  else Module::reset_parameter(name, p, key);
}

std::string Embedding::extra_repr() const {
  return "num_embeddings=" + std::to_string(num_embeddings) + ", embedding_dim=" + std::to_string(embedding_dim);
}

// ---- RMSNorm ----

RMSNorm::RMSNorm(int64_t d, double e, TensorOptions opts) : Module("RMSNorm"), dim(d), eps(e) {
  check_positive(d, "RMSNorm", "dim");
  weight_ = &register_parameter("weight", Tensor::empty({d}, param_options(opts, "RMSNorm")));
}

Tensor RMSNorm::forward(const Tensor& x) { return rms_norm(x, *weight_, eps); }

void RMSNorm::reset_parameter(const std::string& name, Tensor& p, RngKey key) {
  if (name == "weight") init::ones_(p);
  else Module::reset_parameter(name, p, key);
}

std::string RMSNorm::extra_repr() const { return "dim=" + std::to_string(dim) + ", eps=" + fmt_double(eps); }

// ---- LayerNorm ----

LayerNorm::LayerNorm(int64_t d, double e, bool affine, TensorOptions opts) : Module("LayerNorm"), dim(d), eps(e) {
  check_positive(d, "LayerNorm", "dim");
  opts = param_options(opts, "LayerNorm");
  weight_ = &register_parameter("weight", affine ? Tensor::empty({d}, opts) : Tensor());
  bias_ = &register_parameter("bias", affine ? Tensor::empty({d}, opts) : Tensor());
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, *weight_, *bias_, eps); }

void LayerNorm::reset_parameter(const std::string& name, Tensor& p, RngKey key) {
  if (name == "weight") init::ones_(p);
  else if (name == "bias") init::zeros_(p);
  else Module::reset_parameter(name, p, key);
}

std::string LayerNorm::extra_repr() const {
  return "dim=" + std::to_string(dim) + ", eps=" + fmt_double(eps) +
         ", affine=" + (weight_->defined() ? "true" : "false");
}

// ---- Dropout ----

Dropout::Dropout(double prob, Generator* gen) : Module("Dropout"), p(prob), gen_(gen) {
  QUILT_CHECK(prob >= 0.0 && prob < 1.0, "[Dropout] p must be in [0, 1), got ", prob);
}

Generator& Dropout::generator() const { return gen_ ? *gen_ : default_generator(); }

Tensor Dropout::forward(const Tensor& x) {
  // No draw in eval or at p == 0, so toggling them never shifts later masks.
  if (!is_training() || p == 0.0) return x;
  return dropout(x, p, generator(), true);
}

std::string Dropout::extra_repr() const { return "p=" + fmt_double(p); }

// ---- containers ----

const std::shared_ptr<Module>& ModuleList::operator[](size_t i) const {
  QUILT_CHECK(i < items_.size(), "[", type_name(), "] index ", i, " out of range for ", items_.size(), " modules");
  return items_[i];
}

const std::shared_ptr<Module>& ModuleDict::operator[](const std::string& key) const {
  const auto* m = items_.find(key);
  if (!m) {
    std::string known;
    for (const auto& k : items_.keys()) known += (known.empty() ? "" : ", ") + k;
    fail("[ModuleDict] no module under key '", key, "' (keys: ", known, ")");
  }
  return *m;
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& m : *this) y = (*m)(y);
  return y;
}

}  // namespace quilt
