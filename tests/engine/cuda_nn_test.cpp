// The CUDA kernels of rms_norm, layer_norm, embedding, the index ops (gather, scatter_add,
// index_select, index_add, sort/topk, cumsum) and the AdamW/SGD multi-tensor steps against
// the same ops on the CPU, forward and backward, through the public Tensor API. Without a
// usable device every case prints why and returns.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/optim/adamw.h"
#include "engine/optim/sgd.h"
#include "tests/engine/cuda_util.h"

using namespace quilt;
using namespace quilt::cuda_test;

namespace {

// Runs f on CPU copies and on GPU copies of `inputs` (those marked in `grad` require grad),
// compares the outputs, then backpropagates sum(out * g) with the same g on both sides and
// compares every input gradient.
void check_op(const std::string& what, const std::vector<Tensor>& inputs, const std::vector<bool>& grad,
              const std::function<Tensor(const std::vector<Tensor>&)>& f, double rtol, double atol,
              double grad_rtol, double grad_atol) {
  std::vector<Tensor> c, g;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor tc = inputs[i].detach(), tg = gpu(inputs[i]).detach();
    if (grad[i]) {
      tc.set_requires_grad(true);
      tg.set_requires_grad(true);
    }
    c.push_back(tc);
    g.push_back(tg);
  }
  const Tensor yc = f(c), yg = f(g);
  REQUIRE(yg.device() == kGpu);
  check_close(yg, yc, rtol, atol, what + " forward");
  bool any = false;
  for (bool b : grad) any = any || b;
  if (!any) return;
  const Tensor w = randn(yc.shape(), RngKey(7, "cotangent"), {.dtype = yc.dtype()});
  (yc * w).sum().backward();
  (yg * gpu(w)).sum().backward();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!grad[i]) continue;
    REQUIRE_MESSAGE(g[i].grad().defined(), what << " input " << i << " has no gradient on the GPU");
    check_close(g[i].grad(), c[i].grad(), grad_rtol, grad_atol, what + " grad of input " + std::to_string(i));
  }
}

double fwd_rtol(DType dt) { return dt == DType::f32 ? 1e-4 : rtol_of(dt); }
double fwd_atol(DType dt) { return dt == DType::f32 ? 1e-5 : 1e-2; }
double bwd_atol(DType dt) { return dt == DType::f32 ? 1e-4 : 6e-2; }

}  // namespace

TEST_CASE("cuda: rms_norm matches the CPU forward and backward, with and without weight, strided and empty") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    // 29 columns: a warp per row; 1031: a block per row; 0 rows: nothing to normalise.
    for (const Shape& s : {Shape{37, 29}, Shape{6, 1031}, Shape{3, 5, 29}, Shape{0, 29}}) {
      const std::string what = std::string("rms_norm ") + dtype_name(dt) + " " + std::to_string(s.back()) + " cols " +
                               std::to_string(numel_of(s)) + " elements";
      const Tensor x = randn(s, RngKey(1, "x"), {.dtype = dt}) * 2.0;
      const Tensor w = randn({s.back()}, RngKey(1, "w"), {.dtype = dt}) + 1.0;
      check_op(what, {x, w}, {true, true}, [](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1]); },
               fwd_rtol(dt), fwd_atol(dt), fwd_rtol(dt), bwd_atol(dt));
      check_op(what + " no weight", {x}, {true}, [](const std::vector<Tensor>& in) { return rms_norm(in[0], {}); },
               fwd_rtol(dt), fwd_atol(dt), fwd_rtol(dt), bwd_atol(dt));
    }
    // A transposed (non-contiguous) input: the op makes its rows contiguous first.
    const Tensor xt = randn({29, 37}, RngKey(2, "x"), {.dtype = dt}).transpose(0, 1);
    const Tensor w = randn({29}, RngKey(2, "w"), {.dtype = dt});
    check_op(std::string("rms_norm strided ") + dtype_name(dt), {xt, w}, {true, true},
             [](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1], 1e-5); }, fwd_rtol(dt), fwd_atol(dt),
             fwd_rtol(dt), bwd_atol(dt));
  }
}

