// Mixture-of-experts primitives (moe.h), with CPU kernels in kernels/cpu/moe.cpp.
//
// grouped_mm and grouped_mm_weight_grad are each other's backward (with grouped_mm itself);
// the row ops form a closed family of three:
//   moe_permute   (x, order[, w]) -> out[p] = w[order[p]] * x[order[p] / k]      (T*k, H)
//   moe_unpermute (y, order[, w]) -> out[t] = sum_j w[t*k+j] * y[row of slot t*k+j]  (T, H)
//   moe_slot_dot  (a, b, order)   -> d[t, j] = dot(a[t], b[row of slot t*k+j])      (T, k)
// whose gradients are written with one another (a missing w means ones), so every backward is
// made of ops and runs distributed when its inputs are. Integer inputs get no gradient.
//
// On CUDA every primitive runs kernels/cuda/{grouped_gemm,moe}.cu without waiting for the
// device: offsets and orders stay on the device, so they are not checked there (the kernels
// clamp bad values instead of reading out of bounds); moe_route's host_counts copy is the one
// sync, and it also catches expert indices outside [0, E).
#include "engine/ops/moe.h"

#include <optional>

#include "engine/ops/creation.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"
#include "kernels/cpu/moe.h"
#include "kernels/cuda/moe.h"

