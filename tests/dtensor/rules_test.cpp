// The rule validator: for every op with a sharding rule (and ops without one, through the
// replicated fallback), simulate the ranks as threads and check that
//   full_tensor(op(distributed inputs)) == op(full inputs)
// and that the gradients agree (full_tensor of each distributed input's gradient against the
// single-process gradient), over random 1-D, 2-D and 3-D meshes, random placements (Partial
// inputs with genuinely random pieces, some inputs left plain) and random shapes — uneven ones
// and ones smaller than the mesh included. Each op runs a fixed number of seeded trials.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <map>

#include "dtensor/dispatch.h"
#include "tests/dtensor/util.h"

using namespace quilt;
using test::make_dist;

namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;
using ShapeGen = std::function<std::vector<Shape>(std::mt19937&)>;

struct OpCase {
  std::string name;
  ShapeGen shapes;
  Fn fn;
  bool grads = true;     // compare gradients too
  bool positive = false;  // inputs in [0.5, 2.5] (log, sqrt, pow, division)
  int trials = 30;
  // Integer inputs (indices): input i is drawn from [0, int_high(i, shapes)) when that is > 0.
  std::function<int64_t(size_t, const std::vector<Shape>&)> int_high = {};
  std::string group = {};  // which test case below validates it
};

int64_t rand_dim(std::mt19937& rng) {
  static const int64_t dims[] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  return dims[std::uniform_int_distribution<size_t>(0, 8)(rng)];
}

Shape rand_shape(std::mt19937& rng, int nd) {
  Shape s;
  for (int i = 0; i < nd; ++i) s.push_back(rand_dim(rng));
  return s;
}

int rand_int(std::mt19937& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

ShapeGen one(int lo_nd, int hi_nd) {
  return [=](std::mt19937& rng) { return std::vector<Shape>{rand_shape(rng, rand_int(rng, lo_nd, hi_nd))}; };
}

// Two shapes that broadcast: equal, a suffix of the first, or with some dims set to 1.
ShapeGen broadcasting(int n_inputs) {
  return [=](std::mt19937& rng) {
    const Shape base = rand_shape(rng, rand_int(rng, 1, 3));
    std::vector<Shape> out{base};
    for (int i = 1; i < n_inputs; ++i) {
      Shape s = base;
      switch (rand_int(rng, 0, 3)) {
        case 0: break;
        case 1: s.erase(s.begin(), s.begin() + rand_int(rng, 0, int(s.size()) - 1)); break;
        case 2:
          for (auto& d : s)
            if (rand_int(rng, 0, 1)) d = 1;
          break;
        case 3: s = {}; break;  // a 0-d tensor
      }
      out.push_back(s);
    }
    std::shuffle(out.begin(), out.end(), rng);  // the full-shaped input is not always first
    return out;
  };
}

// Random placements for one input of `ndim` dims on a mesh of `mesh_ndim` axes.
Placements rand_placements(std::mt19937& rng, size_t mesh_ndim, int64_t ndim, bool floating) {
  const ReduceOp fam[] = {ReduceOp::sum, ReduceOp::max, ReduceOp::min};
  const ReduceOp family = fam[rand_int(rng, 0, 2)];
  Placements p;
  for (size_t a = 0; a < mesh_ndim; ++a) {
    const int pick = rand_int(rng, 0, 9);
    if (pick < 2 || (pick >= 7 && !floating) || (pick < 7 && ndim == 0)) {
      p.push_back(Replicate());
    } else if (pick < 7) {
      p.push_back(Shard(rand_int(rng, 0, int(ndim) - 1)));
    } else {
      ReduceOp op = family;
      if (op == ReduceOp::sum && rand_int(rng, 0, 1)) op = ReduceOp::avg;
      p.push_back(Partial(op));
    }
  }
  return p;
}

std::string describe(const std::string& op, const Shape& mesh, const std::vector<Shape>& shapes,
                     const std::vector<std::optional<Placements>>& pl) {
  std::string s = op + " on mesh " + detail::concat(mesh) + ":";
  for (size_t i = 0; i < shapes.size(); ++i)
    s += " " + detail::concat(shapes[i]) + (pl[i] ? str(*pl[i]) : std::string("plain"));
  return s;
}

bool close(const Tensor& got, const Tensor& want, double tol, std::string* why) {
  if (got.shape() != want.shape()) {
    *why = detail::concat("shape ", got.shape(), " vs ", want.shape());
    return false;
  }
  const auto a = got.to_vector(), b = want.to_vector();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (!(std::fabs(a[i] - b[i]) <= tol * (1 + std::fabs(b[i])))) {
      *why = detail::concat("element ", i, ": ", a[i], " vs ", b[i]);
      return false;
    }
  }
  return true;
}