TEST_CASE("cuda: layer_norm matches the CPU forward and backward, with weight and bias or neither, strided and empty") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const Shape& s : {Shape{37, 29}, Shape{6, 1031}, Shape{2, 3, 1031}, Shape{0, 29}}) {
      const std::string what = std::string("layer_norm ") + dtype_name(dt) + " " + std::to_string(s.back()) +
                               " cols " + std::to_string(numel_of(s)) + " elements";
      const Tensor x = randn(s, RngKey(3, "x"), {.dtype = dt}) * 2.0 + 0.5;
      const Tensor w = randn({s.back()}, RngKey(3, "w"), {.dtype = dt}) + 1.0;
      const Tensor b = randn({s.back()}, RngKey(3, "b"), {.dtype = dt});
      check_op(what, {x, w, b}, {true, true, true},
               [](const std::vector<Tensor>& in) { return layer_norm(in[0], in[1], in[2]); }, fwd_rtol(dt),
               fwd_atol(dt), fwd_rtol(dt), bwd_atol(dt));
      check_op(what + " weight only", {x, w}, {true, true},
               [](const std::vector<Tensor>& in) { return layer_norm(in[0], in[1], {}); }, fwd_rtol(dt), fwd_atol(dt),
               fwd_rtol(dt), bwd_atol(dt));
      check_op(what + " neither", {x}, {true}, [](const std::vector<Tensor>& in) { return layer_norm(in[0], {}, {}); },
               fwd_rtol(dt), fwd_atol(dt), fwd_rtol(dt), bwd_atol(dt));
    }
    const Tensor xt = randn({29, 37}, RngKey(4, "x"), {.dtype = dt}).transpose(0, 1);
    const Tensor w = randn({29}, RngKey(4, "w"), {.dtype = dt});
    const Tensor b = randn({29}, RngKey(4, "b"), {.dtype = dt});
    check_op(std::string("layer_norm strided ") + dtype_name(dt), {xt, w, b}, {true, true, true},
             [](const std::vector<Tensor>& in) { return layer_norm(in[0], in[1], in[2]); }, fwd_rtol(dt),
             fwd_atol(dt), fwd_rtol(dt), bwd_atol(dt));
  }
}

TEST_CASE("cuda: embedding matches the CPU forward and backward, with repeated, strided, i32 and empty indices") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (DType idt : {DType::i64, DType::i32}) {
      const std::string what = std::string("embedding ") + dtype_name(dt) + " " + dtype_name(idt);
      const Tensor w = randn({1031, 37}, RngKey(5, "w"), {.dtype = dt});
      // Indices in [0, 40): many repeats, so the backward sums several rows into one.
      const Tensor idx = randint(0, 40, {7, 29}, RngKey(5, "i"), {.dtype = idt});
      auto f = [](const std::vector<Tensor>& in) { return embedding(in[0], in[1]); };
      // The weight gradient of a repeated row adds up to ~20 rows: allow for their rounding.
      check_op(what, {w, idx}, {true, false}, f, 0, 0, fwd_rtol(dt), dt == DType::f32 ? 1e-4 : 0.1);
      check_op(what + " strided indices", {w, idx.transpose(0, 1)}, {true, false}, f, 0, 0, fwd_rtol(dt),
               dt == DType::f32 ? 1e-4 : 0.1);
      check_op(what + " whole vocabulary", {w, randint(0, 1031, {1031}, RngKey(6, "i"), {.dtype = idt})},
               {true, false}, f, 0, 0, fwd_rtol(dt), dt == DType::f32 ? 1e-4 : 0.1);
      check_op(what + " no indices", {w, zeros({0}, {.dtype = idt})}, {true, false}, f, 0, 0, 0, 0);
    }
  }
  // The CPU rejects an out-of-range index in the op; the GPU kernel writes a zero row, reports
  // the index on the device, and the next synchronisation throws naming it (no sync in the op).
  const Tensor w = randn({10, 4}, RngKey(8, "w"));
  const Tensor bad = from_vector({1, 10, -1, 3}, {4}, {.dtype = DType::i64});
  CHECK_THROWS_WITH_AS(embedding(w, bad), doctest::Contains("[embedding] index 10 at position 1 is out of range"),
                       Error);
  const Tensor on_gpu = embedding(gpu(w), gpu(bad));
  // Which of the two bad indices is reported first is up to the device's threads.
  CHECK_THROWS_WITH_AS(synchronize(current_stream(kGpu)),
                       doctest::Contains("is out of range for a vocabulary of 10 rows"), Error);
  const Tensor y = on_gpu.to(Device::cpu());  // the report was taken: this synchronisation is clean
  check_equal(y.select(0, 0), w.select(0, 1), "embedding in-range row");
  check_equal(y.select(0, 1), zeros({4}), "embedding out-of-range row (too large)");
  check_equal(y.select(0, 2), zeros({4}), "embedding out-of-range row (negative)");
}

