// The op harness: see op_harness.h.
#include "op_harness.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <sstream>

namespace quilt::test {

uint64_t test_seed() {
  static const uint64_t seed = [] {
    if (const char* s = std::getenv("QUILT_TEST_SEED")) return uint64_t(std::stoull(s));
    return uint64_t(std::random_device{}()) ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  return seed;
}

Shape unravel(int64_t i, const Shape& shape) {
  Shape idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = i % shape[d];
    i /= shape[d];
  }
  return idx;
}

double Ref::at(const Shape& idx) const {
  const Shape st = strides();
  int64_t o = 0;
  for (size_t d = 0; d < idx.size(); ++d) o += idx[d] * st[d];
  return v[size_t(o)];
}
double& Ref::at(const Shape& idx) {
  const Shape st = strides();
  int64_t o = 0;
  for (size_t d = 0; d < idx.size(); ++d) o += idx[d] * st[d];
  return v[size_t(o)];
}

Ref map(const Ref& a, const std::function<double(double)>& f) {
  Ref r(a.shape);
  for (int64_t i = 0; i < a.numel(); ++i) r[i] = f(a[i]);
  return r;
}

namespace {
double bcast_at(const Ref& a, const Shape& out_idx) {
  Shape idx(a.shape.size());
  const size_t lead = out_idx.size() - a.shape.size();
  for (size_t d = 0; d < a.shape.size(); ++d) idx[d] = a.shape[d] == 1 ? 0 : out_idx[d + lead];
  return a.at(idx);
}
}  // namespace

Ref zip(const Ref& a, const Ref& b, const std::function<double(double, double)>& f) {
  const Shape s = broadcast_shapes(a.shape, b.shape, "ref");
  Ref r(s);
  for (int64_t i = 0; i < r.numel(); ++i) {
    const Shape idx = unravel(i, s);
    r[i] = f(bcast_at(a, idx), bcast_at(b, idx));
  }
  return r;
}

Ref reduce(const Ref& a, Shape dims, bool keepdim, double init, const std::function<double(double, double)>& f) {
  if (dims.empty())
    for (int64_t d = 0; d < a.dim(); ++d) dims.push_back(d);
  for (auto& d : dims) d = d < 0 ? d + a.dim() : d;
  Shape kept;
  for (int64_t d = 0; d < a.dim(); ++d) {
    const bool red = std::find(dims.begin(), dims.end(), d) != dims.end();
    kept.push_back(red ? 1 : a.shape[size_t(d)]);
  }
  Ref r(kept, init);
  for (int64_t i = 0; i < a.numel(); ++i) {
    Shape idx = unravel(i, a.shape);
    for (int64_t d : dims) idx[size_t(d)] = 0;
    double& slot = r.at(idx);
    slot = f(slot, a[i]);
  }
  if (!keepdim) {
    Shape s;
    for (int64_t d = 0; d < a.dim(); ++d)
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) s.push_back(a.shape[size_t(d)]);
    r.shape = s;
  }
  return r;
}

Ref matmul(const Ref& a0, const Ref& b0) {
  Ref a = a0, b = b0;
  const bool va = a.dim() == 1, vb = b.dim() == 1;
  if (va) a.shape.insert(a.shape.begin(), 1);
  if (vb) b.shape.push_back(1);
  const int64_t m = a.shape[a.shape.size() - 2], k = a.shape.back(), n = b.shape.back();
  Shape ba(a.shape.begin(), a.shape.end() - 2), bb(b.shape.begin(), b.shape.end() - 2);
  Shape batch = broadcast_shapes(ba, bb, "ref matmul");
  Shape os = batch;
  os.push_back(m);
  os.push_back(n);
  Ref r(os);
  for (int64_t i = 0; i < r.numel(); ++i) {
    const Shape idx = unravel(i, os);
    Shape bi(idx.begin(), idx.end() - 2);
    double acc = 0;
    for (int64_t kk = 0; kk < k; ++kk) {
      Shape ia(a.shape.size()), ib(b.shape.size());
      for (size_t d = 0; d < ba.size(); ++d) ia[d] = ba[d] == 1 ? 0 : bi[d + batch.size() - ba.size()];
      for (size_t d = 0; d < bb.size(); ++d) ib[d] = bb[d] == 1 ? 0 : bi[d + batch.size() - bb.size()];
      ia[ia.size() - 2] = idx[idx.size() - 2];
      ia[ia.size() - 1] = kk;
      ib[ib.size() - 2] = kk;
      ib[ib.size() - 1] = idx.back();
      acc += a.at(ia) * b.at(ib);
    }
    r[i] = acc;
  }
  if (va) r.shape.erase(r.shape.end() - 2);
  if (vb) r.shape.pop_back();
  return r;
}