void validate(const OpCase& oc) {
  std::mt19937 rng(uint32_t(stable_hash(oc.name)));
  for (int trial = 0; trial < oc.trials; ++trial) {
    const Shape mesh_shape = test::random_mesh_shape(rng, 8);
    const std::vector<Shape> shapes = oc.shapes(rng);
    const size_t n = shapes.size();
    std::vector<std::optional<Placements>> pl(n);
    const size_t forced = size_t(rand_int(rng, 0, int(n) - 1));  // at least one input is distributed
    for (size_t i = 0; i < n; ++i)
      if (i == forced || rand_int(rng, 0, 4) > 0)
        pl[i] = rand_placements(rng, mesh_shape.size(), int64_t(shapes[i].size()),
                                !oc.int_high || oc.int_high(i, shapes) == 0);
    const uint64_t seed = rng();
    const std::string label = describe(oc.name, mesh_shape, shapes, pl);
    std::vector<std::string> failures;
    std::mutex mu;
    auto note = [&](const std::string& s) {
      std::lock_guard<std::mutex> lock(mu);
      failures.push_back(s);
    };
    try {
      run_threads_group(int(numel_of(mesh_shape)), [&](Communicator& c) {
        DeviceMesh mesh = test::mesh_of_shape(c, mesh_shape);
        std::vector<Tensor> full_in, ref_in, dist_in;
        for (size_t i = 0; i < n; ++i) {
          const int64_t high = oc.int_high ? oc.int_high(i, shapes) : 0;
          Tensor g = high > 0 ? randint(0, high, shapes[i], RngKey(seed, "in" + std::to_string(i)))
                              : randn(shapes[i], RngKey(seed, "in" + std::to_string(i)), {.dtype = DType::f64});
          if (oc.positive) g = abs(g) + 0.5;
          const bool grad = oc.grads && high == 0;
          full_in.push_back(g);
          ref_in.push_back(g.clone().set_requires_grad(grad));
          Tensor x = pl[i] ? make_dist(g, mesh, *pl[i], seed + i) : g.clone();
          dist_in.push_back(x.detach().set_requires_grad(grad));
        }
        Tensor want = oc.fn(ref_in);
        Tensor got = oc.fn(dist_in);
        if (!got.is_distributed()) { note("output is not distributed"); return; }
        std::string why;
        if (!close(full_tensor(got), want, 1e-9, &why)) { note("forward: " + why); return; }
        if (!oc.grads || !is_floating(want.dtype())) return;
        Tensor w = randn(want.shape(), RngKey(seed, "w"), {.dtype = DType::f64});
        sum(want * w).backward();
        sum(got * w).backward();
        for (size_t i = 0; i < n; ++i) {
          Tensor gw = ref_in[i].grad(), gd = dist_in[i].grad();
          if (!gw.defined() && !gd.defined()) continue;
          if (!gw.defined() || !gd.defined()) { note(detail::concat("gradient ", i, " defined on one side only")); return; }
          if (pl[i] && dist_in[i].is_distributed() && !(placements_of(gd) == placements_of(dist_in[i]))) {
            note(detail::concat("gradient ", i, " has placements ", str(placements_of(gd)), ", not the input's"));
            return;
          }
          if (!close(full_tensor(gd), gw, 1e-9, &why)) { note(detail::concat("gradient ", i, ": ", why)); return; }
        }
      });
    } catch (const std::exception& e) {
      failures.push_back(std::string("threw: ") + e.what());
    }
    for (const std::string& f : failures) FAIL_CHECK((label + " -> " + f));
    if (!failures.empty()) return;  // one failing trial per op is enough to read
  }
}