TEST_CASE("cuda: an out-of-range index or target on the GPU is reported at the next synchronisation, naming the op") {
  SKIP_WITHOUT_CUDA();
  const Tensor x = randn({3, 5}, RngKey(1, "x"));
  const Tensor bad = from_vector({0, 7, 2}, {3}, {.dtype = DType::i64});  // 7: past dim 1 of size 5
  const Tensor bad2 = from_vector({0, 7, 2, 1, 4, 3}, {3, 2}, {.dtype = DType::i64});
  auto reports = [&](const std::function<Tensor()>& op, const std::string& message) {
    INFO(message);
    Tensor out;
    CHECK_NOTHROW(out = op());  // the op itself never waits for the device
    CHECK_THROWS_WITH_AS(out.to(Device::cpu()), doctest::Contains(message.c_str()), Error);
    CHECK_NOTHROW(synchronize(current_stream(kGpu)));  // taken once: the next sync is clean
  };
  reports([&] { return index_select(gpu(x), 1, gpu(bad)); },
          "[index_select] index 7 (element 1 of the index) is out of range for a dim of size 5");
  reports([&] { return gather(gpu(x), 1, gpu(bad2)); },
          "[gather] index 7 (element 1 of the index) is out of range for a dim of size 5");
  reports([&] { return index_add(gpu(x), 1, gpu(bad), gpu(randn({3, 3}, RngKey(2, "s")))); },
          "[index_add] index 7 (element 1 of the index) is out of range for a dim of size 5");
  reports([&] { return scatter_add(gpu(x), 1, gpu(bad2), gpu(randn({3, 2}, RngKey(3, "s")))); },
          "[scatter_add] index 7 (element 1 of the index) is out of range for a dim of size 5");
  const Tensor targets = from_vector({1, -100, 9}, {3}, {.dtype = DType::i64});  // 9: past 5 classes
  reports([&] { return cross_entropy(gpu(x), gpu(targets), -100, Reduction::none); },
          "[cross_entropy] target 9 at row 2 is out of range for 5 classes");
  // In-range input reports nothing.
  CHECK_NOTHROW(cross_entropy(gpu(x), gpu(from_vector({1, -100, 4}, {3}, {.dtype = DType::i64}))).item<double>());
}

TEST_CASE("cuda: gather and scatter_add match the CPU forward and backward along each dim") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (DType idt : {DType::i64, DType::i32}) {
      for (int64_t dim : {0, 1}) {
        const std::string what = std::string(dtype_name(dt)) + " " + dtype_name(idt) + " dim " + std::to_string(dim);
        const Tensor x = randn({37, 29}, RngKey(9, "x"), {.dtype = dt});
        const Shape is = dim == 0 ? Shape{50, 29} : Shape{37, 40};  // longer than x along dim: repeats
        const Tensor idx = randint(0, x.size(dim), is, RngKey(9, "i"), {.dtype = idt});
        const Tensor src = randn(is, RngKey(9, "s"), {.dtype = dt});
        auto g = [dim](const std::vector<Tensor>& in) { return gather(in[0], dim, in[1]); };
        auto s = [dim](const std::vector<Tensor>& in) { return scatter_add(in[0], dim, in[1], in[2]); };
        check_op("gather " + what, {x, idx}, {true, false}, g, 0, 0, rtol_of(dt), 1e-5);
        check_op("gather strided x " + what, {randn({29, 37}, RngKey(10, "x"), {.dtype = dt}).transpose(0, 1), idx},
                 {true, false}, g, 0, 0, rtol_of(dt), 1e-5);
        check_op("scatter_add " + what, {x, idx, src}, {true, false, true}, s, rtol_of(dt), 1e-5, rtol_of(dt), 1e-5);
        check_op("scatter_add strided src " + what,
                 {x, idx, randn({is[1], is[0]}, RngKey(10, "s"), {.dtype = dt}).transpose(0, 1)},
                 {true, false, true}, s, rtol_of(dt), 1e-5, rtol_of(dt), 1e-5);
      }
    }
  }
  // Integer data, and empty index tensors.
  const Tensor xi = randint(-100, 100, {37, 29}, RngKey(11, "x"));
  const Tensor idx = randint(0, 29, {37, 40}, RngKey(11, "i"));
  check_equal(gather(gpu(xi), 1, gpu(idx)), gather(xi, 1, idx), "gather i64");
  check_equal(scatter_add(gpu(xi), 1, gpu(idx), gpu(gather(xi, 1, idx))), scatter_add(xi, 1, idx, gather(xi, 1, idx)),
              "scatter_add i64");
  const Tensor x = randn({37, 29}, RngKey(12, "x"));
  const Tensor none = zeros({0, 29}, {.dtype = DType::i64});
  check_equal(gather(gpu(x), 0, gpu(none)), gather(x, 0, none), "gather empty index");
  check_equal(scatter_add(gpu(x), 0, gpu(none), gpu(zeros({0, 29}))), scatter_add(x, 0, none, zeros({0, 29})),
              "scatter_add empty index");
}

