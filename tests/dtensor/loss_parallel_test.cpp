// Loss parallel cross entropy (dtensor/loss_parallel.h): on class-sharded logits the loss and
// the logits' gradient must equal the plain op on the full logits in f64 and finite differences,
// on uneven class shards and 2-D meshes, while only per-row statistics cross the class axis.
// One harness (check_case) runs every layout; a case is one line of `cases()`.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>

#include "collectives/observer.h"
#include "dtensor/dispatch.h"
#include "tests/dtensor/util.h"

using namespace quilt;

namespace {

struct LossCase {
  Shape mesh;
  Placements logits;                 // of the (N, V) logits
  std::optional<Placements> target = std::nullopt;  // nullopt: a plain target
  int64_t n = 12, v = 37;
  int64_t ignore = -100;
  uint64_t seed = 1;
};

// Logits in f64 (scaled so the softmax is far from uniform).
Tensor make_logits(int64_t n, int64_t v, uint64_t seed) {
  return randn({n, v}, RngKey(seed, "logits"), {.dtype = DType::f64}) * 3.0;
}

// Targets in [0, V) with about a fifth of the rows set to `ignore`.
Tensor make_targets(int64_t n, int64_t v, uint64_t seed, int64_t ignore) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<double> t(static_cast<size_t>(n));
  for (double& x : t) x = double(std::uniform_int_distribution<int64_t>(0, v - 1)(rng));
  for (size_t i = 0; i < t.size(); ++i)
    if (std::uniform_int_distribution<int>(0, 4)(rng) == 0 || i == 1) t[i] = double(ignore);
  return from_vector(t, {n}, {.dtype = DType::i64});
}

const char* name_of(Reduction r) { return r == Reduction::mean ? "mean" : r == Reduction::sum ? "sum" : "none"; }

bool is_gather(const std::string& op) {
  return op.find("gather") != std::string::npos || op.find("all_to_all") != std::string::npos;
}

// Largest |a - b| relative to max(1, max |b|).
double rel_diff(const Tensor& a, const Tensor& b) {
  double scale = 1;
  for (double x : b.to_vector()) scale = std::max(scale, std::fabs(x));
  return test::max_abs_diff(cast(a, DType::f64), b) / scale;
}

// The scalar the backward starts from: the loss, or <loss, up> for Reduction::none.
Tensor objective(const Tensor& loss, const Tensor& up) { return up.defined() ? sum(loss * up) : loss; }

// Loss and logits gradient of `dtype` logits placed as `lc` says, against the plain op on the f64
// full logits (tolerance `tol`, relative); with f64 logits also against central differences
// along random directions. Checks on the way that nothing is gathered.
void check_case(const LossCase& lc, Reduction r, DType dtype, double tol) {
  INFO("mesh ", quilt::detail::concat(lc.mesh), ", logits ", str(lc.logits), ", target ",
       lc.target ? str(*lc.target) : "plain", ", (", lc.n, ", ", lc.v, "), ", dtype_name(dtype), ", ", name_of(r),
       ", ignore_index ", lc.ignore);
  run_threads_group(int(numel_of(lc.mesh)), [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, lc.mesh);
    const Tensor full64 = make_logits(lc.n, lc.v, lc.seed);
    const Tensor full = cast(full64, dtype);
    const Tensor tgt = make_targets(lc.n, lc.v, lc.seed, lc.ignore);
    const Tensor t = lc.target ? distribute_tensor(tgt, mesh, *lc.target) : tgt;
    Tensor x = distribute_tensor(full, mesh, lc.logits).detach().set_requires_grad();

    Tensor ref_x = full64.clone().set_requires_grad();
    Tensor ref = cross_entropy(ref_x, tgt, lc.ignore, r);
    const Tensor up64 = r == Reduction::none ? randn({lc.n}, RngKey(lc.seed, "up"), {.dtype = DType::f64}) : Tensor();
    objective(ref, up64).backward();

    int gathers = 0;
    Tensor loss;
    {
      ScopedCollectiveObserver obs([&](const CollectiveRecord& rec) {
        gathers += is_gather(rec.op);
        return kNoDelay;
      });
      loss = cross_entropy(x, t, lc.ignore, r);
      Tensor up;
      if (up64.defined()) up = distribute_tensor(cast(up64, loss.dtype()), mesh, placements_of(loss));
      objective(loss, up).backward();
    }
    CHECK(gathers == 0);
    CHECK(loss.dtype() == dtype);
    if (r == Reduction::none) {
      Placements rows(lc.logits.size(), Replicate());
      for (size_t a = 0; a < rows.size(); ++a)
        if (lc.logits[a].is_shard(0)) rows[a] = Shard(0);
      CHECK(placements_of(loss) == rows);  // Replicate on the class axis, rows as the logits'
    }
    CHECK(rel_diff(full_tensor(loss), ref) <= tol);
    REQUIRE(x.grad().defined());
    CHECK(placements_of(x.grad()) == placements_of(x));
    CHECK(rel_diff(full_tensor(x.grad()), ref_x.grad()) <= tol);

    if (dtype != DType::f64) return;
    NoGradGuard ng;
    const Tensor grad = full_tensor(x.grad());
    auto f = [&](const Tensor& logits64) {
      const Tensor l = cross_entropy(distribute_tensor(logits64, mesh, lc.logits), t, lc.ignore, r);
      Tensor up;
      if (up64.defined()) up = distribute_tensor(up64, mesh, placements_of(l));
      return full_tensor(objective(l, up)).item<double>();
    };
    const double h = 1e-5;
    for (int k = 0; k < 3; ++k) {
      const Tensor d = randn({lc.n, lc.v}, RngKey(lc.seed, "dir" + std::to_string(k)), {.dtype = DType::f64});
      const double fd = (f(full64 + d * h) - f(full64 - d * h)) / (2 * h);
      const double analytic = sum(grad * d).item<double>();
      if (std::isnan(analytic)) continue;  // a mean over no counted targets
      CHECK(std::fabs(fd - analytic) <= 1e-6 * (1 + std::fabs(analytic)));
    }
  });
}

