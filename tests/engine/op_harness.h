// One harness for every op, in the spirit of ggml's test-backend-ops. A case names its
// inputs (shape + how to draw them), the op, and a naive float64 reference; run_op_case()
// then checks, on fresh random inputs:
//   1. f64 and f32 forward against the reference,
//   2. the same with non-contiguous (strided/transposed) inputs,
//   3. bf16 and f16 forward against f32 on the same rounded inputs, within their precision,
//   4. backward against central finite differences in f64 (gradcheck),
//   5. backward with non-contiguous inputs equal to backward with contiguous ones,
//   6. with a usable GPU: f32 and bf16 forward and f32 backward on the device equal the CPU's
//      (an op without a CUDA kernel is named in a message instead).
// Adding an op is a few lines:
//   run_op_case({.name = "exp", .inputs = {{{3, 5}}}, .op = [](auto& x) { return V{exp(x[0])}; },
//                .ref = [](auto& r) { return R{map(r[0], [](double a) { return std::exp(a); })}; }});
// An op that makes or captures tensors of its own (offsets, masks) puts them on its inputs'
// device (`offsets.to(x[0].device())`), so that check 6 runs it on the GPU as on the CPU.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace quilt::test {

/// A float64 array with a shape: the reference side of the harness.
struct Ref {
  Shape shape;
  std::vector<double> v;
  Ref() = default;
  Ref(Shape s, std::vector<double> vals) : shape(std::move(s)), v(std::move(vals)) {}
  explicit Ref(Shape s, double fill = 0.0) : shape(std::move(s)), v(size_t(numel_of(shape)), fill) {}
  static Ref of(const Tensor& t) { return Ref(t.shape(), t.to_vector()); }
  int64_t numel() const { return int64_t(v.size()); }
  int64_t dim() const { return int64_t(shape.size()); }
  Shape strides() const { return contiguous_strides(shape); }
  double& operator[](int64_t i) { return v[size_t(i)]; }
  double operator[](int64_t i) const { return v[size_t(i)]; }
  /// Element at a multi-index.
  double at(const Shape& idx) const;
  double& at(const Shape& idx);
};

/// Multi-index of linear index i in shape.
Shape unravel(int64_t i, const Shape& shape);
/// Elementwise map.
Ref map(const Ref& a, const std::function<double(double)>& f);
/// Elementwise with NumPy broadcasting.
Ref zip(const Ref& a, const Ref& b, const std::function<double(double, double)>& f);
/// Reduction over dims (all when empty) with init and combine; keepdim as in the engine.
Ref reduce(const Ref& a, Shape dims, bool keepdim, double init, const std::function<double(double, double)>& f);
/// Batched matmul with NumPy rules (1-D promotion, broadcast batch dims).
Ref matmul(const Ref& a, const Ref& b);
/// Permute dims.
Ref permute(const Ref& a, const Shape& dims);

/// How an input is drawn.
enum class Gen {
  normal,          // N(0, 1)
  positive,        // uniform [0.5, 2)
  away_from_zero,  // N(0,1) pushed to |x| >= 0.2 (ops with a kink at 0)
  unit,            // uniform [0, 1)
  index,           // integers in [0, index_high)
  mask,            // bool, about half true
  distinct,        // N(0,1), every two values of the case's distinct inputs >= 1e-3 apart (ops whose
                   // gradient jumps where two values meet: max, min, maximum, sort, topk; a pair
                   // closer than the finite-difference step would make gradcheck measure the jump)
};

struct In {
  Shape shape;
  Gen gen = Gen::normal;
  bool grad = true;         // gradcheck this input (floating gens only)
  int64_t index_high = 0;   // Gen::index: exclusive upper bound
  DType index_dtype = DType::i64;
};

using V = std::vector<Tensor>;
using R = std::vector<Ref>;

struct OpCase {
  std::string name;
  std::vector<In> inputs;
  std::function<V(const V&)> op;
  std::function<R(const R&)> ref;
  bool lowp = true;        // run the bf16/f16 check
  bool gradcheck = true;   // run finite differences
  bool noncontig = true;   // run with strided inputs
  double lowp_tol = 0.0;   // override the bf16 tolerance (relative to the output's scale)
  double f32_tol = 2e-5;   // relative to the output's scale
};

/// Runs every check of one case; failures report the case name and the seed.
void run_op_case(const OpCase& c);

/// The seed of this run (fresh each run unless QUILT_TEST_SEED is set).
uint64_t test_seed();

}  // namespace quilt::test