Ref permute(const Ref& a, const Shape& dims) {
  Shape s(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) s[i] = a.shape[size_t(dims[i])];
  Ref r(s);
  for (int64_t i = 0; i < r.numel(); ++i) {
    const Shape idx = unravel(i, s);
    Shape src(idx.size());
    for (size_t d = 0; d < dims.size(); ++d) src[size_t(dims[d])] = idx[d];
    r[i] = a.at(src);
  }
  return r;
}

namespace {

bool floating_gen(Gen g) {
  return g == Gen::normal || g == Gen::positive || g == Gen::away_from_zero || g == Gen::unit || g == Gen::distinct;
}

Tensor draw(const In& in, size_t i, uint64_t seed) {
  const RngKey key(seed, "input" + std::to_string(i));
  switch (in.gen) {
    case Gen::normal:
    case Gen::distinct: return randn(in.shape, key, {.dtype = DType::f64});
    case Gen::positive: return rand(in.shape, key, {.dtype = DType::f64}, 0.5, 2.0);
    case Gen::unit: return rand(in.shape, key, {.dtype = DType::f64});
    case Gen::away_from_zero: {
      Tensor x = randn(in.shape, key, {.dtype = DType::f64});
      return x + sign(x) * 0.2;
    }
    case Gen::index: return randint(0, in.index_high, in.shape, key, {.dtype = in.index_dtype});
    case Gen::mask: return gt(rand(in.shape, key, {.dtype = DType::f64}), scalar_tensor(0.5, {.dtype = DType::f64}));
  }
  return {};
}

// Spreads the values of the case's Gen::distinct inputs (drawn N(0, 1), contiguous) so that every
// two of them, within one input or across inputs, are at least kGap apart: sorted together, each
// value is raised to kGap above the one below it where it is closer.
void spread_distinct(const OpCase& c, V& x64) {
  constexpr double kGap = 1e-3;
  std::vector<std::pair<double, double*>> all;
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    if (c.inputs[i].gen != Gen::distinct) continue;
    double* p = x64[i].data<double>();
    for (int64_t e = 0; e < x64[i].numel(); ++e) all.emplace_back(p[e], p + e);
  }
  std::sort(all.begin(), all.end());
  for (size_t j = 1; j < all.size(); ++j) all[j].first = std::max(all[j].first, all[j - 1].first + kGap);
  for (const auto& [v, p] : all) *p = v;
}

// A copy of t with the same values laid out non-contiguously (transposed or strided storage).
Tensor noncontiguous(const Tensor& t) {
  if (t.dim() == 0 || t.numel() <= 1) return t;
  Tensor out;
  if (t.dim() >= 2 && t.size(-1) > 1 && t.size(-2) > 1) {
    Shape s = t.shape();
    std::swap(s[s.size() - 1], s[s.size() - 2]);
    out = empty(s, {.dtype = t.dtype()}).transpose(-1, -2);
  } else {
    Shape s = t.shape();
    s.back() *= 2;
    out = empty(s, {.dtype = t.dtype()}).slice(-1, 0, s.back(), 2);
  }
  out.copy_(t);
  return out;
}

std::string describe(const Shape& s) {
  std::ostringstream os;
  os << '(';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ')';
  return os.str();
}

double scale_of(const Ref& r) {
  double m = 0;
  for (double x : r.v)
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return 1.0 + m;
}

// Compares outputs elementwise within tol * scale (exactly for integer outputs).
void compare(const std::string& what, const V& got, const R& want, double tol) {
  REQUIRE_MESSAGE(got.size() == want.size(), what, ": ", got.size(), " outputs, reference has ", want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    INFO(what, " output ", k);
    if (!got[k].defined()) {  // e.g. a gradient one device gives and the other does not
      FAIL_CHECK(what, " output ", k, ": undefined, the reference has shape ", describe(want[k].shape));
      continue;
    }
    REQUIRE_MESSAGE(got[k].shape() == want[k].shape, "shape ", describe(got[k].shape()), " vs reference ",
                    describe(want[k].shape));
    const std::vector<double> g = got[k].to_vector();
    const bool exact = !is_floating(got[k].dtype());
    const double s = scale_of(want[k]);
    int64_t bad = -1;
    for (size_t i = 0; i < g.size() && bad < 0; ++i) {
      const double w = want[k].v[i];
      const bool ok = exact ? g[i] == w
                            : (std::isnan(w) ? std::isnan(g[i]) : std::abs(g[i] - w) <= tol * s || g[i] == w);
      if (!ok) bad = int64_t(i);
    }
    if (bad >= 0) {
      FAIL_CHECK(what, " output ", k, " element ", bad, " (index ", describe(unravel(bad, want[k].shape)), "): got ",
                 g[size_t(bad)], ", reference ", want[k].v[size_t(bad)], " (tolerance ", tol * s, ")");
    }
  }
}

