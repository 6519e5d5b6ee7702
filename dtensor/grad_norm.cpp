// Gradient norms reduced over the sharded mesh axes of each gradient's own mesh.
#include "dtensor/grad_norm.h"

#include "engine/optim/clip_grad.h"

#include <cmath>
#include <limits>

#include "dtensor/dtensor.h"
#include "engine/autograd.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/reduce.h"
#include "engine/ops/unary.h"
#include "engine/ops/view.h"

namespace quilt::dtensor {
namespace {

// This rank's sum of |x|^p (or max |x| for p = inf) of a plain tensor, in f64.
double local_part(const Tensor& x, double p) {
  if (x.numel() == 0) return 0;
  Tensor v = cast(x, DType::f64);
  if (std::isinf(p)) return max(abs(v)).item<double>();
  if (p == 2.0) return sum_squares(v).item<double>();
  if (p == 1.0) return sum(abs(v)).item<double>();
  return sum(pow(abs(v), p)).item<double>();
}

struct GroupSum {
  DeviceMesh mesh;            // undefined for plain gradients
  std::vector<int64_t> axes;  // the axes to reduce over
  double value = 0;
};

}  // namespace

Tensor grad_norm(const std::vector<Tensor>& params, double norm_type, Communicator* across) {
  QUILT_CHECK(norm_type > 0, "[grad_norm] norm_type must be > 0, got ", norm_type);
  NoGradGuard ng;
  const bool inf = std::isinf(norm_type);
  auto combine = [inf](double a, double b) { return inf ? std::max(a, b) : a + b; };
  // One group per (mesh, sharded axes), in first-appearance order: the same on every rank, so
  // the reductions below are issued in the same order everywhere.
  std::vector<GroupSum> groups;
  for (const Tensor& p : params) {
    Tensor g = p.defined() ? p.grad() : Tensor();
    if (!g.defined()) continue;
    GroupSum key;
    if (g.is_distributed()) {
      Placements pl = placements_of(g);
      bool partial = false;
      for (Placement& x : pl)
        if (x.is_partial()) { x = Replicate(); partial = true; }
      if (partial) g = redistribute(g, pl);
      key.mesh = mesh_of(g);
      for (size_t a = 0; a < pl.size(); ++a)
        if (pl[a].is_shard() && key.mesh.size(int64_t(a)) > 1) key.axes.push_back(int64_t(a));
    }
    const double part = local_part(g.local(), norm_type);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const GroupSum& s) {
      return s.axes == key.axes && s.mesh.defined() == key.mesh.defined() && (!s.mesh.defined() || s.mesh == key.mesh);
    });
    if (it == groups.end()) {
      key.value = part;
      groups.push_back(std::move(key));
    } else {
      it->value = combine(it->value, part);
    }
  }
  double total = 0;
  for (GroupSum& s : groups) {
    if (!s.axes.empty()) {
      // On the communicators' own device (a CUDA tensor for NCCL meshes).
      Tensor t = full({1}, s.value, {.dtype = DType::f64, .device = s.mesh.comm(s.axes[0]).device()});
      for (int64_t a : s.axes) s.mesh.comm(a).all_reduce(t, inf ? ReduceOp::max : ReduceOp::sum);
      s.value = t.item<double>();
    }
    total = combine(total, s.value);
  }
  if (across) {
    Tensor t = full({1}, total, {.dtype = DType::f64, .device = across->device()});
    across->all_reduce(t, inf ? ReduceOp::max : ReduceOp::sum);
    total = t.item<double>();
  }
  if (!inf) total = norm_type == 1.0 ? total : norm_type == 2.0 ? std::sqrt(total) : std::pow(total, 1.0 / norm_type);
  return full({}, total, {.dtype = DType::f64});
}

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type, Communicator* across) {
  QUILT_CHECK(max_norm >= 0, "[clip_grad_norm_] max_norm must be >= 0, got ", max_norm);
  return clip_grads_to_norm_(params, grad_norm(params, norm_type, across), max_norm);
}

}  // namespace quilt::dtensor