TEST_CASE("cuda: index_select and index_add match the CPU forward and backward along each dim") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (DType idt : {DType::i64, DType::i32}) {
      for (int64_t dim : {0, 1}) {
        const std::string what = std::string(dtype_name(dt)) + " " + dtype_name(idt) + " dim " + std::to_string(dim);
        const Tensor x = randn({37, 29}, RngKey(13, "x"), {.dtype = dt});
        const Tensor idx = randint(0, x.size(dim), {50}, RngKey(13, "i"), {.dtype = idt});  // with repeats
        Shape ss = x.shape();
        ss[size_t(dim)] = 50;
        const Tensor src = randn(ss, RngKey(13, "s"), {.dtype = dt});
        auto sel = [dim](const std::vector<Tensor>& in) { return index_select(in[0], dim, in[1]); };
        auto add = [dim](const std::vector<Tensor>& in) { return index_add(in[0], dim, in[1], in[2]); };
        check_op("index_select " + what, {x, idx}, {true, false}, sel, 0, 0, rtol_of(dt), 1e-5);
        check_op("index_select strided " + what,
                 {randn({29, 37}, RngKey(14, "x"), {.dtype = dt}).transpose(0, 1), idx}, {true, false}, sel, 0, 0,
                 rtol_of(dt), 1e-5);
        check_op("index_add " + what, {x, idx, src}, {true, false, true}, add, rtol_of(dt), 1e-5, rtol_of(dt), 1e-5);
        check_op("index_select empty " + what, {x, zeros({0}, {.dtype = idt})}, {true, false}, sel, 0, 0, 0, 0);
      }
    }
  }
}

TEST_CASE("cuda: sort, topk, argsort and cumsum match the CPU, with ties, NaNs and gradients") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    // Rounded to halves: many ties, which a stable sort must keep in position order.
    Tensor x = cast(randint(-4, 5, {37, 29}, RngKey(15, "x")), DType::f32) * 0.5;
    x = where(eq(x, scalar_tensor(1.5)), full({}, NAN), x);  // some NaNs
    x = cast(x, dt);
    for (int64_t dim : {0, 1}) {
      for (bool desc : {false, true}) {
        const std::string what = std::string(dtype_name(dt)) + " dim " + std::to_string(dim) + (desc ? " desc" : "");
        auto [vc, ic] = sort(x, dim, desc);
        auto [vg, ig] = sort(gpu(x), dim, desc);
        check_equal(vg, vc, "sort values " + what);
        check_equal(ig, ic, "sort indices " + what);
        auto [tc, tic] = topk(x, 5, dim, desc);
        auto [tg, tig] = topk(gpu(x), 5, dim, desc);
        check_equal(tg, tc, "topk values " + what);
        check_equal(tig, tic, "topk indices " + what);
        check_equal(argsort(gpu(x).transpose(0, 1), dim, desc), argsort(x.transpose(0, 1), dim, desc),
                    "argsort strided " + what);
      }
    }
    const Tensor xf = randn({37, 29}, RngKey(16, "x"), {.dtype = dt});
    check_op(std::string("topk grad ") + dtype_name(dt), {xf}, {true},
             [](const std::vector<Tensor>& in) { return topk(in[0], 4, 1).first; }, 0, 0, 0, 0);
    for (int64_t dim : {0, 1}) {
      check_op(std::string("cumsum ") + dtype_name(dt) + " dim " + std::to_string(dim), {xf}, {true},
               [dim](const std::vector<Tensor>& in) { return cumsum(in[0], dim); }, fwd_rtol(dt), 1e-4, fwd_rtol(dt),
               1e-4);
    }
  }
  // Long rows (a block per row up to 4096), integer keys, integer cumsum (to i64), empty rows.
  const Tensor xl = randn({3, 1031}, RngKey(17, "x"));
  check_equal(sort(gpu(xl)).first, sort(xl).first, "sort 1031 values");
  check_equal(sort(gpu(xl)).second, sort(xl).second, "sort 1031 indices");
  const Tensor xi = randint(-5, 5, {37, 29}, RngKey(18, "x"), {.dtype = DType::i32});
  check_equal(sort(gpu(xi), 1, true).second, sort(xi, 1, true).second, "sort i32 indices");
  check_equal(cumsum(gpu(xi), 1), cumsum(xi, 1), "cumsum i32");
  check_equal(cumsum(gpu(zeros({0, 5})), 1), cumsum(zeros({0, 5}), 1), "cumsum empty");
  check_equal(sort(gpu(zeros({4, 0}))).first, sort(zeros({4, 0})).first, "sort empty rows");
  CHECK_THROWS_WITH_AS(sort(gpu(zeros({2, 5000}))), doctest::Contains("on CUDA sorts rows of at most 4096"), Error);
}

