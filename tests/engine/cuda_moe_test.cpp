// The MoE ops on CUDA against the CPU: grouped_mm forward and both gradients (f32, f64, bf16,
// f16; empty experts, single-row experts, rows and columns that are not multiples of a tile,
// unaligned K, transposed weight views), moe_route, moe_permute, moe_unpermute and its weight
// gradient (moe_slot_dot), and the combine's bit-identical reruns.
// Without a usable device every case prints why and returns.
#include <doctest/doctest.h>

#include <numeric>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/ops/moe.h"
#include "tests/engine/cuda_util.h"

using namespace quilt;
using namespace quilt::cuda_test;

namespace {

Tensor offsets_of(const std::vector<int64_t>& counts, DType dt = DType::i64) {
  std::vector<double> off(counts.size());
  double run = 0;
  for (size_t e = 0; e < counts.size(); ++e) off[e] = run += double(counts[e]);
  return from_vector(off, {int64_t(off.size())}, {.dtype = dt});
}

int64_t total(const std::vector<int64_t>& counts) { return std::accumulate(counts.begin(), counts.end(), int64_t(0)); }

// Tolerances of a K-long dot product rounded to dt, with values of about sqrt(K).
double atol_of(DType dt) { return dt == DType::f64 ? 1e-10 : dt == DType::f32 ? 1e-3 : 5e-2; }

// grouped_mm on the GPU and the CPU from the same (rounded) inputs, forward and gradients of
// sum(y * g) to x and w. `transposed_w`: w is an (E, N, K) tensor's transposed view.
void check_grouped(const std::string& what, const std::vector<int64_t>& counts, int64_t k, int64_t n, DType dt,
                   bool transposed_w, DType off_dt = DType::i64) {
  INFO(what << " " << dtype_name(dt) << (transposed_w ? " transposed w" : ""));
  const int64_t m = total(counts), e = int64_t(counts.size());
  const Tensor offsets = offsets_of(counts, off_dt);
  const Tensor x = randn({m, k}, RngKey(11, "x"), {.dtype = dt});
  const Tensor ws = transposed_w ? randn({e, n, k}, RngKey(11, "wt"), {.dtype = dt})
                                 : randn({e, k, n}, RngKey(11, "w"), {.dtype = dt});
  const Tensor g = randn({m, n}, RngKey(11, "g"), {.dtype = dt});

  auto run = [&](const Device& d) {
    Tensor xd = x.to(d).detach().set_requires_grad(), wsd = ws.to(d).detach().set_requires_grad();
    Tensor w = transposed_w ? transpose(wsd, 1, 2) : wsd;
    Tensor y = grouped_mm(xd, w, offsets.to(d));
    sum(y * g.to(d)).backward();
    return std::vector<Tensor>{y, xd.grad(), wsd.grad()};
  };
  const std::vector<Tensor> want = run(Device::cpu()), got = run(kGpu);
  const double rtol = rtol_of(dt), atol = atol_of(dt);
  check_close(got[0].to(Device::cpu()), want[0], rtol, atol, what + ": forward");
  check_close(got[1].to(Device::cpu()), want[1], rtol, atol, what + ": dx");
  // dw sums over a group's rows (up to 300 here): a looser absolute floor.
  check_close(got[2].to(Device::cpu()), want[2], rtol, atol * 4, what + ": dw");
}

}  // namespace

TEST_CASE("cuda: grouped_mm forward and gradients match the CPU with empty, single-row and ragged experts") {
  SKIP_WITHOUT_CUDA();
  // Empty experts first, in the middle and last; a 1-row expert; 130 and 300 rows (partial
  // 128-row tiles); K = 72 (16-byte rows, a partial 32-deep K step), N = 200 (two column tiles).
  const std::vector<int64_t> counts = {0, 1, 130, 0, 7, 300, 0, 65, 0};
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64})
    for (bool tw : {false, true}) check_grouped("ragged experts", counts, 72, 200, dt, tw);
  check_grouped("i32 offsets", counts, 72, 200, DType::bf16, false, DType::i32);
}

