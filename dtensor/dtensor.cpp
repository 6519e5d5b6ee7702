// distribute_tensor, from_local, to_local, full_tensor and redistribute as differentiable
// primitives of dtensor/ (the dispatcher runs their dist_forward directly).
#include "dtensor/dtensor.h"

#include "dtensor/dispatch.h"
#include "dtensor/redistribute.h"
#include "dtensor/sharding.h"
#include "engine/autograd.h"
#include "engine/ops/creation.h"
#include "engine/ops/view.h"

namespace quilt {
namespace {

using detail::DistPrimitive;

std::shared_ptr<const DistSpec> make_spec(const DeviceMesh& mesh, const Placements& placements, const Shape& shape) {
  return std::make_shared<const DistSpec>(mesh, placements, shape);
}

// Partial axes become Replicate: the gradient of a Partial tensor is the same on every piece.
Placements grad_target(const Placements& p) {
  Placements out = p;
  for (Placement& x : out)
    if (x.is_partial()) x = Replicate();
  return out;
}

// A plain gradient seeded for a distributed output is taken as replicated.
Tensor as_distributed(const Tensor& g, const DistSpec& like) {
  if (!g.defined() || g.is_distributed()) return g;
  return Tensor::make_distributed(g, make_spec(like.mesh, replicated(size_t(like.mesh.ndim())), g.shape()), g.shape());
}

class Redistribute final : public DistPrimitive {
 public:
  explicit Redistribute(Placements dst) : dst_(std::move(dst)) {}
  const char* name() const override { return "redistribute"; }
  std::vector<Tensor> dist_forward(const std::vector<Tensor>& in) override {
    const DistSpec& src = dist_spec_of(in[0], "redistribute");
    Tensor local = redistribute_local(in[0].local(), src, dst_);
    return {Tensor::make_distributed(local, make_spec(src.mesh, dst_, src.shape), src.shape)};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const DistSpec& src = *ctx.inputs[0].dist;
    return {redistribute(as_distributed(ctx.grads[0], src), grad_target(src.placements))};
  }
  Attrs attrs() const override { return {{"placements", str(dst_)}}; }

 private:
  Placements dst_;
};

class Distribute final : public DistPrimitive {
 public:
  Distribute(DeviceMesh mesh, Placements placements) : mesh_(std::move(mesh)), placements_(std::move(placements)) {}
  const char* name() const override { return "distribute_tensor"; }
  std::vector<Tensor> dist_forward(const std::vector<Tensor>& in) override {
    const Tensor& full = in[0];
    const DistSpec src(mesh_, replicated(size_t(mesh_.ndim())), full.shape());
    Tensor local = redistribute_local(full, src, placements_);
    return {Tensor::make_distributed(local, make_spec(mesh_, placements_, full.shape()), full.shape())};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    return {g.is_distributed() ? full_tensor(g) : g};
  }
  Attrs attrs() const override { return {{"placements", str(placements_)}}; }

 private:
  DeviceMesh mesh_;
  Placements placements_;
};

class FromLocal final : public DistPrimitive {
 public:
  explicit FromLocal(std::shared_ptr<const DistSpec> spec) : spec_(std::move(spec)) {}
  const char* name() const override { return "from_local"; }
  std::vector<Tensor> dist_forward(const std::vector<Tensor>& in) override {
    return {Tensor::make_distributed(in[0].detach(), spec_, spec_->shape)};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    Tensor g = redistribute(as_distributed(ctx.grads[0], *spec_), grad_target(spec_->placements));
    return {to_local(g)};
  }
  Attrs attrs() const override { return {{"placements", str(spec_->placements)}, {"shape", spec_->shape}}; }

 private:
  std::shared_ptr<const DistSpec> spec_;
};

class ToLocal final : public DistPrimitive {
 public:
  explicit ToLocal(std::optional<Placements> grad_placements) : grad_placements_(std::move(grad_placements)) {}
  const char* name() const override { return "to_local"; }
  std::vector<Tensor> dist_forward(const std::vector<Tensor>& in) override {
    // A fresh handle over the shard's storage: the caller's graph must not attach to the shard.
    return {in[0].local().detach()};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const DistSpec& src = *ctx.inputs[0].dist;
    const Placements pl = grad_placements_ ? *grad_placements_ : src.placements;
    return {from_local(ctx.grads[0], src.mesh, pl, src.shape)};
  }