namespace {

// Parameters on `dev` holding the same values for every device: a (1031) f32, b (37, 29)
// `dt`, c (7) `dt` (c in its own group with its own lr and no weight decay).
std::vector<Tensor> opt_params(DType dt, Device dev) {
  std::vector<Tensor> ps = {randn({1031}, RngKey(20, "a")), randn({37, 29}, RngKey(20, "b"), {.dtype = dt}),
                            randn({7}, RngKey(20, "c"), {.dtype = dt})};
  for (Tensor& p : ps) p = p.to(dev).detach();
  return ps;
}

// Gradient of parameter k at `step`: f32 for b (a mixed-precision gradient), else its dtype.
Tensor opt_grad(const Tensor& p, size_t k, int step, Device dev) {
  const DType gdt = k == 1 ? DType::f32 : p.dtype();
  return randn(p.shape(), RngKey(uint64_t(100 + step), "g" + std::to_string(k)), {.dtype = gdt}).to(dev);
}

template <class Opt, class Options>
void check_optimizer_steps(const char* name, DType dt, const Options& o, double rtol, double atol) {
  std::vector<Tensor> pc = opt_params(dt, Device::cpu()), pg = opt_params(dt, kGpu);
  Opt oc({{.params = {pc[0], pc[1]}}, {.params = {pc[2]}, .lr = 0.02, .weight_decay = 0.0}}, o);
  Opt og({{.params = {pg[0], pg[1]}}, {.params = {pg[2]}, .lr = 0.02, .weight_decay = 0.0}}, o);
  for (int step = 1; step <= 5; ++step) {
    for (size_t k = 0; k < 3; ++k) {
      if (k == 2 && step == 3) {  // no gradient this step: c and its state stay as they are
        pc[k].set_grad(Tensor());
        pg[k].set_grad(Tensor());
        continue;
      }
      pc[k].set_grad(opt_grad(pc[k], k, step, Device::cpu()));
      pg[k].set_grad(opt_grad(pc[k], k, step, kGpu));
    }
    oc.step();
    og.step();
    for (size_t k = 0; k < 3; ++k) {
      REQUIRE(pg[k].device() == kGpu);
      check_close(pg[k], pc[k], rtol, atol,
                  std::string(name) + " " + dtype_name(dt) + " step " + std::to_string(step) + " param " +
                      std::to_string(k));
    }
  }
  const OptimizerState sc = oc.state_dict(), sg = og.state_dict();
  for (const auto& [key, t] : sc.tensors) check_close(sg.tensors.at(key), t, 1e-4, 1e-6, std::string(name) + " " + key);
}

}  // namespace

TEST_CASE("cuda: AdamW steps on the GPU match the CPU over several steps, f32 and bf16 parameters, two groups") {
  SKIP_WITHOUT_CUDA();
  const AdamWOptions o{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1};
  check_optimizer_steps<AdamW>("adamw", DType::f32, o, 1e-5, 1e-6);
  // bf16 parameters are rounded after each step; an FMA-contracted update may round the other way.
  check_optimizer_steps<AdamW>("adamw", DType::bf16, o, rtol_of(DType::bf16), 1e-2);
}

