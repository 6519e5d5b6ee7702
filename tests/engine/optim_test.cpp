// Optimizers, LR schedules and gradient clipping against float64 references written here,
// state-dict round trips, errors, and a tiny model that trains.
#include <doctest/doctest.h>

#include <cmath>
#include <numbers>

#include <omp.h>

#include "engine/engine.h"
#include "kernels/cpu/optim.h"

using namespace quilt;

namespace {

using Vec = std::vector<double>;

Tensor param(const std::string& name, const Shape& shape, DType dt, uint64_t seed = 0) {
  Tensor p = randn(shape, RngKey(seed, name), {.dtype = dt});
  p.set_requires_grad(true);
  p.set_name(name);
  return p;
}

// A deterministic gradient for (step, name), in dtype `dt`.
Tensor fake_grad(const Tensor& p, int step, DType dt) {
  return randn(p.shape(), RngKey(uint64_t(1000 + step), p.name()), {.dtype = dt});
}

double round_to(double x, DType dt) {
  if (dt == DType::bf16) return float(BFloat16(float(x)));
  if (dt == DType::f32) return double(float(x));
  return x;
}

// |a - b| <= rel * |b| + abs, elementwise, with the first failure reported.
void check_close(const Vec& got, const Vec& want, double rel, double abs, const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - want[i]) > rel * std::abs(want[i]) + abs) {
      FAIL_CHECK(what << "[" << i << "]: got " << got[i] << ", want " << want[i]);
      return;
    }
  }
}

// Naive AdamW (torch.optim.AdamW's formula) in float64, rounding the parameter to its dtype
// after each step as the fused kernel does.
struct RefAdamW {
  Vec p, m, v;
  int64_t t = 0;
  void step(const Vec& g, double lr, double b1, double b2, double eps, double wd, DType dt) {
    ++t;
    const double bc1 = 1 - std::pow(b1, double(t)), bc2 = 1 - std::pow(b2, double(t));
    for (size_t i = 0; i < p.size(); ++i) {
      double x = p[i] * (1 - lr * wd);
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      x -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
      p[i] = round_to(x, dt);
    }
  }
};

// Naive SGD (torch.optim.SGD's formula) in float64.
struct RefSGD {
  Vec p, buf;
  int64_t t = 0;
  void step(const Vec& g, const SGDOptions& o, DType dt) {
    ++t;
    if (buf.empty()) buf.assign(p.size(), 0.0);
    for (size_t i = 0; i < p.size(); ++i) {
      double d = g[i] + o.weight_decay * p[i];
      if (o.momentum > 0) {
        buf[i] = t == 1 ? d : o.momentum * buf[i] + (1 - o.dampening) * d;
        d = o.nesterov ? d + o.momentum * buf[i] : buf[i];
      }
      p[i] = round_to(p[i] - o.lr * d, dt);
    }
  }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void run_adamw_against_reference(DType dt, double rel, double abs) {
  const AdamWOptions o{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1};
  Tensor a = param("a", {7, 5}, dt), b = param("b", {33}, dt), c = param("c", {4}, dt);
  // Group 0 takes the defaults; group 1 has its own lr and no weight decay.
  AdamW opt({{.params = {a, b}}, {.params = {c}, .lr = 0.02, .weight_decay = 0.0}}, o);
  std::vector<Tensor> ps = {a, b, c};
  const double lrs[] = {0.05, 0.05, 0.02}, wds[] = {0.1, 0.1, 0.0};
  std::vector<RefAdamW> ref(3);
  for (size_t k = 0; k < 3; ++k) {
    ref[k].p = ps[k].to_vector();
    ref[k].m.assign(ref[k].p.size(), 0.0);
    ref[k].v.assign(ref[k].p.size(), 0.0);
  }
  for (int step = 1; step <= 6; ++step) {
    for (size_t k = 0; k < 3; ++k) {
      if (k == 2 && step == 3) {  // no gradient: c and its state stay as they are
        ps[k].set_grad(Tensor());
        continue;
      }
      // b gets f32 gradients even when it is bf16 (a mixed-precision setup).
      ps[k].set_grad(fake_grad(ps[k], step, k == 1 ? DType::f32 : dt));
      ref[k].step(ps[k].grad().to_vector(), lrs[k], o.beta1, o.beta2, o.eps, wds[k], dt);
    }
    opt.step();
    for (size_t k = 0; k < 3; ++k) {
      CAPTURE(step);
      CAPTURE(k);
      check_close(ps[k].to_vector(), ref[k].p, rel, abs, "param " + ps[k].name());
    }
  }
  CHECK(opt.step_count() == 6);
  OptimizerState s = opt.state_dict();
  for (size_t k = 0; k < 3; ++k) {
    const std::string base = "state." + ps[k].name() + ".";
    CHECK(s.scalars.at(base + "step") == double(ref[k].t));
    CHECK(s.tensors.at(base + "exp_avg").dtype() == DType::f32);  // moments stay f32 for bf16 params
    check_close(s.tensors.at(base + "exp_avg").to_vector(), ref[k].m, 1e-5, 1e-7, base + "exp_avg");
    check_close(s.tensors.at(base + "exp_avg_sq").to_vector(), ref[k].v, 1e-5, 1e-9, base + "exp_avg_sq");
  }
  CHECK(ref[2].t == 5);
}

}  // namespace

