// The MoE ops on CUDA against the CPU: grouped_mm forward and both gradients (f32, f64, bf16,
// f16; empty experts, single-row experts, rows and columns that are not multiples of a tile,
// unaligned K, transposed weight views), moe_route, moe_permute, moe_unpermute and its weight
// gradient (moe_slot_dot), and the combine's bit-identical reruns. The "mma kernel" cases run
// the same checks with the opt-in mma.sync grouped GEMM selected (kernels/cuda/grouped_gemm_mma.cu).
// Without a usable device every case prints why and returns.
#include <doctest/doctest.h>

#include <numeric>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/ops/moe.h"
#include "kernels/cuda/moe.h"
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

// Selects a grouped GEMM kernel for one scope, then restores the previous one.
class UseGroupedKernel {
 public:
  explicit UseGroupedKernel(kernels::cuda::GroupedGemmKernel k) : saved_(kernels::cuda::grouped_gemm_kernel()) {
    kernels::cuda::set_grouped_gemm_kernel(k);
  }
  ~UseGroupedKernel() { kernels::cuda::set_grouped_gemm_kernel(saved_); }
  UseGroupedKernel(const UseGroupedKernel&) = delete;
  UseGroupedKernel& operator=(const UseGroupedKernel&) = delete;

 private:
  kernels::cuda::GroupedGemmKernel saved_;
};

constexpr auto kMma = kernels::cuda::GroupedGemmKernel::mma;
constexpr auto kWmma = kernels::cuda::GroupedGemmKernel::wmma;

}  // namespace

TEST_CASE("cuda: grouped_mm forward and gradients match the CPU with empty, single-row and ragged experts") {
  SKIP_WITHOUT_CUDA();
  // Empty experts first, in the middle and last; a 1-row expert; 130 and 300 rows (partial
  // 128-row tiles); K = 72 (16-byte rows, a partial 32-deep K step), N = 200 (two column tiles).
  // The WMMA kernels (the mma.sync ones, the default, have their own cases below).
  const UseGroupedKernel use(kWmma);
  const std::vector<int64_t> counts = {0, 1, 130, 0, 7, 300, 0, 65, 0};
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64})
    for (bool tw : {false, true}) check_grouped("ragged experts", counts, 72, 200, dt, tw);
  check_grouped("i32 offsets", counts, 72, 200, DType::bf16, false, DType::i32);
}

TEST_CASE("cuda: grouped_mm handles unaligned K and N (element copies) and a single expert") {
  SKIP_WITHOUT_CUDA();
  // K = 45 and N = 37: rows of x and w are not 16-byte multiples, so tiles load element-wise.
  const UseGroupedKernel use(kWmma);
  for (DType dt : {DType::f32, DType::bf16}) {
    for (bool tw : {false, true}) check_grouped("unaligned K, N", {3, 0, 129, 1}, 45, 37, dt, tw);
    check_grouped("one expert", {257}, 64, 136, dt, false);
  }
}