TEST_CASE("cuda: SGD with momentum and Nesterov on the GPU matches the CPU over several steps") {
  SKIP_WITHOUT_CUDA();
  const SGDOptions o{.lr = 0.05, .momentum = 0.9, .dampening = 0.0, .weight_decay = 0.01, .nesterov = true};
  check_optimizer_steps<SGD>("sgd", DType::f32, o, 1e-5, 1e-6);
  check_optimizer_steps<SGD>("sgd", DType::bf16, o, rtol_of(DType::bf16), 1e-2);
  const SGDOptions plain{.lr = 0.1};
  check_optimizer_steps<SGD>("sgd plain", DType::f32, plain, 1e-5, 1e-6);
}

TEST_CASE("cuda: AdamW in a CUDA graph: replays with staged lr and step counts equal eager steps, and skip leaves all as it was") {
  SKIP_WITHOUT_CUDA();
  const AdamWOptions o{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1};
  std::vector<Tensor> pe = opt_params(DType::bf16, kGpu), pg = opt_params(DType::bf16, kGpu);
  AdamW oe({{.params = {pe[0], pe[1]}}, {.params = {pe[2]}, .lr = 0.02, .weight_decay = 0.0}}, o);
  AdamW og({{.params = {pg[0], pg[1]}}, {.params = {pg[2]}, .lr = 0.02, .weight_decay = 0.0}}, o);
  Tensor skip = zeros({}, {.dtype = DType::b8, .device = kGpu});
  og.prepare_graph_steps(skip);
  // The graph reads fixed gradient buffers: each step's gradients are copied into them.
  std::vector<Tensor> gg;
  for (size_t k = 0; k < 3; ++k) {
    gg.push_back(opt_grad(pg[k], k, 1, kGpu));
    pg[k].set_grad(gg[k]);
  }
  auto set_grads = [&](int step) {
    for (size_t k = 0; k < 3; ++k) {
      pe[k].set_grad(opt_grad(pe[k], k, step, kGpu));
      gg[k].copy_(opt_grad(pg[k], k, step, kGpu));
    }
  };
  auto check_same = [&](const std::string& what) {
    for (size_t k = 0; k < 3; ++k) check_equal(pg[k], pe[k], what + " param " + std::to_string(k));
    const OptimizerState se = oe.state_dict(), sg = og.state_dict();
    for (const auto& [key, t] : se.tensors) check_equal(sg.tensors.at(key), t, what + " " + key);
    for (const auto& kv : se.scalars) CHECK_MESSAGE(sg.scalars.at(kv.first) == kv.second, what, " ", kv.first);
  };
  // Step 1 eagerly (it sizes the staged tables), step 2 captured and replayed, 3-5 replays.
  set_grads(1);
  oe.step();
  og.step();
  check_same("eager step 1");
  const Stream s = new_stream(kGpu);
  StreamGuard guard(s);
  cuda::Graph graph;
  for (int step = 2; step <= 5; ++step) {
    set_grads(step);
    oe.set_group_lr(0, 0.05 / step);  // an lr schedule: staged, not captured
    og.set_group_lr(0, 0.05 / step);
    oe.step();
    if (step == 2) {
      graph.capture_begin(s);
      og.step();
      graph.capture_end();
    } else {
      og.stage_replay();
    }
    graph.replay(s);
    synchronize(s);
    check_same("replayed step " + std::to_string(step));
  }
  // A step the device skips changes nothing, and unstep() takes its count back.
  const std::vector<Tensor> before = {pg[0].clone(), pg[1].clone(), pg[2].clone()};
  set_grads(6);
  skip.copy_(full({}, 1.0, {.dtype = DType::b8}));
  og.stage_replay();
  graph.replay(s);
  synchronize(s);
  og.unstep();
  for (size_t k = 0; k < 3; ++k) check_equal(pg[k], before[k], "skipped step param " + std::to_string(k));
  CHECK(og.step_count() == oe.step_count());
  skip.copy_(full({}, 0.0, {.dtype = DType::b8}));
  oe.step();
  og.stage_replay();
  graph.replay(s);
  synchronize(s);
  check_same("replay after a skipped step");
}