namespace quilt {
namespace {

// ---- helpers ----

using ops::gemm_operand;
using Operand = ops::GemmOperand;

// An integer tensor's values on the host as i64 (a device tensor is copied back: a sync).
std::vector<int64_t> host_i64(const Tensor& t) {
  Tensor c = contiguous(cast(t.device().is_cpu() ? t : t.to(Device::cpu()), DType::i64));
  const int64_t* p = c.data<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

// A contiguous i64 copy (or t itself) for kernels that read indices by pointer.
Tensor i64_contiguous(const Tensor& t) { return contiguous(cast(t, DType::i64)); }

// Rows with unit column stride, as the row kernels read them.
Tensor unit_cols(const Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1 ? t : contiguous(t); }
int64_t row_stride(const Tensor& t) { return t.size(0) <= 1 ? t.size(1) : t.stride(0); }

bool is_index_dtype(DType dt) { return dt == DType::i32 || dt == DType::i64; }

void* stream_of(const Tensor& t) { return ops::stream_handle(t.device()); }

// The device inverse of a routing order (slot -> row, -1 where no row names the slot); unchecked.
Tensor device_slot_row(const Tensor& order64) {
  Tensor slot_row = Tensor::empty({order64.numel()}, {.dtype = DType::i64, .device = order64.device()});
  kernels::cuda::moe_invert_order(order64.numel(), order64.data<int64_t>(), slot_row.data<int64_t>(),
                                  stream_of(order64));
  return slot_row;
}

// Throws unless offsets are non-decreasing, non-negative and end at m (grouped_mm's contract).
void check_offsets(const char* op, const std::vector<int64_t>& off, const Tensor& x) {
  const int64_t m = x.size(0);
  if (off.empty()) {
    QUILT_CHECK(m == 0, "[", op, "] offsets is empty (no groups) but x ", x.shape(), " has ", m, " rows");
    return;
  }
  for (size_t e = 0; e < off.size(); ++e) {
    if (e == 0) QUILT_CHECK(off[0] >= 0, "[", op, "] offsets[0] = ", off[0], " is negative");
    else
      QUILT_CHECK(off[e] >= off[e - 1], "[", op, "] offsets[", e, "] = ", off[e], " is less than offsets[", e - 1,
                  "] = ", off[e - 1], " (offsets must be non-decreasing)");
  }
  QUILT_CHECK(off.back() == m, "[", op, "] offsets[", off.size() - 1, "] = ", off.back(),
              " (the last) must equal the rows of x ", x.shape(), ", ", m);
}

// The inverse of a routing order (slot -> row); throws naming the first bad entry.
std::vector<int64_t> invert_order(const char* op, const Tensor& order64) {
  const int64_t n = order64.numel();
  std::vector<int64_t> slot_row(static_cast<size_t>(n));
  const int64_t* o = order64.data<int64_t>();
  const int64_t bad = kernels::cpu::moe_invert_order(n, o, slot_row.data());
  if (bad >= 0) {
    const int64_t v = o[bad];
    if (v < 0 || v >= n) fail("[", op, "] order[", bad, "] = ", v, " is outside [0, ", n, ")");
    fail("[", op, "] order[", bad, "] = ", v, " repeats an earlier entry (order must be a permutation of [0, ", n, "))");
  }
  return slot_row;
}

// ---- grouped GEMMs ----

Tensor run_grouped_mm(const Tensor& x, const Tensor& w, const Tensor& offsets);
Tensor run_weight_grad(const Tensor& x, const Tensor& dy, const Tensor& offsets);

// grouped_mm's offsets where the CPU kernel reads them: on the host, checked.
std::vector<int64_t> host_offsets(const char* op, const Tensor& offsets, const Tensor& x) {
  std::vector<int64_t> off = host_i64(offsets);
  check_offsets(op, off, x);
  return off;
}
// grouped_mm's offsets where the CUDA kernel reads them: on the device, as i64 (no sync, so only
// an empty offsets is refused).
Tensor device_offsets(const char* op, const Tensor& offsets, const Tensor& x) {
  QUILT_CHECK(offsets.numel() > 0 || x.size(0) == 0, "[", op, "] offsets is empty (no groups) but x ", x.shape(),
              " has ", x.size(0), " rows");
  return i64_contiguous(offsets);
}

// out (M, N) = x (M, K) @ w[group] (E, K, N), groups given by offsets (E).
class GroupedMm final : public Primitive {
 public:
  const char* name() const override { return "grouped_mm"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const std::vector<int64_t> off = host_offsets(name(), in[2], in[0]);
    return run(in, off.data(), [](DType dt, const kernels::GroupedGemmArgs& g) { kernels::cpu::grouped_gemm(dt, g); });
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor off = device_offsets(name(), in[2], in[0]);
    void* stream = stream_of(in[0]);
    return run(in, off.data<int64_t>(), [stream](DType dt, const kernels::GroupedGemmArgs& g) {
      kernels::cuda::grouped_gemm(dt, g, stream);
    });
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override {
    saved_ = {in[0].detach(), in[1].detach(), in[2].detach()};
  }
  // dx_e = dY_e @ w_e^T (grouped_mm with w's transposed view); dw_e = x_e^T @ dY_e. When w is
  // a transposed view of (E, N, K) storage (stacked Linear weights), dw comes in that storage
  // order, dw_e^T = dY_e^T @ x_e, so the weight's gradient is contiguous like the weight.
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    const Tensor &x = saved_[0], &w = saved_[1], &offsets = saved_[2];
    Tensor gx = ctx.needs[0] ? run_grouped_mm(g, transpose(w, 1, 2), offsets) : Tensor();
    Tensor gw;
    if (ctx.needs[1])
      gw = stored_transposed(w) ? transpose(run_weight_grad(g, x, offsets), 1, 2) : run_weight_grad(x, g, offsets);
    return {gx, gw, Tensor()};
  }

 private:
  // The output and the kernel's arguments, shared by both devices; `gemm(dtype, args)` runs the
  // kernel, `offsets` are where it reads them.
  template <class Gemm>
  static std::vector<Tensor> run(const std::vector<Tensor>& in, const int64_t* offsets, const Gemm& gemm) {
    Tensor x = in[0], w = in[1];
    const int64_t m = x.size(0), k = x.size(1), n = w.size(2);
    if (k == 0) return {zeros({m, n}, {.dtype = x.dtype(), .device = x.device()})};  // empty sums
    Tensor out = Tensor::empty({m, n}, {.dtype = x.dtype(), .device = x.device()});
    if (out.numel() == 0) return {out};
    const Operand ox = gemm_operand(x), ow = gemm_operand(w);
    kernels::GroupedGemmArgs g;
    g.groups = in[2].numel();
    g.offsets = offsets;
    g.m = m; g.n = n; g.k = k;
    g.x = x.data_ptr(); g.trans_x = ox.trans; g.ldx = ox.ld;
    g.w = w.data_ptr(); g.trans_w = ow.trans; g.ldw = ow.ld; g.w_group_stride = w.stride(0);
    g.out = out.data_ptr(); g.ldo = n;
    gemm(x.dtype(), g);
    return {out};
  }
  // True when w's (K, N) matrices are stored column-major (w is a transposed view).
  static bool stored_transposed(const Tensor& w) {
    const Tensor& l = w.is_distributed() ? w.local() : w;
    const auto op = ops::gemm_operand_of(l.size(1), l.size(2), l.stride(1), l.stride(2));
    return op && op->trans && l.size(1) > 1 && l.size(2) > 1;
  }
};

// dw (E, K, N): dw_e = x_e^T @ dy_e over group e's rows of x (M, K) and dy (M, N); zeros for
// an empty group.
class GroupedMmWeightGrad final : public Primitive {
 public:
  const char* name() const override { return "grouped_mm_weight_grad"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const std::vector<int64_t> off = host_offsets(name(), in[2], in[0]);
    return run(in, off.data(), [](DType dt, const kernels::GroupedGemmWeightGradArgs& g) {
      kernels::cpu::grouped_gemm_weight_grad(dt, g);
    });
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor off = device_offsets(name(), in[2], in[0]);
    void* stream = stream_of(in[0]);
    return run(in, off.data<int64_t>(), [stream](DType dt, const kernels::GroupedGemmWeightGradArgs& g) {
      kernels::cuda::grouped_gemm_weight_grad(dt, g, stream);
    });
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override {
    saved_ = {in[0].detach(), in[1].detach(), in[2].detach()};
  }
  // L = sum_e <G_e, x_e^T dy_e>: dx_e = dy_e @ G_e^T, ddy_e = x_e @ G_e.
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    const Tensor &x = saved_[0], &dy = saved_[1], &offsets = saved_[2];
    Tensor gx = ctx.needs[0] ? run_grouped_mm(dy, transpose(g, 1, 2), offsets) : Tensor();
    Tensor gdy = ctx.needs[1] ? run_grouped_mm(x, g, offsets) : Tensor();
    return {gx, gdy, Tensor()};
  }

 private:
  // The output and the kernel's arguments, shared by both devices; `gemm(dtype, args)` runs the
  // kernel, `offsets` are where it reads them.
  template <class Gemm>
  static std::vector<Tensor> run(const std::vector<Tensor>& in, const int64_t* offsets, const Gemm& gemm) {
    Tensor x = in[0], dy = in[1];
    const int64_t e = in[2].numel(), m = x.size(0), k = x.size(1), n = dy.size(1);
    if (m == 0) return {zeros({e, k, n}, {.dtype = x.dtype(), .device = x.device()})};  // every group empty
    Tensor dw = Tensor::empty({e, k, n}, {.dtype = x.dtype(), .device = x.device()});
    if (dw.numel() == 0) return {dw};
    const Operand ox = gemm_operand(x), ody = gemm_operand(dy);
    kernels::GroupedGemmWeightGradArgs g;
    g.groups = e;
    g.offsets = offsets;
    g.m = m; g.n = n; g.k = k;
    g.x = x.data_ptr(); g.trans_x = ox.trans; g.ldx = ox.ld;
    g.dy = dy.data_ptr(); g.trans_dy = ody.trans; g.lddy = ody.ld;
    g.dw = dw.data_ptr();
    gemm(x.dtype(), g);
    return {dw};
  }
};

Tensor run_grouped_mm(const Tensor& x, const Tensor& w, const Tensor& offsets) {
  return apply1(std::make_shared<GroupedMm>(), {x, w, offsets});
}
Tensor run_weight_grad(const Tensor& x, const Tensor& dy, const Tensor& offsets) {
  return apply1(std::make_shared<GroupedMmWeightGrad>(), {x, dy, offsets});
}

// ---- routing ----

// expert_idx (T, k) -> order (T*k), counts (E), offsets (E): a stable counting sort by expert.
class MoeRoute final : public Primitive {
 public:
  explicit MoeRoute(int64_t num_experts) : num_experts_(num_experts) {}
  const char* name() const override { return "moe_route"; }
  Attrs attrs() const override { return {{"num_experts", num_experts_}}; }
  // A stable device sort; an index outside [0, E) is left out of counts (moe_route checks).
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor& idx = in[0];
    const Tensor idx64 = i64_contiguous(idx);
    const int64_t n = idx64.numel();
    const TensorOptions opts{.dtype = DType::i64, .device = idx.device()};
    Tensor order = Tensor::empty({n}, opts), counts = Tensor::empty({num_experts_}, opts);
    Tensor offsets = Tensor::empty({num_experts_}, opts);
    kernels::cuda::moe_route(idx64.data<int64_t>(), n, num_experts_, order.data<int64_t>(), counts.data<int64_t>(),
                             offsets.data<int64_t>(), stream_of(idx));
    return {order, counts, offsets};
  }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor& idx = in[0];
    const std::vector<int64_t> e = host_i64(idx);
    const int64_t n = int64_t(e.size()), k = idx.size(1), ne = num_experts_;
    const TensorOptions opts{.dtype = DType::i64, .device = idx.device()};
    Tensor order = Tensor::empty({n}, opts), counts = zeros({ne}, opts), offsets = Tensor::empty({ne}, opts);
    int64_t* c = counts.data<int64_t>();
    for (int64_t s = 0; s < n; ++s) {
      if (e[size_t(s)] < 0 || e[size_t(s)] >= ne)
        fail("[moe_route] expert_idx[", s / k, ", ", s % k, "] = ", e[size_t(s)], " is outside [0, ", ne,
             ") (num_experts = ", ne, ")");
      ++c[e[size_t(s)]];
    }
    int64_t* off = offsets.data<int64_t>();
    std::vector<int64_t> next(static_cast<size_t>(ne));
    for (int64_t x = 0, run = 0; x < ne; ++x) {
      next[size_t(x)] = run;
      run += c[x];
      off[x] = run;
    }
    int64_t* o = order.data<int64_t>();
    for (int64_t s = 0; s < n; ++s) o[next[size_t(e[size_t(s)])]++] = s;  // slots in order: stable
    return {order, counts, offsets};
  }
  bool differentiable_output(size_t, const Tensor&) const override { return false; }