TEST_CASE("optim: AdamW matches a float64 reference over several steps with f32 parameters") {
  run_adamw_against_reference(DType::f32, 1e-5, 1e-6);
}

TEST_CASE("optim: AdamW matches a float64 reference with bf16 parameters and f32 moments") {
  // The kernel computes in f32 and rounds once to bf16; the reference rounds its f64 result,
  // so the two may land one bf16 step apart.
  run_adamw_against_reference(DType::bf16, 1.0 / 128, 1e-3);
}

TEST_CASE("optim: multi-tensor AdamW is bit-identical to one kernel call per tensor") {
  // Mixed sizes around the kernel's 1024-element blocks and its parallel grain, mixed dtypes
  // (f32, bf16 with bf16 or f32 gradients, f64 with f64 state), per-tensor hyperparameters.
  struct Case {
    int64_t n;
    DType p, g;
  };
  const std::vector<Case> cases = {{0, DType::f32, DType::f32},        {1, DType::f32, DType::f32},
                                   {1023, DType::bf16, DType::bf16},   {1025, DType::f32, DType::f32},
                                   {70001, DType::f32, DType::f32},    {4096, DType::bf16, DType::f32},
                                   {3000, DType::f64, DType::f64},     {200000, DType::f32, DType::f32},
                                   {517, DType::f16, DType::f16}};
  std::vector<Tensor> p1, p2, g, m1, m2, v1, v2;
  std::vector<kernels::cpu::AdamWHyper> hs;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const DType st = c.p == DType::f64 ? DType::f64 : DType::f32;
    const std::string k = std::to_string(i);
    p1.push_back(randn({c.n}, RngKey(1, "p" + k), {.dtype = c.p}));
    p2.push_back(p1.back().clone());
    g.push_back(randn({c.n}, RngKey(1, "g" + k), {.dtype = c.g}));
    m1.push_back(randn({c.n}, RngKey(1, "m" + k), {.dtype = st}) * 0.01);
    m2.push_back(m1.back().clone());
    v1.push_back(rand({c.n}, RngKey(1, "v" + k), {.dtype = st}) * 0.01);
    v2.push_back(v1.back().clone());
    hs.push_back({.lr = 1e-3 * double(i + 1), .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1,
                  .bias_correction1 = 1 - std::pow(0.9, double(i + 1)),
                  .bias_correction2 = 1 - std::pow(0.95, double(i + 1))});
  }
  std::vector<kernels::cpu::AdamWTensor> list;
  for (size_t i = 0; i < cases.size(); ++i) {
    kernels::cpu::adamw(cases[i].p, cases[i].g, m1[i].dtype(), p1[i].data_ptr(), g[i].data_ptr(), m1[i].data_ptr(),
                        v1[i].data_ptr(), cases[i].n, hs[i]);
    list.push_back({.param_dt = cases[i].p, .grad_dt = cases[i].g, .state_dt = m2[i].dtype(),
                    .param = p2[i].data_ptr(), .grad = g[i].data_ptr(), .m = m2[i].data_ptr(), .v = v2[i].data_ptr(),
                    .n = cases[i].n, .hyper = hs[i]});
  }
  for (int threads : {1, 2, 3}) {  // the split across threads does not change a bit
    std::vector<Tensor> p3, m3, v3;
    std::vector<kernels::cpu::AdamWTensor> l3 = list;
    for (size_t i = 0; i < cases.size(); ++i) {
      p3.push_back(p1[i].clone());
      m3.push_back(m1[i].clone());
      v3.push_back(v1[i].clone());
      l3[i].param = p3[i].data_ptr();
      l3[i].m = m3[i].data_ptr();
      l3[i].v = v3[i].data_ptr();
    }
    (void)p3;
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
    kernels::cpu::adamw_multi(l3);
    omp_set_num_threads(before);
    // p3 started from the per-tensor result: one more step must match one more per-tensor step.
    for (size_t i = 0; i < cases.size(); ++i) {
      Tensor pe = p1[i].clone(), me = m1[i].clone(), ve = v1[i].clone();
      kernels::cpu::adamw(cases[i].p, cases[i].g, me.dtype(), pe.data_ptr(), g[i].data_ptr(), me.data_ptr(),
                          ve.data_ptr(), cases[i].n, hs[i]);
      CAPTURE(i);
      CAPTURE(threads);
      CHECK(p3[i].to_vector() == pe.to_vector());
      CHECK(m3[i].to_vector() == me.to_vector());
      CHECK(v3[i].to_vector() == ve.to_vector());
    }
  }
  kernels::cpu::adamw_multi(list);
  for (size_t i = 0; i < cases.size(); ++i) {
    CAPTURE(i);
    CHECK(p2[i].to_vector() == p1[i].to_vector());
    CHECK(m2[i].to_vector() == m1[i].to_vector());
    CHECK(v2[i].to_vector() == v1[i].to_vector());
  }
  kernels::cpu::adamw_multi({});  // an empty list is a no-op
}