TEST_CASE("cuda: grouped_mm handles unaligned K and N (element copies) and a single expert") {
  SKIP_WITHOUT_CUDA();
  // K = 45 and N = 37: rows of x and w are not 16-byte multiples, so tiles load element-wise.
  for (DType dt : {DType::f32, DType::bf16}) {
    for (bool tw : {false, true}) check_grouped("unaligned K, N", {3, 0, 129, 1}, 45, 37, dt, tw);
    check_grouped("one expert", {257}, 64, 136, dt, false);
  }
}

TEST_CASE("cuda: grouped_mm with many k steps and many row tiles matches the CPU in bf16") {
  SKIP_WITHOUT_CUDA();
  check_grouped("deep K", {1000, 0, 24, 513}, 512, 384, DType::bf16, false);
  check_grouped("deep K", {1000, 0, 24, 513}, 512, 384, DType::bf16, true);
}

TEST_CASE("cuda: grouped_mm edge shapes: every expert empty, K = 0") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor y = grouped_mm(gpu(zeros({0, 8}, {.dtype = dt})), gpu(randn({3, 8, 5}, RngKey(1, "w"), {.dtype = dt})),
                          gpu(offsets_of({0, 0, 0})));
    CHECK(y.shape() == Shape{0, 5});
    Tensor z = grouped_mm(gpu(zeros({4, 0}, {.dtype = dt})), gpu(zeros({2, 0, 3}, {.dtype = dt})),
                          gpu(offsets_of({1, 3})));
    check_equal(z.to(Device::cpu()), zeros({4, 3}, {.dtype = dt}), "K = 0");
    // Weight gradient of every-empty groups: zeros of w's shape.
    Tensor xg = gpu(zeros({0, 8}, {.dtype = dt})).set_requires_grad();
    Tensor wg = gpu(randn({3, 8, 5}, RngKey(2, "w"), {.dtype = dt})).set_requires_grad();
    sum(grouped_mm(xg, wg, gpu(offsets_of({0, 0, 0})))).backward();
    check_equal(wg.grad().to(Device::cpu()), zeros({3, 8, 5}, {.dtype = dt}), "dw of empty groups");
  }
}

TEST_CASE("cuda: moe_route gives the CPU's order, counts and offsets") {
  SKIP_WITHOUT_CUDA();
  struct Case {
    int64_t tokens, k, experts;
  };
  // Small, with unused experts; and large enough for a multi-block sort.
  for (const Case c : {Case{300, 4, 16}, Case{20000, 8, 128}, Case{777, 2, 3}}) {
    INFO("T = " << c.tokens << ", k = " << c.k << ", E = " << c.experts);
    // Experts drawn from [0, E - 2) for the small case, so that the last two stay empty.
    const int64_t hi = c.experts > 8 && c.tokens < 1000 ? c.experts - 2 : c.experts;
    for (DType dt : {DType::i64, DType::i32}) {
      const Tensor idx = randint(0, hi, {c.tokens, c.k}, RngKey(3, "idx")).to(dt);
      const MoeRouting want = moe_route(idx, c.experts), got = moe_route(gpu(idx), c.experts);
      CHECK(got.order.device() == kGpu);
      check_equal(got.order.to(Device::cpu()), want.order, "order");
      check_equal(got.counts.to(Device::cpu()), want.counts, "counts");
      check_equal(got.offsets.to(Device::cpu()), want.offsets, "offsets");
      CHECK(got.host_counts == want.host_counts);
    }
  }
  // An index outside [0, E) throws as on the CPU.
  const Tensor bad = from_vector({0, 2, 5, 1}, {2, 2}, {.dtype = DType::i64});
  CHECK_THROWS_WITH_AS(moe_route(gpu(bad), 4), doctest::Contains("expert_idx[1, 0] = 5"), Error);
}