void check_all_reductions(const LossCase& lc) {
  for (Reduction r : {Reduction::mean, Reduction::sum, Reduction::none}) {
    check_case(lc, r, DType::f32, 2e-6);
    check_case(lc, r, DType::f64, 1e-12);
  }
}

}  // namespace

TEST_CASE("loss parallel: class-sharded logits on 2, 3 and 4 ranks give the plain op's loss and gradient") {
  for (int64_t ranks : {2, 3, 4}) {
    check_all_reductions({.mesh = {ranks}, .logits = {Shard(1)}});  // V = 37: uneven
    check_all_reductions(
        {.mesh = {ranks}, .logits = {Shard(-1)}, .target = Placements{Replicate()}, .n = 9, .seed = 2});
  }
  // More ranks than a piece of V: on 4 ranks V = 5 cuts as 2, 2, 1, 0 classes.
  check_all_reductions({.mesh = {4}, .logits = {Shard(1)}, .n = 7, .v = 5, .seed = 3});
}

TEST_CASE("loss parallel: other ignore indices, in range and out of it, are honoured") {
  check_all_reductions({.mesh = {3}, .logits = {Shard(1)}, .ignore = -1, .seed = 4});
  check_all_reductions({.mesh = {2}, .logits = {Shard(1)}, .ignore = 0, .seed = 5});
}

TEST_CASE("loss parallel: every target ignored gives NaN for the mean and zero gradients, as the plain op") {
  run_threads_group(2, [](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2});
    Tensor x = distribute_tensor(make_logits(4, 9, 6), mesh, {Shard(1)}).detach().set_requires_grad();
    const Tensor t = full({4}, -100, {.dtype = DType::i64});
    Tensor loss = cross_entropy(x, t);
    CHECK(std::isnan(full_tensor(loss).item<double>()));
    loss.backward();
    CHECK(test::max_abs_diff(full_tensor(x.grad()), zeros({4, 9}, {.dtype = DType::f64})) == 0);
    CHECK(full_tensor(cross_entropy(x, t, -100, Reduction::sum)).item<double>() == 0);
  });
}