TEST_CASE("optim: AdamW's step (one multi-tensor pass) equals per-tensor kernel calls bit for bit") {
  Tensor a = param("a", {300, 7}, DType::f32), b = param("b", {5000}, DType::bf16), c = param("c", {3}, DType::f32);
  AdamW opt({{.params = {a, b}}, {.params = {c}, .lr = 0.02, .weight_decay = 0.0}},
            {.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1});
  std::vector<Tensor> ps = {a, b, c}, shadow, ms, vs;
  for (const Tensor& p : ps) {
    shadow.push_back(p.detach().clone());
    ms.push_back(zeros(p.shape()));
    vs.push_back(zeros(p.shape()));
  }
  const double lrs[] = {0.05, 0.05, 0.02}, wds[] = {0.1, 0.1, 0.0};
  for (int step = 1; step <= 3; ++step) {
    for (size_t k = 0; k < 3; ++k) {
      ps[k].set_grad(fake_grad(ps[k], step, k == 1 ? DType::f32 : ps[k].dtype()));
      const Tensor gr = ps[k].grad();
      kernels::cpu::AdamWHyper h{.lr = lrs[k], .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = wds[k],
                                 .bias_correction1 = 1 - std::pow(0.9, double(step)),
                                 .bias_correction2 = 1 - std::pow(0.99, double(step))};
      kernels::cpu::adamw(shadow[k].dtype(), gr.dtype(), DType::f32, shadow[k].data_ptr(), gr.data_ptr(),
                          ms[k].data_ptr(), vs[k].data_ptr(), shadow[k].numel(), h);
    }
    opt.step();
    for (size_t k = 0; k < 3; ++k) {
      CAPTURE(step);
      CAPTURE(k);
      CHECK(ps[k].to_vector() == shadow[k].to_vector());
    }
  }
}