TEST_CASE("cuda: grouped_mm with many k steps and many row tiles matches the CPU in bf16") {
  SKIP_WITHOUT_CUDA();
  const UseGroupedKernel use(kWmma);
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

// ---- the opt-in mma.sync kernel (forward, dgrad through w's transposed view, and the weight gradient) ----

TEST_CASE("cuda: the mma grouped_mm kernel matches the CPU with balanced, skewed, empty, single and ragged experts") {
  SKIP_WITHOUT_CUDA();
  const UseGroupedKernel use(kMma);
  struct Case {
    const char* what;
    std::vector<int64_t> counts;
    int64_t k, n;
  };
  std::vector<int64_t> tiny(64);  // E = 64 experts of 0-3 rows
  for (size_t e = 0; e < tiny.size(); ++e) tiny[e] = int64_t(e * 7 % 4);
  const std::vector<Case> cases = {
      {"balanced", {96, 96, 96, 96, 96, 96}, 256, 136},
      {"skewed", {700, 90, 20, 5, 1, 0, 0, 300}, 72, 200},
      {"ragged experts", {0, 1, 130, 0, 7, 300, 0, 65, 0, 129, 128, 127}, 72, 200},
      {"one expert", {257}, 64, 136},
      {"E = 64, tiny rows", tiny, 24, 40},
      {"odd multiples of 8", {9, 33, 0, 17}, 40, 24},
      {"one row", {0, 1, 0}, 8, 8},
  };
  for (const Case& c : cases)
    for (DType dt : {DType::bf16, DType::f16})
      for (bool tw : {false, true}) check_grouped(std::string("mma kernel: ") + c.what, c.counts, c.k, c.n, dt, tw);
}

TEST_CASE("cuda: the mma grouped_mm kernel matches the CPU at Qwen3-MoE widths and with many k steps") {
  SKIP_WITHOUT_CUDA();
  const UseGroupedKernel use(kMma);
  // Up/gate (K = 2048 -> N = 768) and down (K = 768 -> N = 2048) shapes with a few hundred rows.
  check_grouped("mma kernel: K 2048, N 768", {300, 0, 129, 77}, 2048, 768, DType::bf16, false);
  check_grouped("mma kernel: K 2048, N 768", {300, 0, 129, 77}, 2048, 768, DType::bf16, true);
  check_grouped("mma kernel: K 768, N 2048", {1, 200, 0, 64}, 768, 2048, DType::bf16, true);
  check_grouped("mma kernel: deep K", {1000, 0, 24, 513}, 512, 384, DType::bf16, false);
  check_grouped("mma kernel: deep K", {1000, 0, 24, 513}, 512, 384, DType::f16, true);
}

TEST_CASE("cuda: with the mma kernel selected, shapes it does not take fall back and still match the CPU") {
  SKIP_WITHOUT_CUDA();
  const UseGroupedKernel use(kMma);
  // K = 45, N = 37: not multiples of 8 (the WMMA kernel runs); f32 has no mma path.
  check_grouped("mma selected, unaligned K, N", {3, 0, 129, 1}, 45, 37, DType::bf16, false);
  check_grouped("mma selected, f32", {3, 0, 129, 1}, 72, 200, DType::f32, true);
}

TEST_CASE("cuda: grouped_gemm_mma takes aligned bf16 and f16 problems and declines the rest") {
  SKIP_WITHOUT_CUDA();
  const std::vector<int64_t> counts = {5, 0, 130};
  const int64_t m = total(counts), e = int64_t(counts.size());
  const Tensor off = offsets_of(counts);
  struct Case {
    int64_t k, n;
    DType dt;
    bool takes;
  };
  for (const Case c : {Case{64, 136, DType::bf16, true}, Case{64, 136, DType::f16, true},
                       Case{45, 136, DType::bf16, false}, Case{64, 37, DType::bf16, false},
                       Case{64, 136, DType::f32, false}}) {
    INFO("k = " << c.k << ", n = " << c.n << ", " << dtype_name(c.dt));
    const Tensor x = randn({m, c.k}, RngKey(12, "x"), {.dtype = c.dt});
    const Tensor w = randn({e, c.k, c.n}, RngKey(12, "w"), {.dtype = c.dt});
    const Tensor dy = randn({m, c.n}, RngKey(12, "dy"), {.dtype = c.dt});
    const Tensor xd = gpu(x), wd = gpu(w), dyd = gpu(dy), offd = gpu(off);
    void* stream = current_stream(kGpu).handle;

    Tensor out = gpu(zeros({m, c.n}, {.dtype = c.dt}));
    kernels::GroupedGemmArgs g;
    g.groups = e;
    g.offsets = offd.data<int64_t>();
    g.m = m; g.n = c.n; g.k = c.k;
    g.x = xd.data_ptr(); g.ldx = c.k;
    g.w = wd.data_ptr(); g.ldw = c.n; g.w_group_stride = c.k * c.n;
    g.out = out.data_ptr(); g.ldo = c.n;
    CHECK(kernels::cuda::grouped_gemm_mma(c.dt, g, stream) == c.takes);
    if (c.takes) check_close(out.to(Device::cpu()), grouped_mm(x, w, off), rtol_of(c.dt), atol_of(c.dt), "direct forward");

    Tensor dw = gpu(zeros({e, c.k, c.n}, {.dtype = c.dt}));
    kernels::GroupedGemmWeightGradArgs wg;
    wg.groups = e;
    wg.offsets = offd.data<int64_t>();
    wg.m = m; wg.n = c.n; wg.k = c.k;
    wg.x = xd.data_ptr(); wg.ldx = c.k;
    wg.dy = dyd.data_ptr(); wg.lddy = c.n;
    wg.dw = dw.data_ptr();
    CHECK(kernels::cuda::grouped_gemm_weight_grad_mma(c.dt, wg, stream) == c.takes);
    if (c.takes) {
      // The CPU's dw_e = x_e^T @ dy_e, as the gradient of sum(grouped_mm(x, w) * dy) to w.
      Tensor wc = w.detach().set_requires_grad();
      sum(grouped_mm(x, wc, off) * dy).backward();
      check_close(dw.to(Device::cpu()), wc.grad(), rtol_of(c.dt), atol_of(c.dt) * 4, "direct weight gradient");
    }
  }
}
