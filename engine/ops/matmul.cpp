// matmul: NumPy semantics (1-D promotion, broadcast batch dims). Operands that are
// transposed views go to the GEMM as transposed — no copy; only genuinely strided ones are copied.
#include "engine/ops/matmul.h"

#include <optional>

#include "engine/ops/binary.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/kernels.h"

namespace quilt {
namespace {

using ops::GemmOperand;
using ops::gemm_operand;

class Matmul final : public Primitive {
 public:
  const char* name() const override { return "matmul"; }

  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    return run(in, [](DType dt, const kernels::GemmArgs& g) { kernels::cpu::gemm(dt, g); });
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    void* stream = ops::stream_handle(in[0].device());
    return run(in, [stream](DType dt, const kernels::GemmArgs& g) { kernels::cuda::gemm(dt, g, stream); });
  }

  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override { saved_ = {in[0].detach(), in[1].detach()}; }

  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    const Tensor& a = saved_[0];
    const Tensor& b = saved_[1];
    Tensor ga, gb;
    if (ctx.needs[0]) ga = sum_to(matmul(g, transpose(b, -1, -2)), ctx.inputs[0].shape);
    if (ctx.needs[1]) {
      if (b.dim() == 2 && a.dim() > 2) {  // weight gradient: one GEMM over all rows
        const int64_t k = a.size(-1), n = b.size(-1);
        gb = matmul(transpose(reshape(a, {-1, k}), 0, 1), reshape(g, {-1, n}));
      } else {
        gb = sum_to(matmul(transpose(a, -1, -2), g), ctx.inputs[1].shape);
      }
    }
    return {ga, gb};
  }