TEST_CASE("optim: a bad parameter anywhere leaves the whole step undone") {
  // Every parameter is checked before any is updated: 'a' (first) keeps its value and state.
  Tensor a = param("a", {4}, DType::f32);
  Tensor wide = randn({3, 4}, RngKey(0, "wide"));
  Tensor view = wide.transpose(0, 1).set_name("view");
  view.set_requires_grad(true);
  AdamW opt({a, view});
  const Vec a0 = a.to_vector();
  a.set_grad(ones({4}));
  view.set_grad(ones({4, 3}));
  CHECK_THROWS_WITH_AS(opt.step(), "[adamw] parameter 'view' is not contiguous (shape (4, 3), strides (1, 4))", Error);
  CHECK(a.to_vector() == a0);
  CHECK(opt.step_count() == 0);
  CHECK(opt.state_dict().tensors.size() == 0);
  view.set_grad(Tensor());
  opt.step();
  CHECK(opt.step_count() == 1);
  CHECK(opt.state_dict().scalars.at("state.a.step") == 1.0);
  CHECK(a.to_vector() != a0);
}

TEST_CASE("optim: SGD with momentum, dampening, nesterov and weight decay matches a float64 reference") {
  const std::vector<SGDOptions> variants = {
      {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01},
      {.lr = 0.05, .momentum = 0.8, .weight_decay = 0.0, .nesterov = true},
      {.lr = 0.2, .momentum = 0.0, .weight_decay = 0.1},
  };
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    for (size_t vi = 0; vi < variants.size(); ++vi) {
      CAPTURE(vi);
      CAPTURE(dtype_name(dt));
      const SGDOptions& o = variants[vi];
      Tensor w = param("w", {6, 3}, dt, vi);
      SGD opt({w}, o);
      RefSGD ref{w.to_vector(), {}, 0};
      for (int step = 1; step <= 5; ++step) {
        w.set_grad(fake_grad(w, step, dt));
        ref.step(w.grad().to_vector(), o, dt);
        opt.step();
        if (dt == DType::bf16) check_close(w.to_vector(), ref.p, 1.0 / 128, 1e-3, "w");
        else if (dt == DType::f32) check_close(w.to_vector(), ref.p, 1e-5, 1e-6, "w");
        else check_close(w.to_vector(), ref.p, 1e-12, 1e-14, "w");
      }
      OptimizerState s = opt.state_dict();
      CHECK(s.tensors.contains("state.w.momentum_buffer") == (o.momentum > 0));
      if (o.momentum > 0 && dt != DType::bf16)
        check_close(s.tensors.at("state.w.momentum_buffer").to_vector(), ref.buf, 1e-5, 1e-6, "momentum_buffer");
    }
  }
}

TEST_CASE("optim: a non-contiguous gradient gives the same step as a contiguous one") {
  Tensor w1 = param("w", {4, 3}, DType::f32), w2 = param("w", {4, 3}, DType::f32);
  Tensor g = randn({3, 4}, RngKey(5, "g"));
  w1.set_grad(g.transpose(0, 1));
  w2.set_grad(g.transpose(0, 1).contiguous());
  CHECK_FALSE(w1.grad().is_contiguous());
  AdamW o1({w1}), o2({w2});
  o1.step();
  o2.step();
  CHECK(w1.to_vector() == w2.to_vector());
}

TEST_CASE("optim: zero_grad drops or zero-fills gradients") {
  Tensor w = param("w", {3}, DType::f32);
  SGD opt({w}, {.lr = 0.1});
  w.set_grad(ones({3}));
  opt.zero_grad(/*set_to_none=*/false);
  CHECK(w.grad().to_vector() == Vec{0, 0, 0});
  opt.zero_grad();
  CHECK_FALSE(w.grad().defined());
  const Vec before = w.to_vector();
  opt.step();  // nothing to do without gradients
  CHECK(w.to_vector() == before);
}

