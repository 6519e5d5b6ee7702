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

// This rank's sum of |x|^p (or max |x| for p = inf) of a plain tensor, as a 0-d f64 tensor on
// x's device: no host read, so a GPU step is not drained once per parameter.
Tensor local_part(const Tensor& x, double p) {
  if (x.numel() == 0) return zeros({}, {.dtype = DType::f64, .device = x.device()});
  Tensor v = cast(x, DType::f64);
  if (std::isinf(p)) return max(abs(v));
  if (p == 2.0) return sum_squares(v);
  if (p == 1.0) return sum(abs(v));
  return sum(pow(abs(v), p));
}

// a + b, or max(a, b) for the inf-norm (NaN kept), in f64 as the host sum did.
Tensor combine(const Tensor& a, const Tensor& b, bool inf) { return inf ? maximum(a, b) : add(a, b); }

// All-reduces a 0-d value over `comm` on the communicator's device; returns it there.
Tensor reduced(const Tensor& value, Communicator& comm, bool inf) {
  Tensor t = value.reshape({1}).to(comm.device()).clone();
  comm.all_reduce(t, inf ? ReduceOp::max : ReduceOp::sum);
  return t.reshape({});
}

struct GroupSum {
  DeviceMesh mesh;            // undefined for plain gradients
  std::vector<int64_t> axes;  // the axes to reduce over
  Tensor value;               // 0-d f64
};

}  // namespace

Tensor grad_norm(const std::vector<Tensor>& params, double norm_type, Communicator* across) {
  QUILT_CHECK(norm_type > 0, "[grad_norm] norm_type must be > 0, got ", norm_type);
  NoGradGuard ng;
  const bool inf = std::isinf(norm_type);
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
    Tensor part = local_part(g.local(), norm_type);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const GroupSum& s) {
      return s.axes == key.axes && s.mesh.defined() == key.mesh.defined() && (!s.mesh.defined() || s.mesh == key.mesh);
    });
    if (it == groups.end()) {
      key.value = part;
      groups.push_back(std::move(key));
    } else {
      it->value = combine(it->value, part, inf);
    }
  }
  // The host read happens once, by the caller (item()), or never (a captured CUDA step).
  Tensor total;
  for (GroupSum& s : groups) {
    for (int64_t a : s.axes) s.value = reduced(s.value, s.mesh.comm(a), inf);
    total = total.defined() ? combine(total, s.value.to(total.device()), inf) : s.value;
  }
  if (!total.defined()) total = zeros({}, {.dtype = DType::f64, .device = across ? across->device() : Device::cpu()});
  if (across) total = reduced(total, *across, inf);
  if (inf || norm_type == 1.0) return total;
  return norm_type == 2.0 ? sqrt(total) : pow(total, 1.0 / norm_type);
}

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type, Communicator* across) {
  QUILT_CHECK(max_norm >= 0, "[clip_grad_norm_] max_norm must be >= 0, got ", max_norm);
  return clip_grads_to_norm_(params, grad_norm(params, norm_type, across), max_norm);
}

}  // namespace quilt::dtensor