TEST_CASE("cuda: moe_permute, moe_unpermute and their gradients match the CPU") {
  SKIP_WITHOUT_CUDA();
  const int64_t tokens = 333, k = 3, experts = 7;
  const Tensor idx = randint(0, experts, {tokens, k}, RngKey(4, "idx"));
  const MoeRouting r = moe_route(idx, experts);
  // h = 64: 16-byte vector rows; h = 37: element rows.
  for (int64_t h : {64, 37})
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      INFO("h = " << h << ", " << dtype_name(dt));
      const Tensor x = randn({tokens, h}, RngKey(4, "x"), {.dtype = dt});
      const Tensor wts = softmax(randn({tokens, k}, RngKey(4, "w")), -1).to(dt);
      const Tensor gp = randn({tokens * k, h}, RngKey(4, "gp"), {.dtype = dt});
      const Tensor y = randn({tokens * k, h}, RngKey(4, "y"), {.dtype = dt});
      const Tensor gu = randn({tokens, h}, RngKey(4, "gu"), {.dtype = dt});
      auto run = [&](const Device& d) {
        Tensor xd = x.to(d).detach().set_requires_grad();
        Tensor p = moe_permute(xd, r.order.to(d), k);
        sum(p * gp.to(d)).backward();
        Tensor yd = y.to(d).detach().set_requires_grad(), wd = wts.to(d).detach().set_requires_grad();
        Tensor u = moe_unpermute(yd, r.order.to(d), wd);
        sum(u * gu.to(d)).backward();
        return std::vector<Tensor>{p, xd.grad(), u, yd.grad(), wd.grad()};
      };
      const std::vector<Tensor> want = run(Device::cpu()), got = run(kGpu);
      const char* names[] = {"permute", "permute dx", "unpermute", "unpermute dy", "unpermute dweights"};
      for (size_t i = 0; i < want.size(); ++i)
        check_close(got[i].to(Device::cpu()), want[i], rtol_of(dt), dt == DType::f32 ? 1e-5 : 2e-2, names[i]);
    }
  // i32 order, and an order passed as a strided x (unit_cols copies).
  const Tensor x = randn({tokens, 16}, RngKey(5, "x"));
  check_equal(moe_permute(gpu(x), gpu(r.order.to(DType::i32)), k).to(Device::cpu()), moe_permute(x, r.order, k),
              "permute with i32 order");
  const Tensor xt = randn({16, tokens}, RngKey(5, "xt")).transpose(0, 1);
  check_equal(moe_permute(gpu(xt), gpu(r.order), k).to(Device::cpu()), moe_permute(xt, r.order, k),
              "permute of a strided x");
}

TEST_CASE("cuda: moe_unpermute gives bit-identical results on every run") {
  SKIP_WITHOUT_CUDA();
  const int64_t tokens = 4096, k = 8, experts = 64, h = 256;
  const MoeRouting r = moe_route(gpu(randint(0, experts, {tokens, k}, RngKey(6, "idx"))), experts);
  for (DType dt : {DType::bf16, DType::f32}) {
    const Tensor y = gpu(randn({tokens * k, h}, RngKey(6, "y"), {.dtype = dt}));
    const Tensor w = gpu(softmax(randn({tokens, k}, RngKey(6, "w")), -1).to(dt));
    const Tensor a = moe_unpermute(y, r.order, w).to(Device::cpu());
    const Tensor b = moe_unpermute(y, r.order, w).to(Device::cpu());
    check_equal(a, b, std::string("unpermute rerun ") + dtype_name(dt));
    // The weight gradient (per-slot dot products) too.
    auto dw = [&] {
      Tensor wd = w.detach().set_requires_grad();
      sum(moe_unpermute(y, r.order, wd) * y.narrow(0, 0, tokens)).backward();
      return wd.grad().to(Device::cpu());
    };
    check_equal(dw(), dw(), std::string("unpermute dweights rerun ") + dtype_name(dt));
  }
}