TEST_CASE("optim: AdamW state_dict restores training exactly, and bad state is refused by name") {
  auto make = [] { return std::vector<Tensor>{param("x.weight", {5, 4}, DType::f32), param("x.bias", {4}, DType::f32)}; };
  std::vector<Tensor> p1 = make();
  AdamW o1({{.params = {p1[0]}}, {.params = {p1[1]}, .weight_decay = 0.0}}, {.lr = 0.01});
  for (int step = 1; step <= 3; ++step) {
    for (Tensor& p : p1) p.set_grad(fake_grad(p, step, DType::f32));
    o1.step();
  }
  // A checkpoint: clones, since state_dict() shares the optimizer's storage.
  OptimizerState saved;
  for (const auto& [k, t] : o1.state_dict().tensors) saved.tensors.insert(k, t.clone());
  for (const auto& [k, v] : o1.state_dict().scalars) saved.scalars.insert(k, v);
  CHECK(saved.scalars.at("step") == 3);
  CHECK(saved.scalars.at("param_groups.1.weight_decay") == 0.0);
  CHECK(saved.tensors.keys() == std::vector<std::string>{"state.x.weight.exp_avg", "state.x.weight.exp_avg_sq",
                                                         "state.x.bias.exp_avg", "state.x.bias.exp_avg_sq"});

  std::vector<Tensor> p2 = make();
  {
    NoGradGuard ng;
    for (size_t k = 0; k < 2; ++k) p2[k].copy_(p1[k]);
  }
  AdamW o2({{.params = {p2[0]}}, {.params = {p2[1]}}}, {.lr = 0.5});  // hyperparameters come from the state
  o2.load_state_dict(saved);
  CHECK(o2.step_count() == 3);
  CHECK(o2.group_lr(0) == 0.01);
  CHECK(o2.group_weight_decay(1) == 0.0);
  for (int step = 4; step <= 6; ++step) {
    for (size_t k = 0; k < 2; ++k) {
      p1[k].set_grad(fake_grad(p1[k], step, DType::f32));
      p2[k].set_grad(fake_grad(p2[k], step, DType::f32));
    }
    o1.step();
    o2.step();
  }
  for (size_t k = 0; k < 2; ++k) CHECK(p1[k].to_vector() == p2[k].to_vector());  // bit for bit

  OptimizerState bad = saved;
  bad.tensors.insert("state.x.weight.exp_avg", zeros({4, 5}));
  bad.tensors.insert("state.nope.exp_avg", zeros({1}));
  OptimizerState missing;
  for (const auto& [k, t] : saved.tensors)
    if (k != "state.x.bias.exp_avg_sq") missing.tensors.insert(k, t);
  for (const auto& [k, v] : saved.scalars) missing.scalars.insert(k, v);
  AdamW o3({{.params = {p2[0]}}, {.params = {p2[1]}}});
  CHECK(error_of([&] { o3.load_state_dict(bad); }) ==
        "[adamw] load_state_dict: unexpected keys: state.nope.exp_avg; shape mismatch for state.x.weight.exp_avg: "
        "state (4, 5) vs parameter (5, 4)");
  CHECK(error_of([&] { o3.load_state_dict(missing); }) ==
        "[adamw] load_state_dict: missing keys: state.x.bias.exp_avg_sq");
  CHECK(o3.step_count() == 0);  // nothing was restored
  AdamW one_group({p2[0], p2[1]});
  CHECK_THROWS_WITH_AS(one_group.load_state_dict(saved),
                       "[adamw] load_state_dict: unexpected keys: param_groups.1.lr, param_groups.1.weight_decay", Error);
  AdamW three_groups({{.params = {p2[0]}}, {.params = {p2[1]}}, {.params = {param("z", {1}, DType::f32)}}});
  CHECK_THROWS_WITH_AS(three_groups.load_state_dict(saved),
                       "[adamw] load_state_dict: missing keys: param_groups.2.lr, param_groups.2.weight_decay", Error);
}

TEST_CASE("optim: parameters are keyed by name when names are distinct, else by position") {
  Tensor a = param("a", {2}, DType::f32), b = param("b", {2}, DType::f32);
  AdamW named({a, b});
  CHECK(named.param_key(0, 1) == "b");
  Tensor u = randn({2}, RngKey(0, "u")).set_requires_grad(true), v = param("a", {2}, DType::f32);
  AdamW unnamed({u, v});
  CHECK(unnamed.param_key(0, 0) == "0");
  CHECK(unnamed.param_key(0, 1) == "1");
}