V cast_all(const V& xs, DType dt) {
  V out;
  for (const Tensor& x : xs) out.push_back(is_floating(x.dtype()) ? x.to(dt) : x);
  return out;
}

// Weighted sum of floating outputs: the scalar whose gradient we check.
Tensor loss_of(const V& outs, uint64_t seed) {
  Tensor total;
  for (size_t k = 0; k < outs.size(); ++k) {
    if (!is_floating(outs[k].dtype()) || outs[k].numel() == 0) continue;
    // Drawn on the output's device: the GPU draws the CPU's numbers, so both sides weigh alike.
    Tensor w = randn(outs[k].shape(), RngKey(seed, "weight" + std::to_string(k)),
                     {.dtype = outs[k].dtype(), .device = outs[k].device()});
    Tensor term = sum(outs[k] * w);
    total = total.defined() ? total + term : term;
  }
  return total;
}

V to_device(const V& xs, Device d) {
  V out;
  for (const Tensor& x : xs) out.push_back(x.to(d));
  return out;
}

// Gradients with "none" (an input the loss does not reach, as a composite op may leave it) as the
// zeros it stands for, so a device that returns zeros and one that returns none compare equal.
V zeros_if_undefined(V grads, const V& wrt) {
  for (size_t j = 0; j < grads.size(); ++j)
    if (!grads[j].defined()) grads[j] = zeros_like(wrt[j]);
  return grads;
}

R refs_of(const V& xs) {
  R out;
  for (const Tensor& x : xs) out.push_back(Ref::of(x.to(Device::cpu())));
  return out;
}

// 6. With a usable GPU: the op on device tensors against the same op on the CPU, on the same
// inputs — the f32 forward, the bf16 forward where the case checks low precision, and the f32
// backward of every differentiable input. An op the GPU build does not run yet, or a case whose
// op makes host tensors of its own, is named in a message and not counted against the case:
// the CPU checks above are what the case asserts, and tools/gpu-check counts these messages.
void compare_on_gpu(const OpCase& c, const V& x64, const std::vector<size_t>& diff, uint64_t seed) {
  if (!cuda::is_available()) return;
  const Device gpu = Device::cuda(0);
  const V x32 = cast_all(x64, DType::f32);
  V got;
  try {
    got = c.op(to_device(x32, gpu));
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.find("has no CUDA implementation") == std::string::npos &&
        what.find("inputs on different devices") == std::string::npos)
      throw;
    MESSAGE("op harness: no GPU comparison for '", c.name, "': ", what);
    return;
  }
  // CPU and GPU round f32 sums in different orders: each is within f32_tol of float64, so
  // they are within twice that of each other.
  compare("f32 forward on the GPU vs the CPU", got, refs_of(c.op(x32)), 2 * c.f32_tol);
  if (c.lowp) {
    const V xb = cast_all(x64, DType::bf16);
    compare("bf16 forward on the GPU vs the CPU", c.op(to_device(xb, gpu)), refs_of(c.op(xb)),
            c.lowp_tol > 0 ? c.lowp_tol : 2e-2);
  }
  if (!c.gradcheck || diff.empty()) return;
  auto grads_on = [&](Device d) {
    V leaves;
    for (size_t i = 0; i < x32.size(); ++i) {
      Tensor t = x32[i].to(d).clone().detach();
      if (std::find(diff.begin(), diff.end(), i) != diff.end()) t.set_requires_grad(true);
      leaves.push_back(t);
    }
    const Tensor loss = loss_of(c.op(leaves), seed);
    V wrt;
    for (size_t i : diff) wrt.push_back(leaves[i]);
    return loss.defined() ? zeros_if_undefined(grad({loss}, wrt), wrt) : V{};
  };
  const V on_gpu = grads_on(gpu), on_cpu = grads_on(Device::cpu());
  REQUIRE(on_gpu.size() == on_cpu.size());
  for (size_t j = 0; j < on_gpu.size(); ++j)
    compare("f32 backward on the GPU vs the CPU, input " + std::to_string(diff[j]), {on_gpu[j]}, refs_of({on_cpu[j]}),
            2 * c.f32_tol);
}

}  // namespace