 private:
  // The output and the GEMM arguments, shared by both devices; `gemm(dtype, args)` runs the kernel.
  template <class Gemm>
  static std::vector<Tensor> run(const std::vector<Tensor>& in, const Gemm& gemm) {
    Tensor a = in[0], b = in[1];
    const Device dev = a.device();
    const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
    // Fold a's batch dims into M when b has none and a allows it (one big GEMM).
    if (b.dim() == 2 && a.dim() > 2 && a.is_contiguous() && k > 0) {
      const int64_t rows = a.numel() / k;
      Shape out_shape(a.shape().begin(), a.shape().end() - 1);
      out_shape.push_back(n);
      Tensor a_flat = Tensor::from_storage(a.storage(), {rows, k}, {k, 1}, a.offset(), a.dtype());
      Tensor out = run2d(a_flat, b, dev, gemm);
      return {Tensor::from_storage(out.storage(), out_shape, contiguous_strides(out_shape), 0, out.dtype())};
    }
    Shape batch_a(a.shape().begin(), a.shape().end() - 2), batch_b(b.shape().begin(), b.shape().end() - 2);
    const Shape batch = broadcast_shapes(batch_a, batch_b, "matmul");
    Shape out_shape = batch;
    out_shape.push_back(m);
    out_shape.push_back(n);
    Tensor out = Tensor::empty(out_shape, {.dtype = a.dtype(), .device = dev});
    if (out.numel() == 0) return {out};
    const GemmOperand oa = gemm_operand(a), ob = gemm_operand(b);
    const int64_t nb = numel_of(batch);
    std::vector<int64_t> ao(static_cast<size_t>(nb)), bo(static_cast<size_t>(nb)), co(static_cast<size_t>(nb));
    Tensor ab = Tensor::from_storage(a.storage(), batch_a, Shape(a.strides().begin(), a.strides().end() - 2), 0, a.dtype());
    Tensor bb = Tensor::from_storage(b.storage(), batch_b, Shape(b.strides().begin(), b.strides().end() - 2), 0, b.dtype());
    const Shape sa = ops::broadcast_strides(ab, batch), sb = ops::broadcast_strides(bb, batch);
    for (int64_t i = 0; i < nb; ++i) {
      int64_t rem = i, offa = 0, offb = 0;
      for (int64_t d = int64_t(batch.size()) - 1; d >= 0; --d) {
        const int64_t idx = rem % batch[size_t(d)];
        rem /= batch[size_t(d)];
        offa += idx * sa[size_t(d)];
        offb += idx * sb[size_t(d)];
      }
      ao[size_t(i)] = offa;
      bo[size_t(i)] = offb;
      co[size_t(i)] = i * m * n;
    }
    kernels::GemmArgs g;
    g.m = m; g.n = n; g.k = k;
    g.trans_a = oa.trans; g.lda = oa.ld; g.a = a.data_ptr();
    g.trans_b = ob.trans; g.ldb = ob.ld; g.b = b.data_ptr();
    g.c = out.data_ptr(); g.ldc = std::max<int64_t>(n, 1);
    g.batch = nb; g.a_offsets = ao.data(); g.b_offsets = bo.data(); g.c_offsets = co.data();
    gemm(a.dtype(), g);
    return {out};
  }
  template <class Gemm>
  static Tensor run2d(const Tensor& a, Tensor b, Device dev, const Gemm& gemm) {
    const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
    Tensor out = Tensor::empty({m, n}, {.dtype = a.dtype(), .device = dev});
    if (out.numel() == 0) return out;
    const GemmOperand ob = gemm_operand(b);
    kernels::GemmArgs g;
    g.m = m; g.n = n; g.k = k;
    g.trans_a = false; g.lda = std::max<int64_t>(a.stride(0), k); g.a = a.data_ptr();
    g.trans_b = ob.trans; g.ldb = ob.ld; g.b = b.data_ptr();
    g.c = out.data_ptr(); g.ldc = std::max<int64_t>(n, 1);
    gemm(a.dtype(), g);
    return out;
  }
};

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  QUILT_CHECK(a.dim() >= 1 && b.dim() >= 1, "[matmul] both operands need at least 1 dim, got ", a.shape(), " @ ",
              b.shape());
  QUILT_CHECK(is_floating(a.dtype()) && a.dtype() == b.dtype(), "[matmul] needs two floating tensors of one dtype, got ",
              dtype_name(a.dtype()), " @ ", dtype_name(b.dtype()));
  if (a.dim() == 1 && b.dim() == 1) return reshape(matmul(unsqueeze(a, 0), unsqueeze(b, -1)), {});
  if (a.dim() == 1) return squeeze(matmul(unsqueeze(a, 0), b), -2);
  if (b.dim() == 1) return squeeze(matmul(a, unsqueeze(b, -1)), -1);
  QUILT_CHECK(a.size(-1) == b.size(-2), "[matmul] inner dims differ: ", a.shape(), " @ ", b.shape());
  return apply1(std::make_shared<Matmul>(), {a, b});
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  QUILT_CHECK(w.dim() == 2, "[linear] weight must be (out, in), got ", w.shape());
  QUILT_CHECK(x.size(-1) == w.size(1), "[linear] input features ", x.size(-1), " differ from weight in-features ",
              w.size(1), " (weight ", w.shape(), ")");
  Tensor y = matmul(x, transpose(w, 0, 1));
  return bias.defined() ? y + bias : y;
}

namespace ops {

std::optional<GemmOperand> gemm_operand_of(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  if (cs == 1 || cols <= 1) {
    const int64_t ld = rows <= 1 ? std::max<int64_t>(cols, 1) : rs;
    if (ld >= std::max<int64_t>(cols, 1)) return GemmOperand{false, ld};
  }
  if (rs == 1 || rows <= 1) {
    const int64_t ld = cols <= 1 ? std::max<int64_t>(rows, 1) : cs;
    if (ld >= std::max<int64_t>(rows, 1)) return GemmOperand{true, ld};
  }
  return std::nullopt;
}

GemmOperand gemm_operand(Tensor& t) {
  const int64_t r = t.dim() - 2, c = t.dim() - 1;
  if (auto op = gemm_operand_of(t.size(r), t.size(c), t.stride(r), t.stride(c))) return *op;
  t = contiguous(t);
  return *gemm_operand_of(t.size(r), t.size(c), t.stride(r), t.stride(c));
}

}  // namespace ops

}  // namespace quilt