 private:
  int64_t num_experts_;
};

// ---- permutation family ----

Tensor run_permute(int64_t k, const Tensor& x, const Tensor& order, const Tensor& w);
Tensor run_unpermute(int64_t k, const Tensor& y, const Tensor& order, const Tensor& w);
Tensor run_slot_dot(int64_t k, const Tensor& a, const Tensor& b, const Tensor& order);

// out[p] = w[order[p]] * x[order[p] / k]; w (T, k) or undefined (ones).
class MoePermute final : public Primitive {
 public:
  explicit MoePermute(int64_t k) : k_(k) {}
  const char* name() const override { return "moe_permute"; }
  Attrs attrs() const override { return {{"k", k_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Inputs a = inputs(in);
    invert_order(name(), a.order);  // throws unless order is a permutation
    Tensor out = output_for(a);
    if (out.numel() > 0)
      kernels::cpu::moe_permute(a.x.dtype(), out.size(0), out.size(1), k_, a.order.data<int64_t>(), a.x.data_ptr(),
                                row_stride(a.x), a.w.defined() ? a.w.data_ptr() : nullptr, out.data_ptr());
    return {out};
  }
  // The order is not checked: a bad entry gives a zero row.
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Inputs a = inputs(in);
    Tensor out = output_for(a);
    if (out.numel() > 0)
      kernels::cuda::moe_permute(a.x.dtype(), out.size(0), out.size(1), k_, a.order.data<int64_t>(), a.x.data_ptr(),
                                 row_stride(a.x), a.w.defined() ? a.w.data_ptr() : nullptr, out.data_ptr(),
                                 stream_of(a.x));
    return {out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override {
    saved_ = {in[0].detach(), in[1].detach(), in[2].defined() ? in[2].detach() : Tensor()};
  }
  // dx[t] = sum_j w[t,j] * g[row of slot t*k+j] (the combine); dw[t,j] = dot(x[t], g[row of t*k+j]).
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    const Tensor &x = saved_[0], &order = saved_[1], &w = saved_[2];
    Tensor gx = ctx.needs[0] ? run_unpermute(k_, g, order, w) : Tensor();
    Tensor gw = w.defined() && ctx.needs[2] ? run_slot_dot(k_, x, g, order) : Tensor();
    return {gx, Tensor(), gw};
  }

 private:
  // x, order and w as the kernels read them.
  struct Inputs {
    Tensor x, order, w;
  };
  static Inputs inputs(const std::vector<Tensor>& in) {
    return {unit_cols(in[0]), i64_contiguous(in[1]), in[2].defined() ? contiguous(in[2]) : Tensor()};
  }
  // (T*k, H): one row per slot.
  static Tensor output_for(const Inputs& a) {
    return Tensor::empty({a.order.numel(), a.x.size(1)}, {.dtype = a.x.dtype(), .device = a.x.device()});
  }

  int64_t k_;
};

// out[t] = sum_{j<k} w[t,j] * y[row of slot t*k+j], in order j; w (T, k) or undefined (ones).
class MoeUnpermute final : public Primitive {
 public:
  explicit MoeUnpermute(int64_t k) : k_(k) {}
  const char* name() const override { return "moe_unpermute"; }
  Attrs attrs() const override { return {{"k", k_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Inputs a = inputs(in);
    const std::vector<int64_t> slot_row = invert_order(name(), a.order);
    Tensor out = output_for(a);
    if (out.numel() > 0)
      kernels::cpu::moe_unpermute(a.y.dtype(), out.size(0), out.size(1), k_, slot_row.data(), a.y.data_ptr(),
                                  row_stride(a.y), a.w.defined() ? a.w.data_ptr() : nullptr, out.data_ptr());
    return {out};
  }
  // A gather-and-sum per token: deterministic without atomics; the order is not checked.
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Inputs a = inputs(in);
    Tensor out = output_for(a);
    if (out.numel() == 0) return {out};
    const Tensor slot_row = device_slot_row(a.order);
    kernels::cuda::moe_unpermute(a.y.dtype(), out.size(0), out.size(1), k_, slot_row.data<int64_t>(), a.y.data_ptr(),
                                 row_stride(a.y), a.w.defined() ? a.w.data_ptr() : nullptr, out.data_ptr(),
                                 stream_of(a.y));
    return {out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override {
    saved_ = {in[0].detach(), in[1].detach(), in[2].defined() ? in[2].detach() : Tensor()};
  }
  // dy[row of slot s] = w[s] * g[s / k] (a weighted permute); dw[t,j] = dot(g[t], y[row of t*k+j]).
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    const Tensor &y = saved_[0], &order = saved_[1], &w = saved_[2];
    Tensor gy = ctx.needs[0] ? run_permute(k_, g, order, w) : Tensor();
    Tensor gw = w.defined() && ctx.needs[2] ? run_slot_dot(k_, g, y, order) : Tensor();
    return {gy, Tensor(), gw};
  }

 private:
  // y, order and w as the kernels read them.
  struct Inputs {
    Tensor y, order, w;
  };
  static Inputs inputs(const std::vector<Tensor>& in) {
    return {unit_cols(in[0]), i64_contiguous(in[1]), in[2].defined() ? contiguous(in[2]) : Tensor()};
  }
  // (T, H): one row per token.
  Tensor output_for(const Inputs& a) const {
    return Tensor::empty({a.y.size(0) / k_, a.y.size(1)}, {.dtype = a.y.dtype(), .device = a.y.device()});
  }

  int64_t k_;
};

// d (T, k): d[t, j] = dot(a[t], b[row of slot t*k+j]) for a (T, H), b (T*k, H) in routed order.
class MoeSlotDot final : public Primitive {
 public:
  explicit MoeSlotDot(int64_t k) : k_(k) {}
  const char* name() const override { return "moe_slot_dot"; }
  Attrs attrs() const override { return {{"k", k_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Inputs x = inputs(in);
    const std::vector<int64_t> slot_row = invert_order(name(), x.order);
    Tensor d = output_for(x);
    if (d.numel() > 0)
      kernels::cpu::moe_slot_dot(x.a.dtype(), x.a.size(0), x.a.size(1), k_, slot_row.data(), x.a.data_ptr(),
                                 row_stride(x.a), x.b.data_ptr(), row_stride(x.b), d.data_ptr());
    return {d};
  }
  // The order is not checked.
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Inputs x = inputs(in);
    Tensor d = output_for(x);
    if (d.numel() == 0) return {d};
    const Tensor slot_row = device_slot_row(x.order);
    kernels::cuda::moe_slot_dot(x.a.dtype(), x.a.size(0), x.a.size(1), k_, slot_row.data<int64_t>(), x.a.data_ptr(),
                                row_stride(x.a), x.b.data_ptr(), row_stride(x.b), d.data_ptr(), stream_of(x.a));
    return {d};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override {
    saved_ = {in[0].detach(), in[1].detach(), in[2].detach()};
  }
  // Bilinear: da[t] = sum_j g[t,j] * b[row of t*k+j] (a combine), db[p] = g[order[p]] * a[order[p]/k].
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    const Tensor &a = saved_[0], &b = saved_[1], &order = saved_[2];
    Tensor ga = ctx.needs[0] ? run_unpermute(k_, b, order, g) : Tensor();
    Tensor gb = ctx.needs[1] ? run_permute(k_, a, order, g) : Tensor();
    return {ga, gb, Tensor()};
  }

 private:
  // a, b and order as the kernels read them.
  struct Inputs {
    Tensor a, b, order;
  };
  static Inputs inputs(const std::vector<Tensor>& in) {
    return {unit_cols(in[0]), unit_cols(in[1]), i64_contiguous(in[2])};
  }
  // (T, k): one dot per slot.
  Tensor output_for(const Inputs& x) const {
    return Tensor::empty({x.a.size(0), k_}, {.dtype = x.a.dtype(), .device = x.a.device()});
  }

  int64_t k_;
};

Tensor run_permute(int64_t k, const Tensor& x, const Tensor& order, const Tensor& w) {
  return apply1(std::make_shared<MoePermute>(k), {x, order, w});
}
Tensor run_unpermute(int64_t k, const Tensor& y, const Tensor& order, const Tensor& w) {
  return apply1(std::make_shared<MoeUnpermute>(k), {y, order, w});
}
Tensor run_slot_dot(int64_t k, const Tensor& a, const Tensor& b, const Tensor& order) {
  return apply1(std::make_shared<MoeSlotDot>(k), {a, b, order});
}

void check_order(const char* op, const Tensor& order, int64_t want, const char* what) {
  QUILT_CHECK(order.defined() && is_index_dtype(order.dtype()), "[", op, "] order must be an i32 or i64 tensor, got ",
              order.defined() ? dtype_name(order.dtype()) : "an undefined tensor");
  QUILT_CHECK(order.dim() == 1 && order.size(0) == want, "[", op, "] order has shape ", order.shape(), "; ", what,
              " needs ", want, " entries");
}

}  // namespace

Tensor grouped_mm(const Tensor& x, const Tensor& w, const Tensor& offsets) {
  QUILT_CHECK(x.defined() && w.defined() && offsets.defined(), "[grouped_mm] x, w and offsets must be defined");
  QUILT_CHECK(x.dim() == 2, "[grouped_mm] x must be 2-D (M, K), got shape ", x.shape());
  QUILT_CHECK(w.dim() == 3, "[grouped_mm] w must be 3-D (E, K, N), got shape ", w.shape());
  QUILT_CHECK(is_floating(x.dtype()) && x.dtype() == w.dtype(), "[grouped_mm] needs floating x and w of one dtype, got ",
              dtype_name(x.dtype()), " and ", dtype_name(w.dtype()));
  QUILT_CHECK(x.size(1) == w.size(1), "[grouped_mm] inner dims differ: x ", x.shape(), " @ w ", w.shape(),
              " (x's K = ", x.size(1), ", w's K = ", w.size(1), ")");
  QUILT_CHECK(is_index_dtype(offsets.dtype()) && offsets.dim() == 1 && offsets.size(0) == w.size(0),
              "[grouped_mm] offsets must be a 1-D i32/i64 tensor of E = ", w.size(0), " entries (w ", w.shape(),
              "), got ", dtype_name(offsets.dtype()), " of shape ", offsets.shape());
  return run_grouped_mm(x, w, offsets);
}

MoeRouting moe_route(const Tensor& expert_idx, int64_t num_experts) {
  QUILT_CHECK(expert_idx.defined() && is_index_dtype(expert_idx.dtype()),
              "[moe_route] expert_idx must be an i32 or i64 tensor, got ",
              expert_idx.defined() ? dtype_name(expert_idx.dtype()) : "an undefined tensor");
  QUILT_CHECK(expert_idx.dim() == 2, "[moe_route] expert_idx must be 2-D (T, k), got shape ", expert_idx.shape());
  QUILT_CHECK(num_experts > 0, "[moe_route] num_experts must be positive, got ", num_experts);
  std::vector<Tensor> outs = apply(std::make_shared<MoeRoute>(num_experts), {expert_idx});
  MoeRouting r{outs[0], outs[1], outs[2], {}};
  r.host_counts = host_i64(r.counts.is_distributed() ? r.counts.local() : r.counts);  // replicated
  // The device sort leaves indices outside [0, E) out of counts; find the first one for the message.
  const Tensor& idx = expert_idx.is_distributed() ? expert_idx.local() : expert_idx;
  if (idx.device().is_cuda()) {
    int64_t total = 0;
    for (int64_t c : r.host_counts) total += c;
    if (total != idx.numel()) {
      const std::vector<int64_t> e = host_i64(idx);
      const int64_t k = idx.size(1);
      for (size_t s = 0; s < e.size(); ++s)
        if (e[s] < 0 || e[s] >= num_experts)
          fail("[moe_route] expert_idx[", int64_t(s) / k, ", ", int64_t(s) % k, "] = ", e[s], " is outside [0, ",
               num_experts, ") (num_experts = ", num_experts, ")");
    }
  }
  return r;
}

Tensor moe_permute(const Tensor& x, const Tensor& order, int64_t k) {
  QUILT_CHECK(x.defined() && x.dim() == 2 && is_floating(x.dtype()),
              "[moe_permute] x must be a floating 2-D tensor (T, H), got ",
              x.defined() ? detail::concat(dtype_name(x.dtype()), " of shape ", x.shape()) : "an undefined tensor");
  QUILT_CHECK(k >= 1, "[moe_permute] k must be at least 1, got ", k);
  check_order("moe_permute", order, x.size(0) * k, detail::concat("x ", x.shape(), " with k = ", k).c_str());
  return run_permute(k, x, order, Tensor());
}

Tensor moe_unpermute(const Tensor& y, const Tensor& order, const Tensor& weights) {
  QUILT_CHECK(y.defined() && y.dim() == 2 && is_floating(y.dtype()),
              "[moe_unpermute] y must be a floating 2-D tensor (T*k, H), got ",
              y.defined() ? detail::concat(dtype_name(y.dtype()), " of shape ", y.shape()) : "an undefined tensor");
  QUILT_CHECK(weights.defined() && weights.dim() == 2 && is_floating(weights.dtype()),
              "[moe_unpermute] weights must be a floating 2-D tensor (T, k), got ",
              weights.defined() ? detail::concat(dtype_name(weights.dtype()), " of shape ", weights.shape())
                                : "an undefined tensor");
  const int64_t k = weights.size(1);
  QUILT_CHECK(k >= 1, "[moe_unpermute] weights ", weights.shape(), " must have k >= 1 columns");
  QUILT_CHECK(y.size(0) == weights.numel(), "[moe_unpermute] y ", y.shape(), " has ", y.size(0),
              " rows, but weights ", weights.shape(), " make T*k = ", weights.numel());
  check_order("moe_unpermute", order, y.size(0), detail::concat("y ", y.shape()).c_str());
  return run_unpermute(k, y, order, cast(weights, y.dtype()));
}

}  // namespace quilt