std::vector<OpCase> cases() {
  std::vector<OpCase> v;
  size_t marked = 0;
  auto group = [&](const char* name) {  // the cases added since the last call
    for (; marked < v.size(); ++marked) v[marked].group = name;
  };
  auto unary = [&](const char* name, std::function<Tensor(const Tensor&)> f, bool positive = false, bool grads = true) {
    v.push_back({name, one(1, 3), [f](const std::vector<Tensor>& x) { return f(x[0]); }, grads, positive});
  };
  unary("neg", [](const Tensor& x) { return neg(x); });
  unary("exp", [](const Tensor& x) { return exp(x); });
  unary("log", [](const Tensor& x) { return log(x); }, true);
  unary("sqrt", [](const Tensor& x) { return sqrt(x); }, true);
  unary("rsqrt", [](const Tensor& x) { return rsqrt(x); }, true);
  unary("tanh", [](const Tensor& x) { return tanh(x); });
  unary("sigmoid", [](const Tensor& x) { return sigmoid(x); });
  unary("silu", [](const Tensor& x) { return silu(x); });
  unary("gelu", [](const Tensor& x) { return gelu(x); });
  unary("relu", [](const Tensor& x) { return relu(x); });
  unary("abs", [](const Tensor& x) { return abs(x); });
  unary("sign", [](const Tensor& x) { return sign(x); }, false, false);
  unary("sin", [](const Tensor& x) { return sin(x); });
  unary("cos", [](const Tensor& x) { return cos(x); });
  unary("square", [](const Tensor& x) { return square(x); });
  unary("scalar arithmetic", [](const Tensor& x) { return (3.0 - x * 2.5 + 1.5) / 4.0; });
  unary("cast to f32 and back", [](const Tensor& x) { return cast(cast(x, DType::f32), DType::f64) * 0 + x * 2; });

  auto binary = [&](const char* name, std::function<Tensor(const Tensor&, const Tensor&)> f, bool positive = false,
                    bool grads = true) {
    v.push_back({name, broadcasting(2), [f](const std::vector<Tensor>& x) { return f(x[0], x[1]); }, grads, positive});
  };
  binary("add", [](const Tensor& a, const Tensor& b) { return add(a, b); });
  binary("sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); });
  binary("mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); });
  binary("div", [](const Tensor& a, const Tensor& b) { return div(a, b); }, true);
  binary("pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }, true);
  binary("maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); });
  binary("minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); });
  binary("gt", [](const Tensor& a, const Tensor& b) { return gt(a, b); }, false, false);
  binary("where", [](const Tensor& a, const Tensor& b) { return where(gt(a, scalar_like(0.1, a)), a, b); });
  v.push_back({"where of three", broadcasting(3),
               [](const std::vector<Tensor>& x) { return where(lt(x[0], scalar_like(0.0, x[0])), x[1], x[2]); }});

  group("pointwise");

  // matmul in its shapes: plain, batched with a shared weight, batched, broadcast batch, vector.
  auto mm = [&](const char* name, std::function<std::vector<Shape>(std::mt19937&)> g) {
    v.push_back({name, g, [](const std::vector<Tensor>& x) { return matmul(x[0], x[1]); }, true, false, 40});
  };
  mm("matmul mk,kn", [](std::mt19937& r) {
    const int64_t m = rand_dim(r), k = rand_dim(r), n = rand_dim(r);
    return std::vector<Shape>{{m, k}, {k, n}};
  });
  mm("matmul bmk,kn", [](std::mt19937& r) {
    const int64_t b = rand_dim(r), m = rand_dim(r), k = rand_dim(r), n = rand_dim(r);
    return std::vector<Shape>{{b, m, k}, {k, n}};
  });
  mm("matmul bmk,bkn", [](std::mt19937& r) {
    const int64_t b = rand_dim(r), m = rand_dim(r), k = rand_dim(r), n = rand_dim(r);
    return std::vector<Shape>{{b, m, k}, {b, k, n}};
  });
  mm("matmul broadcast batch", [](std::mt19937& r) {
    const int64_t b = rand_dim(r), m = rand_dim(r), k = rand_dim(r), n = rand_dim(r);
    return std::vector<Shape>{{1, m, k}, {b, 2, k, n}};
  });
  mm("matmul with a vector", [](std::mt19937& r) {
    const int64_t m = rand_dim(r), k = rand_dim(r);
    return std::vector<Shape>{{m, k}, {k}};
  });
  v.push_back({"linear", [](std::mt19937& r) {
                 const int64_t b = rand_dim(r), i = rand_dim(r), o = rand_dim(r);
                 return std::vector<Shape>{{b, i}, {o, i}, {o}};
               },
               [](const std::vector<Tensor>& x) { return linear(x[0], x[1], x[2]); }});

  // Reductions over random dims.
  auto red = [&](const char* name, std::function<Tensor(const Tensor&, std::mt19937&)> f, bool grads = true) {
    v.push_back({name, one(1, 3), [f](const std::vector<Tensor>& x) {
                   // Dims drawn from the global shape: the same on every rank and on both sides.
                   std::mt19937 r(uint32_t(x[0].numel() * 31 + x[0].dim()));
                   return f(x[0], r);
                 },
                 grads, false, 36});
  };
  auto rdims = [](const Tensor& x, std::mt19937& r) {
    Shape d;
    for (int64_t i = 0; i < x.dim(); ++i)
      if (rand_int(r, 0, 1)) d.push_back(i);
    if (d.empty()) d.push_back(x.dim() - 1);
    return d;
  };
  red("sum over all", [](const Tensor& x, std::mt19937&) { return sum(x); });
  red("sum over dims", [&](const Tensor& x, std::mt19937& r) { return sum(x, rdims(x, r)); });
  red("sum keepdim", [&](const Tensor& x, std::mt19937& r) { return sum(x, rdims(x, r), true); });
  red("mean over dims", [&](const Tensor& x, std::mt19937& r) { return mean(x, rdims(x, r)); });
  red("max over dims", [&](const Tensor& x, std::mt19937& r) { return max(x, rdims(x, r)); });
  red("min keepdim", [&](const Tensor& x, std::mt19937& r) { return min(x, rdims(x, r), true); });
  red("max over all", [](const Tensor& x, std::mt19937&) { return max(x); });
  red("argmax", [](const Tensor& x, std::mt19937&) { return argmax(x, -1); }, false);
  red("sum_squares", [](const Tensor& x, std::mt19937&) { return sum_squares(x); });

  group("matmul and reductions");

  // Views and copies.
  auto view3 = [&](const char* name, std::function<Tensor(const Tensor&)> f, bool grads = true) {
    v.push_back({name, one(3, 3), [f](const std::vector<Tensor>& x) { return f(x[0]); }, grads, false, 36});
  };
  view3("reshape merging dims", [](const Tensor& x) { return reshape(x, {x.size(0) * x.size(1), x.size(2)}); });
  view3("reshape merging the last dims", [](const Tensor& x) { return reshape(x, {x.size(0), -1}); });
  view3("flatten", [](const Tensor& x) { return flatten(x); });
  view3("reshape splitting a dim",
        [](const Tensor& x) { return reshape(reshape(x, {-1, x.size(2)}), {x.size(0), x.size(1), x.size(2)}) * 2.0; });
  view3("unsqueeze and squeeze", [](const Tensor& x) { return squeeze(unsqueeze(x, 1) * 2.0, 1); });
  view3("transpose", [](const Tensor& x) { return transpose(x, 0, 2); });
  view3("permute then reshape", [](const Tensor& x) { return reshape(permute(x, {2, 0, 1}), {-1}); });
  view3("contiguous of a transpose", [](const Tensor& x) { return contiguous(transpose(x, 1, 2)); });
  view3("clone", [](const Tensor& x) { return clone(x); });
  view3("expand a broadcast dim", [](const Tensor& x) {
    Tensor y = sum(x, {1}, true);
    return expand(y, {x.size(0), 5, x.size(2)});
  });
  view3("expand new leading dims", [](const Tensor& x) { return expand(x, {2, x.size(0), x.size(1), x.size(2)}); });
  view3("slice", [](const Tensor& x) { return x.slice(1, 0, x.size(1), 2); }, false);
  view3("select", [](const Tensor& x) { return x.select(0, -1); }, false);
  view3("zeros_like", [](const Tensor& x) { return zeros_like(x); }, false);
  view3("ones_like plus x", [](const Tensor& x) { return ones_like(x) + x; });

  group("views and copies");

  // nn ops (rules where they carry the attributes they need; the replicated fallback otherwise).
  view3("softmax", [](const Tensor& x) { return softmax(x, -1); });
  view3("log_softmax over dim 0", [](const Tensor& x) { return log_softmax(x, 0); });
  v.push_back({"rms_norm", [](std::mt19937& r) {
                 const Shape s = rand_shape(r, 3);
                 return std::vector<Shape>{s, {s[2]}};
               },
               [](const std::vector<Tensor>& x) { return rms_norm(x[0], x[1]); }});
  v.push_back({"layer_norm", [](std::mt19937& r) {
                 const Shape s = rand_shape(r, 2);
                 return std::vector<Shape>{s, {s[1]}, {s[1]}};
               },
               [](const std::vector<Tensor>& x) { return layer_norm(x[0], x[1], x[2]); }});
  v.push_back({"rms_norm without weight", one(1, 3), [](const std::vector<Tensor>& x) { return rms_norm(x[0], {}); }});
  v.push_back({"cross_entropy",
               [](std::mt19937& r) {
                 const int64_t n = rand_dim(r), c = rand_dim(r) + 1;
                 return std::vector<Shape>{{n, c}, {n}};
               },
               [](const std::vector<Tensor>& x) { return cross_entropy(x[0], x[1]); }, true, false, 30,
               [](size_t i, const std::vector<Shape>& s) { return i == 1 ? s[0][1] : int64_t(0); }});
  v.push_back({"cross_entropy per row",
               [](std::mt19937& r) {
                 const int64_t n = rand_dim(r), c = rand_dim(r) + 1;
                 return std::vector<Shape>{{n, c}, {n}};
               },
               [](const std::vector<Tensor>& x) { return cross_entropy(x[0], x[1], -100, Reduction::none); }, true,
               false, 30, [](size_t i, const std::vector<Shape>& s) { return i == 1 ? s[0][1] : int64_t(0); }});
  v.push_back({"embedding",
               [](std::mt19937& r) {
                 return std::vector<Shape>{{rand_dim(r), rand_dim(r)}, rand_shape(r, rand_int(r, 1, 2))};
               },
               [](const std::vector<Tensor>& x) { return embedding(x[0], x[1]); }, true, false, 40,
               [](size_t i, const std::vector<Shape>& s) { return i == 1 ? s[0][0] : int64_t(0); }});
  v.push_back({"cat", [](std::mt19937& r) {
                 const Shape a = rand_shape(r, 2);
                 return std::vector<Shape>{a, {rand_dim(r), a[1]}, {1, a[1]}};
               },
               [](const std::vector<Tensor>& x) { return cat({x[0], x[1], x[2]}, 0); }});
  v.push_back({"cat along the last dim", one(2, 3),
               [](const std::vector<Tensor>& x) { return cat({x[0], x[0] * 2.0}, -1); }});
  auto idx_of = [](size_t which) {
    return [which](size_t i, const std::vector<Shape>& s) { return i == which ? s[0][0] : int64_t(0); };
  };
  v.push_back({"gather", [](std::mt19937& r) {
                 const Shape a = rand_shape(r, 2);
                 return std::vector<Shape>{a, {rand_dim(r), a[1]}};
               },
               [](const std::vector<Tensor>& x) { return gather(x[0], 0, x[1]); }, true, false, 30, idx_of(1)});
  v.push_back({"scatter_add", [](std::mt19937& r) {
                 const Shape a = rand_shape(r, 2);
                 const int64_t n = rand_dim(r);
                 return std::vector<Shape>{a, {n, a[1]}, {n, a[1]}};
               },
               [](const std::vector<Tensor>& x) { return scatter_add(x[0], 0, x[1], x[2]); }, true, false, 30,
               idx_of(1)});
  v.push_back({"index_select", [](std::mt19937& r) {
                 return std::vector<Shape>{rand_shape(r, rand_int(r, 1, 3)), {rand_dim(r)}};
               },
               [](const std::vector<Tensor>& x) { return index_select(x[0], 0, x[1]); }, true, false, 30, idx_of(1)});
  v.push_back({"index_add", [](std::mt19937& r) {
                 const Shape a = rand_shape(r, 2);
                 const int64_t n = rand_dim(r);
                 return std::vector<Shape>{a, {n}, {n, a[1]}};
               },
               [](const std::vector<Tensor>& x) { return index_add(x[0], 0, x[1], x[2]); }, true, false, 30,
               idx_of(1)});
  v.push_back({"topk", one(1, 3), [](const std::vector<Tensor>& x) { return topk(x[0], 1, -1).first; }});
  v.push_back({"sort indices", one(2, 3),
               [](const std::vector<Tensor>& x) { return sort(x[0], 0, true).second; }, false});
  group("nn and index ops");
  return v;
}

}  // namespace

// Validates every case of one group; every op in it has a rule, so none may take the replicated
// fallback. Four test cases, so that the suite's longest case is a quarter of the whole (under
// the sanitizers it was a four-minute pole at the end of the run).
static void validate_group(const std::string& group) {
  set_dtensor_fallback_warnings_printed(false);
  const auto before = dtensor_fallback_warnings();
  int n = 0;
  for (const OpCase& oc : cases()) {
    if (oc.group != group) continue;
    INFO("op: ", oc.name);
    validate(oc);
    ++n;
  }
  CHECK(n > 0);
  for (const std::string& w : dtensor_fallback_warnings())
    if (std::find(before.begin(), before.end(), w) == before.end()) FAIL_CHECK(("fell back: " + w));
  set_dtensor_fallback_warnings_printed(true);
}

TEST_CASE("rules: pointwise ops agree with their single-process results on random meshes, placements and shapes") {
  validate_group("pointwise");
}
TEST_CASE("rules: matmul and reductions agree with their single-process results on random meshes, placements and shapes") {
  validate_group("matmul and reductions");
}
TEST_CASE("rules: views and copies agree with their single-process results on random meshes, placements and shapes") {
  validate_group("views and copies");
}
TEST_CASE("rules: nn and index ops agree with their single-process results on random meshes, placements and shapes") {
  validate_group("nn and index ops");
}
TEST_CASE("rules: every op case belongs to one of the four groups validated above") {
  const std::vector<std::string> groups = {"pointwise", "matmul and reductions", "views and copies", "nn and index ops"};
  for (const OpCase& oc : cases()) {
    INFO("op: ", oc.name);
    CHECK(std::find(groups.begin(), groups.end(), oc.group) != groups.end());
  }
}

TEST_CASE("rules: an op with no rule runs replicated and is warned about once") {
  set_dtensor_fallback_warnings_printed(false);
  run_threads_group(4, [](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2, 2});
    Tensor g = randn({5, 3}, RngKey(3, "g"), {.dtype = DType::f64});
    Tensor x = make_dist(g, mesh, {Shard(0), Partial()}, 3).detach().set_requires_grad();
    Tensor y = cumsum(x, 0);
    CHECK(placements_of(y) == Placements{Replicate(), Replicate()});
    CHECK(test::max_abs_diff(full_tensor(y), cumsum(g, 0)) < 1e-12);
    sum(y * y).backward();
    Tensor gr = g.clone().set_requires_grad();
    sum(cumsum(gr, 0) * cumsum(gr, 0)).backward();
    CHECK(test::max_abs_diff(full_tensor(x.grad()), gr.grad()) < 1e-9);
  });
  bool found = false;
  for (const std::string& w : dtensor_fallback_warnings()) found = found || w == "cumsum (S(0), P(sum))";
  CHECK(found);
  set_dtensor_fallback_warnings_printed(true);
}

TEST_CASE("rules: sharded inputs stay sharded without communication where the algebra allows") {
  run_threads_group(4, [](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {4});
    Tensor a = distribute_tensor(randn({8, 6}, RngKey(4, "a")), mesh, {Shard(0)});
    Tensor w = distribute_tensor(randn({6, 5}, RngKey(4, "w")), mesh, {Replicate()});
    CHECK(placements_of(relu(a) * 2.0) == Placements{Shard(0)});
    CHECK(placements_of(matmul(a, w)) == Placements{Shard(0)});       // row-parallel: no gather
    CHECK(placements_of(sum(a, {0})) == Placements{Partial()});        // reduction over the shard
    CHECK(placements_of(sum(a, {1})) == Placements{Shard(0)});
    CHECK(placements_of(transpose(a, 0, 1)) == Placements{Shard(1)});  // the shard moves with the dim
    CHECK(placements_of(reshape(a, {4, 2, 6})) == Placements{Shard(0)});  // 8 rows = 4 x 2, even
    Tensor b = distribute_tensor(randn({6, 5}, RngKey(4, "b")), mesh, {Shard(0)});
    Tensor ab = matmul(distribute_tensor(randn({8, 6}, RngKey(4, "a")), mesh, {Shard(1)}), b);
    CHECK(placements_of(ab) == Placements{Partial()});                 // contraction over the shard
    Tensor p = distribute_tensor(randn({8, 6}, RngKey(4, "p")), mesh, {Partial()});
    CHECK(placements_of(p * w.sum() + p) == Placements{Partial()});    // linear in the Partial input
    CHECK_FALSE(placements_of(exp(p))[0].is_partial());              // non-linear: reduced first
  });
}