TEST_CASE("optim: bad parameters and hyperparameters are refused with the value named") {
  Tensor a = param("a", {2}, DType::f32);
  CHECK_THROWS_WITH_AS(AdamW({a, a}), "[adamw] parameter 'a' (index 1) appears more than once", Error);
  CHECK_THROWS_WITH_AS(AdamW({a}, {.beta1 = 1.0}), "[adamw] beta1 must be in [0, 1), got 1", Error);
  CHECK_THROWS_WITH_AS(SGD({a}, {.momentum = 0.0, .nesterov = true}), doctest::Contains("[sgd] nesterov needs momentum > 0"),
                       Error);
  CHECK_THROWS_WITH_AS(SGD({{.params = {a}, .lr = -1.0}}), "[sgd] group 0: lr must be >= 0, got -1", Error);
  CHECK_THROWS_WITH_AS(AdamW({arange(0, 3)}), doctest::Contains("is i64, not floating"), Error);
  Tensor wide = randn({3, 4}, RngKey(0, "wide")).set_requires_grad(true);
  Tensor view = wide.detach().transpose(0, 1).set_name("view");
  view.set_requires_grad(true);
  AdamW opt({view});
  view.set_grad(ones({4, 3}));
  CHECK_THROWS_WITH_AS(opt.step(), "[adamw] parameter 'view' is not contiguous (shape (4, 3), strides (1, 4))", Error);
}

TEST_CASE("optim: LR schedules give the documented values at warmup, middle and end") {
  const LRSchedule::Options base{.max_lr = 1e-3, .min_lr = 1e-4, .init_lr = 0.0, .warmup_steps = 10, .decay_steps = 110};
  LRSchedule::Options cos_o = base, lin_o = base, const_o = base;
  lin_o.style = LRDecayStyle::linear;
  const_o.style = LRDecayStyle::constant;
  LRSchedule cosine(cos_o), lin(lin_o), constant(const_o);
  for (const LRSchedule* s : {&cosine, &lin, &constant}) {
    CHECK(s->lr_at(0) == 0.0);
    CHECK(s->lr_at(5) == doctest::Approx(5e-4));
    CHECK(s->lr_at(10) == doctest::Approx(1e-3));
  }
  CHECK(cosine.lr_at(60) == doctest::Approx(5.5e-4));  // r = 1/2: halfway between max and min
  CHECK(lin.lr_at(60) == doctest::Approx(5.5e-4));
  CHECK(cosine.lr_at(35) == doctest::Approx(1e-4 + 9e-4 * 0.5 * (1 + std::cos(std::numbers::pi / 4))));  // r = 1/4
  CHECK(lin.lr_at(35) == doctest::Approx(1e-4 + 9e-4 * 0.75));
  CHECK(cosine.lr_at(110) == doctest::Approx(1e-4));
  CHECK(lin.lr_at(109) == doctest::Approx(1e-4 + 9e-4 / 100));
  CHECK(cosine.lr_at(1000) == 1e-4);
  CHECK(constant.lr_at(1000) == 1e-3);
  LRSchedule no_warmup({.max_lr = 2.0, .min_lr = 0.0, .warmup_steps = 0, .decay_steps = 4});
  CHECK(no_warmup.lr_at(0) == 2.0);
  CHECK(no_warmup.lr_at(2) == doctest::Approx(1.0));

  Tensor w = param("w", {2}, DType::f32);
  SGD opt({{.params = {w}}, {.params = {param("v", {2}, DType::f32)}, .lr = 5.0}});
  cosine.apply(opt, 60);
  CHECK(opt.group_lr(0) == doctest::Approx(5.5e-4));
  CHECK(opt.group_lr(1) == doctest::Approx(5.5e-4));
  CHECK_THROWS_WITH_AS(LRSchedule({.warmup_steps = 10, .decay_steps = 10}),
                       "[lr_schedule] decay_steps (10) must exceed warmup_steps (10)", Error);
  CHECK_THROWS_WITH_AS(cosine.lr_at(-1), "[lr_schedule] step must be >= 0, got -1", Error);
}