TEST_CASE("loss parallel: a 2x2 mesh with rows sharded on one axis and classes on the other matches") {
  check_all_reductions({.mesh = {2, 2}, .logits = {Shard(0), Shard(1)}, .n = 13, .seed = 7});
  check_all_reductions(
      {.mesh = {2, 2}, .logits = {Shard(0), Shard(1)}, .target = Placements{Shard(0), Replicate()}, .n = 13,
       .seed = 8});
  check_all_reductions({.mesh = {2, 2}, .logits = {Shard(1), Shard(0)}, .n = 10, .seed = 9});
  check_all_reductions({.mesh = {2, 2}, .logits = {Replicate(), Shard(1)}, .n = 6, .seed = 10});
}

TEST_CASE("loss parallel: bf16 logits are computed in f32 as the plain op does") {
  const LossCase lc{.mesh = {2}, .logits = {Shard(1)}, .n = 16, .v = 37, .seed = 11};
  run_threads_group(2, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, lc.mesh);
    const Tensor full = cast(make_logits(lc.n, lc.v, lc.seed), DType::bf16);
    const Tensor t = make_targets(lc.n, lc.v, lc.seed, lc.ignore);
    Tensor x = distribute_tensor(full, mesh, lc.logits).detach().set_requires_grad();
    Tensor ref_x = full.clone().set_requires_grad();
    for (Reduction r : {Reduction::sum, Reduction::none}) {
      Tensor loss = cross_entropy(x, t, lc.ignore, r);
      Tensor ref = cross_entropy(ref_x, t, lc.ignore, r);
      CHECK(loss.dtype() == DType::bf16);
      // Both round once from f32; a last-bit difference of bf16 is 2^-8 relative.
      CHECK(rel_diff(full_tensor(loss), cast(ref, DType::f64)) <= 1e-2);
    }
    cross_entropy(x, t).backward();
    cross_entropy(ref_x, t).backward();
    CHECK(rel_diff(full_tensor(x.grad()), cast(ref_x.grad(), DType::f64)) <= 1e-2);
  });
}

TEST_CASE("loss parallel moves only per-row statistics") {
  constexpr int kRanks = 4;
  constexpr int64_t kRows = 64, kClasses = 1000;
  std::vector<int64_t> bytes(kRanks, 0), ops(kRanks, 0), gathers(kRanks, 0);
  run_threads_group(kRanks, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {kRanks});
    Tensor x = distribute_tensor(cast(make_logits(kRows, kClasses, 12), DType::f32), mesh, {Shard(1)})
                   .detach()
                   .set_requires_grad();
    const Tensor t = make_targets(kRows, kClasses, 12, -100);
    const int me = c.rank();
    {
      ScopedCollectiveObserver obs([&](const CollectiveRecord& r) {
        ++ops[size_t(me)];
        bytes[size_t(me)] += r.bytes;
        gathers[size_t(me)] += is_gather(r.op);
        return kNoDelay;
      });
      Tensor loss = cross_entropy(x, t);
      loss.backward();
    }
    CHECK(placements_of(x.grad()) == Placements{Shard(1)});
  });
  const int64_t logits_bytes = kRows * kClasses * 4;
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank ", r);
    CHECK(gathers[size_t(r)] == 0);
    CHECK(bytes[size_t(r)] <= 3 * kRows * 8);
    CHECK(bytes[size_t(r)] * 10 < logits_bytes);
  }
  MESSAGE("loss parallel, (", kRows, ", ", kClasses, ") f32 logits on ", kRanks, " ranks, mean, forward + backward: ",
          ops[0], " collectives, ", bytes[0], " bytes per rank (limit ", 3 * kRows * 8, "; the logits are ",
          logits_bytes, " bytes)");
}

TEST_CASE("loss parallel: a target out of range is named with the op, its value and its row") {
  run_threads_group(2, [](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2});
    Tensor x = distribute_tensor(make_logits(6, 37, 13), mesh, {Shard(1)});
    for (int64_t bad : {37, 40, -3}) {
      std::vector<double> tv = {0, 5, -100, 36, 2, 1};
      tv[3] = double(bad);
      const Tensor t = from_vector(tv, {6}, {.dtype = DType::i64});
      std::string msg;
      try {
        (void)cross_entropy(x, t);
      } catch (const Error& e) {
        msg = e.what();
      }
      INFO("message: ", msg);
      CHECK(msg.find("[cross_entropy]") != std::string::npos);
      CHECK(msg.find("target " + std::to_string(bad) + " at row 3") != std::string::npos);
      CHECK(msg.find("37 classes") != std::string::npos);
    }
  });
}
