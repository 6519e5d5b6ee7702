// The mixture-of-experts sharding rules (dtensor/rules/moe.cpp) against the single-process ops,
// with ranks simulated as threads: random meshes and placements of the floating inputs (Partial
// pieces genuinely random), the integer offsets / order plain or distributed, forward and
// gradients compared with full_tensor; then the layouts the rules promise (column- and
// row-parallel experts, hidden-dim-sharded permutes) without falling back.
#include <doctest/doctest.h>

#include <functional>
#include <mutex>
#include <numeric>

#include "dtensor/dispatch.h"
#include "engine/ops/moe.h"
#include "tests/dtensor/util.h"

using namespace quilt;
using test::make_dist;

namespace {

int rand_int(std::mt19937& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

Placements rand_placements(std::mt19937& rng, size_t mesh_ndim, int64_t ndim, bool floating) {
  Placements p;
  for (size_t a = 0; a < mesh_ndim; ++a) {
    const int pick = rand_int(rng, 0, 9);
    if (pick < 3 || (pick >= 8 && !floating)) p.push_back(Replicate());
    else if (pick < 8) p.push_back(Shard(rand_int(rng, 0, int(ndim) - 1)));
    else p.push_back(Partial(rand_int(rng, 0, 1) ? ReduceOp::sum : ReduceOp::avg));
  }
  return p;
}

double max_diff(const Tensor& a, const Tensor& b) { return test::max_abs_diff(a, b); }

// An op on floating inputs (drawn at `shapes`) and integer ones (fixed, distributed or plain).
struct Case {
  std::string name;
  std::function<std::vector<Shape>(std::mt19937&)> shapes;
  std::function<std::vector<Tensor>(std::mt19937&, const std::vector<Shape>&)> ints;
  std::function<Tensor(const std::vector<Tensor>& f, const std::vector<Tensor>& i)> fn;
  int trials = 24;
};

void validate(const Case& c) {
  std::mt19937 rng(uint32_t(stable_hash(c.name)));
  for (int trial = 0; trial < c.trials; ++trial) {
    const Shape mesh_shape = test::random_mesh_shape(rng, 8);
    const std::vector<Shape> shapes = c.shapes(rng);
    const std::vector<Tensor> ints = c.ints(rng, shapes);
    std::vector<std::optional<Placements>> fp(shapes.size()), ip(ints.size());
    for (size_t i = 0; i < shapes.size(); ++i)
      if (i == 0 || rand_int(rng, 0, 3) > 0)
        fp[i] = rand_placements(rng, mesh_shape.size(), int64_t(shapes[i].size()), true);
    for (size_t i = 0; i < ints.size(); ++i)
      if (rand_int(rng, 0, 1)) ip[i] = rand_placements(rng, mesh_shape.size(), ints[i].dim(), false);
    const uint64_t seed = rng();
    std::string label = detail::concat(c.name, " on mesh ", mesh_shape, ":");
    for (size_t i = 0; i < shapes.size(); ++i)
      label.append(detail::concat(" ", shapes[i], fp[i] ? str(*fp[i]) : std::string("plain")));
    for (size_t i = 0; i < ints.size(); ++i) label.append(detail::concat(" int ", ip[i] ? str(*ip[i]) : std::string("plain")));
    std::vector<std::string> failures;
    std::mutex mu;
    auto note = [&](const std::string& s) {
      std::lock_guard<std::mutex> lock(mu);
      failures.push_back(s);
    };
    try {
      run_threads_group(int(numel_of(mesh_shape)), [&](Communicator& comm) {
        DeviceMesh mesh = test::mesh_of_shape(comm, mesh_shape);
        std::vector<Tensor> ref_in, dist_in, dist_ints;
        for (size_t i = 0; i < shapes.size(); ++i) {
          Tensor g = randn(shapes[i], RngKey(seed, "in" + std::to_string(i)), {.dtype = DType::f64});
          ref_in.push_back(g.clone().set_requires_grad());
          Tensor x = fp[i] ? make_dist(g, mesh, *fp[i], seed + i) : g.clone();
          dist_in.push_back(x.detach().set_requires_grad());
        }
        for (size_t i = 0; i < ints.size(); ++i)
          dist_ints.push_back(ip[i] ? distribute_tensor(ints[i], mesh, *ip[i]) : ints[i]);
        Tensor want = c.fn(ref_in, ints);
        Tensor got = c.fn(dist_in, dist_ints);
        if (!got.is_distributed()) { note("output is not distributed"); return; }
        if (max_diff(full_tensor(got), want) > 1e-9) { note("forward differs"); return; }
        Tensor w = randn(want.shape(), RngKey(seed, "w"), {.dtype = DType::f64});
        sum(want * w).backward();
        sum(got * w).backward();
        for (size_t i = 0; i < shapes.size(); ++i) {
          Tensor gw = ref_in[i].grad(), gd = dist_in[i].grad();
          if (!gw.defined() || !gd.defined()) { note(detail::concat("gradient ", i, " missing")); return; }
          if (fp[i] && !(placements_of(gd) == placements_of(dist_in[i]))) {
            note(detail::concat("gradient ", i, " has placements ", str(placements_of(gd)), ", not the input's"));
            return;
          }
          if (max_diff(full_tensor(gd), gw) > 1e-9) { note(detail::concat("gradient ", i, " differs")); return; }
        }
      });
    } catch (const std::exception& e) {
      failures.push_back(std::string("threw: ") + e.what());
    }
    for (const std::string& f : failures) FAIL_CHECK((label + " -> " + f));
    if (!failures.empty()) return;
  }
}

int64_t rand_dim(std::mt19937& rng) { return rand_int(rng, 1, 9); }

// Group sizes (some empty) adding up to m, as cumulative offsets.
Tensor random_offsets(std::mt19937& rng, int64_t groups, int64_t m) {
  std::vector<double> cuts;
  for (int64_t e = 0; e + 1 < groups; ++e) cuts.push_back(double(rand_int(rng, 0, int(m))));
  std::sort(cuts.begin(), cuts.end());
  cuts.push_back(double(m));
  return from_vector(cuts, {groups}, {.dtype = rand_int(rng, 0, 1) ? DType::i64 : DType::i32});
}

// A routing order of T tokens with k choices among `experts`, and the matching offsets.
std::pair<Tensor, Tensor> random_routing(std::mt19937& rng, int64_t tokens, int64_t k, int64_t experts) {
  std::vector<double> idx;
  for (int64_t i = 0; i < tokens * k; ++i) idx.push_back(double(rand_int(rng, 0, int(experts) - 1)));
  MoeRouting r = moe_route(from_vector(idx, {tokens, k}, {.dtype = DType::i64}), experts);
  return {r.order, r.offsets};
}

std::vector<Case> cases() {
  std::vector<Case> v;
  v.push_back({"grouped_mm",
               [](std::mt19937& r) {
                 const int64_t m = rand_dim(r), k = rand_dim(r), n = rand_dim(r), e = rand_int(r, 1, 4);
                 return std::vector<Shape>{{m, k}, {e, k, n}};
               },
               [](std::mt19937& r, const std::vector<Shape>& s) {
                 return std::vector<Tensor>{random_offsets(r, s[1][0], s[0][0])};
               },
               [](const std::vector<Tensor>& f, const std::vector<Tensor>& i) { return grouped_mm(f[0], f[1], i[0]); }});
  v.push_back({"grouped_mm with a transposed weight view",
               [](std::mt19937& r) {
                 const int64_t m = rand_dim(r), k = rand_dim(r), n = rand_dim(r), e = rand_int(r, 1, 4);
                 return std::vector<Shape>{{m, k}, {e, n, k}};
               },
               [](std::mt19937& r, const std::vector<Shape>& s) {
                 return std::vector<Tensor>{random_offsets(r, s[1][0], s[0][0])};
               },
               [](const std::vector<Tensor>& f, const std::vector<Tensor>& i) {
                 return grouped_mm(f[0], transpose(f[1], 1, 2), i[0]);
               }});
  v.push_back({"moe_permute",
               [](std::mt19937& r) { return std::vector<Shape>{{rand_dim(r), rand_dim(r)}}; },
               [](std::mt19937& r, const std::vector<Shape>& s) {
                 return std::vector<Tensor>{random_routing(r, s[0][0], 2, 3).first};
               },
               [](const std::vector<Tensor>& f, const std::vector<Tensor>& i) { return moe_permute(f[0], i[0], 2); }});
  v.push_back({"moe_unpermute",
               [](std::mt19937& r) {
                 const int64_t t = rand_dim(r);
                 return std::vector<Shape>{{t * 3, rand_dim(r)}, {t, 3}};
               },
               [](std::mt19937& r, const std::vector<Shape>& s) {
                 return std::vector<Tensor>{random_routing(r, s[1][0], 3, 4).first};
               },
               [](const std::vector<Tensor>& f, const std::vector<Tensor>& i) { return moe_unpermute(f[0], i[0], f[1]); }});
  v.push_back({"routed expert layer",
               [](std::mt19937& r) {
                 const int64_t t = rand_dim(r), h = rand_dim(r), n = rand_dim(r);
                 return std::vector<Shape>{{t, h}, {4, h, n}, {t, 2}};
               },
               [](std::mt19937& r, const std::vector<Shape>& s) {
                 auto [order, offsets] = random_routing(r, s[0][0], 2, 4);
                 return std::vector<Tensor>{order, offsets};
               },
               [](const std::vector<Tensor>& f, const std::vector<Tensor>& i) {
                 return moe_unpermute(grouped_mm(moe_permute(f[0], i[0], 2), f[1], i[1]), i[0], f[2]);
               }});
  return v;
}

}  // namespace

TEST_CASE("moe rules: grouped_mm, permute and unpermute agree with one process on random meshes and placements") {
  set_dtensor_fallback_warnings_printed(false);
  for (const Case& c : cases()) {
    INFO("op: ", c.name);
    validate(c);
  }
  for (const std::string& w : dtensor_fallback_warnings())
    if (w.rfind("grouped_mm", 0) == 0 || w.rfind("moe_", 0) == 0) FAIL_CHECK(("fell back: " + w));
  set_dtensor_fallback_warnings_printed(true);
}

TEST_CASE("moe rules: experts run column-parallel, row-parallel and replicated without gathering") {
  set_dtensor_fallback_warnings_printed(false);
  run_threads_group(4, [](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {4});
    const Tensor offsets = from_vector({3, 3, 8, 11}, {4}, {.dtype = DType::i64});
    Tensor xg = randn({11, 8}, RngKey(1, "x"), {.dtype = DType::f64});
    Tensor wg = randn({4, 8, 12}, RngKey(1, "w"), {.dtype = DType::f64});
    const Tensor want = grouped_mm(xg, wg, offsets);

    // Column-parallel: x Replicate, w Shard(2) (N) -> out Shard(1); w's gradient stays Shard(2).
    Tensor x = distribute_tensor(xg, mesh, {Replicate()}).detach().set_requires_grad();
    Tensor w = distribute_tensor(wg, mesh, {Shard(2)}).detach().set_requires_grad();
    Tensor y = grouped_mm(x, w, offsets);
    CHECK(placements_of(y) == Placements{Shard(1)});
    CHECK(test::max_abs_diff(full_tensor(y), want) < 1e-12);
    sum(y * y).backward();
    CHECK(placements_of(w.grad()) == Placements{Shard(2)});

    // Row-parallel: x Shard(1) (K), w Shard(1) (K) -> out Partial(sum).
    Tensor xr = distribute_tensor(xg, mesh, {Shard(1)}).detach().set_requires_grad();
    Tensor wr = distribute_tensor(wg, mesh, {Shard(1)}).detach().set_requires_grad();
    Tensor yr = grouped_mm(xr, wr, offsets);
    CHECK(placements_of(yr) == Placements{Partial()});
    CHECK(test::max_abs_diff(full_tensor(yr), want) < 1e-12);
    sum(yr * 2.0).backward();
    CHECK(placements_of(xr.grad()) == Placements{Shard(1)});
    CHECK(placements_of(wr.grad()) == Placements{Shard(1)});

    // Everything replicated -> Replicate.
    Tensor yrep = grouped_mm(distribute_tensor(xg, mesh, {Replicate()}), distribute_tensor(wg, mesh, {Replicate()}),
                             distribute_tensor(offsets, mesh, {Replicate()}));
    CHECK(placements_of(yrep) == Placements{Replicate()});

    // The row ops keep a hidden-dim shard: Shard(1) in, Shard(1) out.
    MoeRouting r = moe_route(from_vector({0, 2, 1, 2, 3, 0, 1, 1, 2, 3}, {5, 2}, {.dtype = DType::i64}), 4);
    Tensor tg = randn({5, 8}, RngKey(2, "t"), {.dtype = DType::f64});
    Tensor t = distribute_tensor(tg, mesh, {Shard(1)});
    Tensor p = moe_permute(t, r.order, 2);
    CHECK(placements_of(p) == Placements{Shard(1)});
    Tensor weights = distribute_tensor(rand({5, 2}, RngKey(2, "g"), {.dtype = DType::f64}), mesh, {Replicate()});
    Tensor u = moe_unpermute(p * 3.0, r.order, weights);
    CHECK(placements_of(u) == Placements{Shard(1)});
    CHECK(test::max_abs_diff(full_tensor(u), moe_unpermute(moe_permute(tg, r.order, 2) * 3.0, r.order,
                                                           full_tensor(weights))) < 1e-12);

    // Routing a distributed expert_idx gathers it and gives replicated, plain-valued results.
    Tensor idx = distribute_tensor(from_vector({0, 2, 1, 2, 3, 0, 1, 1}, {4, 2}, {.dtype = DType::i64}), mesh, {Shard(0)});
    MoeRouting rd = moe_route(idx, 4);
    CHECK(placements_of(rd.order) == Placements{Replicate()});
    CHECK(rd.host_counts == std::vector<int64_t>{2, 3, 2, 1});
  });
  for (const std::string& w : dtensor_fallback_warnings())
    if (w.rfind("grouped_mm", 0) == 0 || w.rfind("moe_", 0) == 0) FAIL_CHECK(("fell back: " + w));
  set_dtensor_fallback_warnings_printed(true);
}