 private:
  std::optional<Placements> grad_placements_;
};

}  // namespace

Tensor distribute_tensor(const Tensor& full, const DeviceMesh& mesh, const Placements& placements) {
  QUILT_CHECK(full.defined(), "[distribute_tensor] got an undefined tensor");
  QUILT_CHECK(mesh.defined(), "[distribute_tensor] got an undefined mesh");
  const Placements pl = normalize_placements(placements, full.dim(), "distribute_tensor");
  QUILT_CHECK(int64_t(pl.size()) == mesh.ndim(), "[distribute_tensor] ", pl.size(), " placements ", str(pl),
              " for the ", mesh.ndim(), "-D mesh ", mesh.str());
  if (full.is_distributed()) {
    QUILT_CHECK(mesh_of(full) == mesh, "[distribute_tensor] the tensor is already distributed over ",
                mesh_of(full).str(), ", not ", mesh.str());
    return redistribute(full, pl);
  }
  (void)DistSpec(mesh, pl, full.shape());  // validates before any communication
  return apply1(std::make_shared<Distribute>(mesh, pl), {full});
}

Tensor from_local(const Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                  const std::optional<Shape>& shape) {
  QUILT_CHECK(local.defined() && !local.is_distributed(), "[from_local] needs a plain local tensor");
  QUILT_CHECK(mesh.defined(), "[from_local] got an undefined mesh");
  const Placements pl = normalize_placements(placements, local.dim(), "from_local");
  QUILT_CHECK(int64_t(pl.size()) == mesh.ndim(), "[from_local] ", pl.size(), " placements ", str(pl), " for the ",
              mesh.ndim(), "-D mesh ", mesh.str());
  Shape global = shape ? *shape : local.shape();
  if (!shape) {
    // Innermost axis first: its group holds the pieces of one outer piece, so their sum is
    // that piece's length; the next axis out then sums those.
    NoGradGuard ng;
    for (int64_t a = mesh.ndim() - 1; a >= 0; --a) {
      std::vector<int64_t> dims;
      for (int64_t d = 0; d < local.dim(); ++d)
        if (pl[size_t(a)].is_shard(d)) dims.push_back(d);
      if (dims.empty() || mesh.size(a) == 1) continue;
      std::vector<double> lens;
      for (int64_t d : dims) lens.push_back(double(global[size_t(d)]));
      Tensor t = from_vector(lens, {int64_t(lens.size())}, {.dtype = DType::i64, .device = mesh.comm(a).device()});
      mesh.comm(a).all_reduce(t, ReduceOp::sum);
      const std::vector<double> sums = t.to_vector();
      for (size_t i = 0; i < dims.size(); ++i) global[size_t(dims[i])] = int64_t(sums[i]);
    }
  }
  auto spec = make_spec(mesh, pl, global);
  QUILT_CHECK(local.shape() == spec->local_shape(), "[from_local] rank ", mesh.rank(), " (coordinate ",
              mesh.coordinate(), "): local shape ", local.shape(), " is not the shard ", str(pl), " gives it of global shape ",
              global, " (expected ", spec->local_shape(), ")");
  return apply1(std::make_shared<FromLocal>(spec), {local});
}

Tensor to_local(const Tensor& x, const std::optional<Placements>& grad_placements) {
  QUILT_CHECK(x.defined(), "[to_local] got an undefined tensor");
  if (!x.is_distributed()) return x;
  return apply1(std::make_shared<ToLocal>(grad_placements), {x});
}

Tensor full_tensor(const Tensor& x) {
  QUILT_CHECK(x.defined(), "[full_tensor] got an undefined tensor");
  if (!x.is_distributed()) return x;
  const DistSpec& s = *x.dist_spec();
  return to_local(redistribute(x, replicated(s.placements.size())));
}

Tensor redistribute(const Tensor& x, const Placements& placements) {
  const DistSpec& s = dist_spec_of(x, "redistribute");
  const Placements pl = normalize_placements(placements, x.dim(), "redistribute");
  QUILT_CHECK(pl.size() == s.placements.size(), "[redistribute] ", pl.size(), " placements ", str(pl), " for the ",
              s.mesh.ndim(), "-D mesh ", s.mesh.str());
  if (pl == s.placements) return x;
  (void)DistSpec(s.mesh, pl, s.shape);  // validates the target before any communication
  return apply1(std::make_shared<Redistribute>(pl), {x});
}

const DeviceMesh& mesh_of(const Tensor& x) { return dist_spec_of(x, "mesh_of").mesh; }
const Placements& placements_of(const Tensor& x) { return dist_spec_of(x, "placements_of").placements; }

bool has_placements(const Tensor& x, const Placements& placements) {
  if (!x.defined() || !x.is_distributed()) return false;
  if (placements.size() != x.dist_spec()->placements.size()) return false;
  return normalize_placements(placements, x.dim(), "has_placements") == x.dist_spec()->placements;
}

Tensor local_view(const Tensor& param) {
  if (!param.is_distributed()) return param;
  Placements grad = placements_of(param);
  for (Placement& pl : grad)
    if (pl.is_replicate()) pl = Partial();
  return to_local(param, grad);
}

}  // namespace quilt