void run_op_case(const OpCase& c) {
  const uint64_t seed = test_seed();
  INFO("op case '", c.name, "' (QUILT_TEST_SEED=", seed, ")");
  V x64;
  R refs;
  for (size_t i = 0; i < c.inputs.size(); ++i) x64.push_back(draw(c.inputs[i], i, seed));
  spread_distinct(c, x64);
  for (const Tensor& x : x64) refs.push_back(Ref::of(x));
  const R want = c.ref(refs);

  // 1. forward in f64 and f32
  compare("f64 forward", c.op(x64), want, 1e-10);
  const V x32 = cast_all(x64, DType::f32);
  R want32;  // reference on the f32-rounded inputs
  {
    R r32;
    for (const Tensor& x : x32) r32.push_back(Ref::of(x));
    want32 = c.ref(r32);
  }
  compare("f32 forward", c.op(x32), want32, c.f32_tol);

  // 2. non-contiguous inputs
  if (c.noncontig) {
    V nc;
    for (const Tensor& x : x64) nc.push_back(noncontiguous(x));
    compare("f64 forward (non-contiguous inputs)", c.op(nc), want, 1e-10);
  }

  // 3. low precision against f32 on the same rounded inputs
  if (c.lowp) {
    for (DType dt : {DType::bf16, DType::f16}) {
      const V xl = cast_all(x64, dt);
      const V xr = cast_all(xl, DType::f32);
      V ref32 = c.op(xr);
      R r;
      for (const Tensor& t : ref32) r.push_back(Ref::of(t));
      const double tol = dt == DType::bf16 ? (c.lowp_tol > 0 ? c.lowp_tol : 2e-2) : (c.lowp_tol > 0 ? c.lowp_tol / 4 : 5e-3);
      compare(std::string(dtype_name(dt)) + " forward vs f32", c.op(xl), r, tol);
    }
  }

  std::vector<size_t> diff;
  for (size_t i = 0; i < c.inputs.size(); ++i)
    if (c.inputs[i].grad && floating_gen(c.inputs[i].gen)) diff.push_back(i);

  // 6. (before the gradcheck, which returns early for cases without one) the GPU against the CPU
  compare_on_gpu(c, x64, diff, seed);

  // 4. gradcheck in f64
  if (!c.gradcheck || diff.empty()) return;
  V leaves;
  for (size_t i = 0; i < x64.size(); ++i) {
    Tensor t = x64[i].clone().detach();
    if (std::find(diff.begin(), diff.end(), i) != diff.end()) t.set_requires_grad(true);
    leaves.push_back(t);
  }
  Tensor loss = loss_of(c.op(leaves), seed);
  if (!loss.defined()) return;
  V wrt;
  for (size_t i : diff) wrt.push_back(leaves[i]);
  const V analytic = zeros_if_undefined(grad({loss}, wrt), wrt);
  const double eps = 1e-6;
  for (size_t j = 0; j < diff.size(); ++j) {
    const size_t i = diff[j];
    INFO("gradcheck input ", i, " of shape ", describe(x64[i].shape()));
    REQUIRE(analytic[j].defined());
    const std::vector<double> ga = analytic[j].to_vector();
    Tensor probe = x64[i].clone();
    double* p = probe.data<double>();
    for (int64_t e = 0; e < probe.numel(); ++e) {
      const double orig = p[e];
      V xs = x64;
      xs[i] = probe;
      double lp, lm;
      {
        NoGradGuard ng;
        p[e] = orig + eps;
        lp = loss_of(c.op(xs), seed).item<double>();
        p[e] = orig - eps;
        lm = loss_of(c.op(xs), seed).item<double>();
        p[e] = orig;
      }
      const double num = (lp - lm) / (2 * eps);
      const double a = ga[size_t(e)];
      if (!(std::abs(a - num) <= 1e-5 * (1 + std::abs(num)))) {
        FAIL_CHECK("gradient of input ", i, " element ", e, " (index ", describe(unravel(e, x64[i].shape())),
                   "): backward ", a, ", finite differences ", num);
        break;
      }
    }
  }

  // 5. backward with non-contiguous inputs matches contiguous backward
  if (c.noncontig) {
    V leaves2;
    for (size_t i = 0; i < x64.size(); ++i) {
      Tensor t = noncontiguous(x64[i]).detach();
      if (t.is_same(x64[i])) t = x64[i].clone();
      if (std::find(diff.begin(), diff.end(), i) != diff.end()) t.set_requires_grad(true);
      leaves2.push_back(t);
    }
    V wrt2;
    for (size_t i : diff) wrt2.push_back(leaves2[i]);
    const V g2 = grad({loss_of(c.op(leaves2), seed)}, wrt2);
    for (size_t j = 0; j < diff.size(); ++j) compare("backward (non-contiguous inputs)", {g2[j]}, {Ref::of(analytic[j])}, 1e-10);
  }
}

}  // namespace quilt::test