TEST_CASE("optim: clip_grad_norm_ matches the hand-computed norm and scales only above max_norm") {
  Tensor a = param("a", {2}, DType::f32), b = param("b", {1}, DType::f64), c = param("c", {3}, DType::f32);
  a.set_grad(from_vector({3, -4}, {2}));
  b.set_grad(from_vector({12}, {1}, {.dtype = DType::f64}));
  // c has no gradient and is skipped.
  Tensor n = clip_grad_norm_({a, b, c}, 6.5);
  CHECK(n.dim() == 0);
  CHECK(n.dtype() == DType::f64);
  CHECK(n.item<double>() == doctest::Approx(13.0).epsilon(1e-12));  // sqrt(9 + 16 + 144)
  const double coef = 6.5 / (13.0 + 1e-6);
  CHECK(a.grad().to_vector()[0] == doctest::Approx(3 * coef).epsilon(1e-6));
  CHECK(a.grad().to_vector()[1] == doctest::Approx(-4 * coef).epsilon(1e-6));
  CHECK(b.grad().to_vector()[0] == doctest::Approx(12 * coef).epsilon(1e-12));
  CHECK(grad_norm({a, b}).item<double>() == doctest::Approx(6.5).epsilon(1e-6));

  // Below max_norm: untouched.
  const Vec before = a.grad().to_vector();
  CHECK(clip_grad_norm_({a, b}, 100.0).item<double>() == doctest::Approx(6.5).epsilon(1e-6));
  CHECK(a.grad().to_vector() == before);

  // Other norms.
  a.set_grad(from_vector({3, -4}, {2}));
  b.set_grad(from_vector({-12}, {1}, {.dtype = DType::f64}));
  CHECK(grad_norm({a, b}, INFINITY).item<double>() == 12.0);
  CHECK(grad_norm({a, b}, 1.0).item<double>() == doctest::Approx(19.0));
  CHECK(grad_norm({a, b}, 3.0).item<double>() == doctest::Approx(std::cbrt(27.0 + 64 + 1728)));
  CHECK(grad_norm({c}).item<double>() == 0.0);

  // bf16 gradients are summed in f32, not in bf16.
  Tensor h = param("h", {4096}, DType::bf16);
  h.set_grad(full({4096}, 0.5, {.dtype = DType::bf16}));
  CHECK(grad_norm({h}).item<double>() == doctest::Approx(std::sqrt(4096 * 0.25)).epsilon(1e-6));

  // A non-finite norm is returned as is and nothing is scaled.
  a.set_grad(from_vector({NAN, 1}, {2}));
  Tensor bad = clip_grad_norm_({a, b}, 1.0);
  CHECK(std::isnan(bad.item<double>()));
  CHECK(b.grad().to_vector() == Vec{-12});
}

TEST_CASE("optim: a tiny MLP trained with AdamW, warmup-cosine and clipping fits its data") {
  Linear l1(2, 32), l2(32, 1);
  l1.init_weights(0);
  l2.init_weights(1);
  // y = sin(2 x0) * x1 on a fixed grid.
  Tensor x = rand({64, 2}, RngKey(3, "x"), {}, -1.0, 1.0);
  auto xv = x.to_vector();
  Vec yv;
  for (int i = 0; i < 64; ++i) yv.push_back(std::sin(2 * xv[size_t(2 * i)]) * xv[size_t(2 * i + 1)]);
  Tensor y = from_vector(yv, {64, 1});
  std::vector<Tensor> params = l1.parameters();
  for (const Tensor& p : l2.parameters()) params.push_back(p);
  AdamW opt(params, {.lr = 1e-2, .weight_decay = 0.0});
  LRSchedule sched({.max_lr = 2e-2, .min_lr = 1e-3, .warmup_steps = 20, .decay_steps = 400});
  double first = 0, last = 0;
  for (int step = 0; step < 400; ++step) {
    sched.apply(opt, opt.step_count());
    Tensor pred = l2(tanh(l1(x)));
    Tensor loss = mean(square(pred - y));
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
    loss.backward();
    clip_grad_norm_(params, 1.0);
    opt.step();
    opt.zero_grad();
  }
  MESSAGE("loss " << first << " -> " << last);
  CHECK(last < 5e-3);
  CHECK(last < first / 20);
}
