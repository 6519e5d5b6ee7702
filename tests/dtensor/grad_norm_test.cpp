// Gradient norms over distributed parameters on several meshes: every Shard axis is reduced —
// the expert axis of MoE weights included — and no Replicate axis is.
#include <doctest/doctest.h>

#include "dtensor/grad_norm.h"
#include "tests/dtensor/util.h"

using namespace quilt;

namespace {
double norm_of(const std::vector<Tensor>& full_grads, double p) {
  double acc = 0;
  for (const Tensor& g : full_grads)
    for (double v : g.to_vector()) acc = std::isinf(p) ? std::max(acc, std::fabs(v)) : acc + std::pow(std::fabs(v), p);
  return std::isinf(p) ? acc : std::pow(acc, 1.0 / p);
}
}  // namespace

TEST_CASE("grad_norm: expert weights sharded over the ep axis are reduced over it, replicas are not") {
  run_threads_group(4, [](Communicator& c) {
    DeviceMesh mesh(c.shared_from_this(), {2, 2}, {"dp", "ep"});
    // Experts (4, 3, 5): experts over ep, FSDP-sharded over dp; a dense weight FSDP-sharded over
    // dp only (replicated over ep), on its own 1-D mesh; an expert bias on the ep mesh; a plain
    // replicated norm weight.
    Tensor ge = randn({4, 3, 5}, RngKey(9, "ge"), {.dtype = DType::f64});
    Tensor gd = randn({7, 3}, RngKey(9, "gd"), {.dtype = DType::f64});
    Tensor gb = randn({4, 5}, RngKey(9, "gb"), {.dtype = DType::f64});
    Tensor gn = randn({3}, RngKey(9, "gn"), {.dtype = DType::f64});
    auto param = [](const Tensor& g, const DeviceMesh& m, const Placements& pl) {
      Tensor p = distribute_tensor(zeros_like(g), m, pl).detach().set_requires_grad();
      p.set_grad(distribute_tensor(g, m, pl));
      return p;
    };
    Tensor we = param(ge, mesh, {Shard(1), Shard(0)});
    Tensor wd = param(gd, mesh["dp"], {Shard(0)});
    Tensor wb = param(gb, mesh["ep"], {Shard(0)});
    Tensor wn = zeros({3}, {.dtype = DType::f64}).set_requires_grad();
    wn.set_grad(gn.clone());
    const std::vector<Tensor> params{we, wd, wb, wn};
    for (double p : {2.0, 1.0, 3.0, double(INFINITY)}) {
      const double want = norm_of({ge, gd, gb, gn}, p);
      const double got = dtensor::grad_norm(params, p).item<double>();
      CHECK(got == doctest::Approx(want).epsilon(1e-12));
    }
    // Missing the ep reduction (the known bug) would count only this rank's experts.
    const double without_ep = norm_of({full_tensor(we).narrow(0, 0, 2), gd, gb, gn}, 2.0);
    CHECK(dtensor::grad_norm(params).item<double>() != doctest::Approx(without_ep));

    const double before = dtensor::clip_grad_norm_(params, 1.0).item<double>();
    CHECK(before == doctest::Approx(norm_of({ge, gd, gb, gn}, 2.0)).epsilon(1e-12));
    CHECK(dtensor::grad_norm(params).item<double>() == doctest::Approx(1.0).epsilon(1e-5));
    CHECK(placements_of(we.grad()) == Placements{Shard(1), Shard(0)});  // clipping kept the layout
  });
}

TEST_CASE("grad_norm: Partial gradients are reduced first and pipeline stages add up") {
  run_threads_group(4, [](Communicator& c) {
    DeviceMesh mesh(c.shared_from_this(), {2, 2}, {"pp", "dp"});
    const int64_t stage = mesh.coordinate(0);
    // Each stage holds its own weight, FSDP-sharded over dp; stage 1's gradient is Partial.
    Tensor g = randn({5, 2}, RngKey(10 + uint64_t(stage), "g"), {.dtype = DType::f64});
    const Placements pl = stage == 0 ? Placements{Shard(0)} : Placements{Partial()};
    Tensor w = distribute_tensor(zeros_like(g), mesh["dp"], pl).detach().set_requires_grad();
    w.set_grad(test::make_dist(g, mesh["dp"], pl, 5));
    const double mine = norm_of({g}, 2.0);
    CHECK(dtensor::grad_norm({w}).item<double>() == doctest::Approx(mine).epsilon(1e-12));
    Tensor g0 = randn({5, 2}, RngKey(10, "g"), {.dtype = DType::f64});
    Tensor g1 = randn({5, 2}, RngKey(11, "g"), {.dtype = DType::f64});
    CHECK(dtensor::grad_norm({w}, 2.0, &mesh.comm(0)).item<double>() ==
          doctest::Approx(norm_of({g0, g1}, 2.0)).epsilon(1e-12));
  });
}
