// Standard layers on top of Module: Linear, Embedding, RMSNorm, LayerNorm, Dropout and the
// containers ModuleList, ModuleDict and Sequential. Each takes TensorOptions for the dtype/device of its
// parameters, creates them uninitialised, and says in reset_parameter() how they start:
//   Linear     weight ~ N(0, init_std = 0.02), bias = 0   (the HF `initializer_range` scheme
//              of GPT-2/Llama; chosen over kaiming-uniform because it does not depend on the
//              fan-in, which a tensor-parallel shard would otherwise need to be told)
//   Embedding  weight ~ N(0, init_std = 0.02)
//   RMSNorm / LayerNorm  weight = 1, bias = 0
//
//   auto mlp = std::make_shared<Sequential>();
//   mlp->push_back(std::make_shared<Linear>(16, 64));
//   mlp->push_back(std::make_shared<Dropout>(0.1));
//   mlp->init_weights(0);
//   Tensor y = (*mlp)(x);
#pragma once

#include <memory>
#include <vector>

#include "engine/nn/module.h"

namespace quilt {

/// y = x @ weight^T + bias; weight (out_features, in_features), bias (out_features).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  void reset_parameter(const std::string& local_name, Tensor& param, RngKey key) override;
  std::string extra_repr() const override;
  /// (out_features, in_features).
  const Tensor& weight() const { return *weight_; }
  /// (out_features), or undefined when built without bias.
  const Tensor& bias() const { return *bias_; }

  int64_t in_features, out_features;
  double init_std = 0.02;

 private:
  Tensor* weight_;
  Tensor* bias_;
};

/// Rows of weight (num_embeddings, embedding_dim) picked by integer indices.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, TensorOptions opts = {});
  /// `indices` is an i32/i64 tensor of any shape; returns indices.shape + (embedding_dim).
  Tensor forward(const Tensor& indices) override;
  void reset_parameter(const std::string& local_name, Tensor& param, RngKey key) override;
  std::string extra_repr() const override;
  /// (num_embeddings, embedding_dim).
  const Tensor& weight() const { return *weight_; }

  int64_t num_embeddings, embedding_dim;
  double init_std = 0.02;

 private:
  Tensor* weight_;
};

/// x / sqrt(mean(x^2, -1) + eps) * weight, over the last dim of size `dim`.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  void reset_parameter(const std::string& local_name, Tensor& param, RngKey key) override;
  std::string extra_repr() const override;
  const Tensor& weight() const { return *weight_; }

  int64_t dim;
  double eps;

 private:
  Tensor* weight_;
};

/// (x - mean) / sqrt(var + eps) * weight + bias over the last dim; no parameters unless `affine`.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool affine = true, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  void reset_parameter(const std::string& local_name, Tensor& param, RngKey key) override;
  std::string extra_repr() const override;
  /// Undefined when !affine.
  const Tensor& weight() const { return *weight_; }
  const Tensor& bias() const { return *bias_; }

  int64_t dim;
  double eps;

 private:
  Tensor* weight_;
  Tensor* bias_;
};

/// Zeroes elements with probability p in training (scaling the rest by 1/(1-p)); identity in
/// eval. Masks come from `gen` (non-owning; it must outlive the module) or, when null, from
/// the calling thread's default_generator() — pass the same generator to checkpoint() so a
/// recomputation draws the same masks.
class Dropout : public Module {
 public:
  explicit Dropout(double p, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  /// The generator masks are drawn from.
  Generator& generator() const;

  double p;

 private:
  Generator* gen_;
};

/// An indexable list of modules, registered as children "0", "1", ...; it has no forward.
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  /// Appends `m` (named by its position) and returns it.
  template <class M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> m) {
    register_module(std::to_string(items_.size()), m);
    items_.push_back(m);
    return m;
  }
  /// The module at index i (throws when out of range).
  const std::shared_ptr<Module>& operator[](size_t i) const;
  /// The module at index i as an M (throws when out of range or of another type).
  template <class M>
  M& at(size_t i) const {
    auto* p = dynamic_cast<M*>((*this)[i].get());
    QUILT_CHECK(p != nullptr, "[ModuleList] element ", i, " is a ", (*this)[i]->type_name(), ", not the type asked for");
    return *p;
  }
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 protected:
  explicit ModuleList(std::string type_name) : Module(std::move(type_name)) {}

 private:
  std::vector<std::shared_ptr<Module>> items_;
};

/// Modules registered under string keys, in insertion order; it has no forward. A model's
/// blocks keyed by global layer index ("4", "5", ...) keep their names when a pipeline stage
/// holds only some of them.
class ModuleDict : public Module {
 public:
  ModuleDict() : Module("ModuleDict") {}
  /// Adds `m` under `key` (a new key with no '.') and returns it.
  template <class M>
  std::shared_ptr<M> insert(const std::string& key, std::shared_ptr<M> m) {
    register_module(key, m);
    items_.insert(key, m);
    return m;
  }
  /// The module under `key` (throws naming the key when absent).
  const std::shared_ptr<Module>& operator[](const std::string& key) const;
  /// The module under `key` as an M (throws when absent or of another type).
  template <class M>
  M& at(const std::string& key) const {
    auto* p = dynamic_cast<M*>((*this)[key].get());
    QUILT_CHECK(p != nullptr, "[ModuleDict] '", key, "' is a ", (*this)[key]->type_name(), ", not the type asked for");
    return *p;
  }
  bool contains(const std::string& key) const { return items_.contains(key); }
  /// Keys in insertion order.
  std::vector<std::string> keys() const { return items_.keys(); }
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  /// (key, module) pairs in insertion order.
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  OrderedDict<std::shared_ptr<Module>> items_;
};

/// A ModuleList whose forward feeds each module's output to the next.
class Sequential : public ModuleList {
 public:
  Sequential() : ModuleList("Sequential") {}
  Tensor forward(const Tensor& x) override;
};

}  // namespace quilt
