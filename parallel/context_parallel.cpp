// Context-parallel attention (see context_parallel.h).
//
// Every path masks by global position, so keys may arrive in any order: all_gather and a2a
// concatenate the ranks' tokens in rank order and call scaled_dot_product_attention with the
// gathered positions (autograd through a differentiable gather / all-to-all); ring is one
// primitive whose forward and backward drive the kernels and the ring themselves, so that the
// communication of step i + 1 runs under the computation of step i and no step's K/V is kept.
//
// Ring, forward: step i holds the K/V block of rank r − i; the block goes on to rank r + 1 while
// this rank computes its queries against it, and the partial (out, lse) merge into f32 (f64 for
// f64) accumulators. Ring, backward: the blocks rotate again in the same order, each with a
// (dK, dV) accumulator that travels with it; the kernel's backward from the final out and lse
// gives each block's exact share (P = exp(S − lse) with the merged lse), which is added to the
// accumulator once it has arrived, and after cp steps every accumulator has reached its owner.
#include "parallel/context_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "dtensor/dtensor.h"
#include "engine/engine.h"
#include "engine/primitive.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/nn.h"
#include "parallel/expert_parallel.h"

namespace quilt {
namespace {

constexpr const char* kOp = "context_parallel_attention";

// Point-to-point tags of the ring (one per tensor kind, so each matches in order).
enum Tag : int { kTagK = 0x4350, kTagV, kTagPos, kTagDoc, kTagDK, kTagDV };

// (T) or (B, T) integers as a contiguous (B, T) i32 tensor.
Tensor rows_i32(const Tensor& x, int64_t b, int64_t t, const char* what) {
  Tensor y = x.is_distributed() ? to_local(x) : x;
  QUILT_CHECK(y.dtype() == DType::i32 || y.dtype() == DType::i64, "[", kOp, "] ", what, " must be i32 or i64, got ",
              dtype_name(y.dtype()));
  QUILT_CHECK((y.dim() == 1 && y.size(0) == t) || (y.dim() == 2 && y.size(0) == b && y.size(1) == t), "[", kOp,
              "] ", what, " must be (T) = (", t, ") or (B, T) = ", Shape{b, t}, " for q ", Shape{b, -1, t, -1},
              ", got ", y.shape());
  if (y.dim() == 1) y = expand(reshape(y, {1, t}), {b, t});
  return contiguous(cast(y.detach(), DType::i32));
}

// Chunk size of a length cut into 2·cp chunks, or a throw naming `what`.
int64_t chunk_of(int64_t len, int cp, const std::string& what) {
  QUILT_CHECK(cp >= 1, "[context_parallel] cp must be >= 1, got ", cp);
  QUILT_CHECK(len % (2 * cp) == 0, "[context_parallel] ", what, " ", len, " is not divisible by 2·cp = ", 2 * cp,
              " (cp ", cp, "): the load-balanced layout cuts it into 2·cp equal chunks",
              what == "seq_len" ? "" : " (the packer pads each document to a multiple of 2·cp)");
  return len / (2 * cp);
}

// ---- all_gather ------------------------------------------------------------------------

// (cp, *x.shape) of every rank's x in rank order; the gradient is reduce-scattered back.
class CpAllGather final : public Primitive {
 public:
  explicit CpAllGather(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}
  const char* name() const override { return "context_parallel_all_gather"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor x = contiguous(in[0]);
    Shape shape = x.shape();
    shape.insert(shape.begin(), comm_->size());
    Tensor out = Tensor::empty(shape, {.dtype = x.dtype()});
    comm_->all_gather(out, x);
    return {out};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor g = contiguous(ctx.grads[0].detach());
    Shape shape = g.shape();
    shape.erase(shape.begin());
    Tensor out = Tensor::empty(shape, {.dtype = g.dtype()});
    comm_->reduce_scatter(out, g, ReduceOp::sum);
    return {out};
  }

 private:
  std::shared_ptr<Communicator> comm_;
};

// x (B, H, T, ...) of every rank concatenated along T in rank order: (B, H, cp·T, ...).
Tensor gather_seq(const Tensor& x, const std::shared_ptr<Communicator>& comm) {
  const Tensor g = apply1(std::make_shared<CpAllGather>(comm), {x});  // (cp, B, H, T, ...)
  Shape dims{1, 2, 0};
  for (int64_t d = 3; d < g.dim(); ++d) dims.push_back(d);
  Shape out = x.shape();
  out[2] *= comm->size();
  return reshape(permute(g, dims), out);
}

// Integer rows (B, T) of every rank concatenated in rank order: (B, cp·T). Not differentiable.
Tensor gather_rows(const Tensor& x, Communicator& comm) {
  Tensor g = Tensor::empty({comm.size(), x.size(0), x.size(1)}, {.dtype = x.dtype()});
  comm.all_gather(g, x);
  return contiguous(reshape(permute(g, {1, 0, 2}), {x.size(0), comm.size() * x.size(1)}));
}

Tensor all_gather_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& doc,
                            const std::shared_ptr<Communicator>& comm) {
  const Tensor kg = gather_seq(k, comm), vg = gather_seq(v, comm);
  const Tensor kpos = gather_rows(pos, *comm);
  const Tensor kdoc = doc.defined() ? gather_rows(doc, *comm) : Tensor();
  return scaled_dot_product_attention(q, kg, vg,
                                      {.causal = true, .document_ids = doc, .key_document_ids = kdoc,
                                       .positions = pos, .key_positions = kpos})
      .out;
}

// ---- a2a (Ulysses) -----------------------------------------------------------------------

// x (B, H, T, E) cut by sequence -> (B, H / cp, cp·T, E) cut by heads: rank s gets head group s
// of every rank's tokens, in rank order.
Tensor seq_to_heads(const Tensor& x, const std::shared_ptr<Communicator>& comm) {
  const int64_t cp = comm->size(), b = x.size(0), h = x.size(1), t = x.size(2), e = x.size(3);
  const std::vector<int64_t> ones(size_t(cp), 1);
  const Tensor send = contiguous(permute(reshape(x, {b, cp, h / cp, t, e}), {1, 0, 2, 3, 4}));  // (cp, B, H/cp, T, E)
  const Tensor got = all_to_all_rows(send, comm, ones, ones);  // slice s: rank s's tokens, my heads
  return reshape(permute(got, {1, 2, 0, 3, 4}), {b, h / cp, cp * t, e});
}

// The inverse of seq_to_heads: (B, H / cp, cp·T, E) -> (B, H, T, E).
Tensor heads_to_seq(const Tensor& x, const std::shared_ptr<Communicator>& comm) {
  const int64_t cp = comm->size(), b = x.size(0), hl = x.size(1), t = x.size(2) / cp, e = x.size(3);
  const std::vector<int64_t> ones(size_t(cp), 1);
  const Tensor send = contiguous(permute(reshape(x, {b, hl, cp, t, e}), {2, 0, 1, 3, 4}));  // (cp, B, H/cp, T, E)
  const Tensor got = all_to_all_rows(send, comm, ones, ones);  // slice s: head group s, my tokens
  return reshape(permute(got, {1, 0, 2, 3, 4}), {b, cp * hl, t, e});
}

Tensor a2a_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& doc,
                     const std::shared_ptr<Communicator>& comm) {
  const int64_t cp = comm->size(), hq = q.size(1), hkv = k.size(1);
  QUILT_CHECK(hq % cp == 0 && hkv % cp == 0, "[", kOp, "] distributed.cp_comm_type a2a cuts the heads over cp: query heads (",
              hq, ") and key/value heads (", hkv, ") must both be divisible by the cp size ", cp,
              " (use ring or all_gather)");
  const Tensor all_pos = gather_rows(pos, *comm);
  const Tensor all_doc = doc.defined() ? gather_rows(doc, *comm) : Tensor();
  const Tensor out = scaled_dot_product_attention(seq_to_heads(q, comm), seq_to_heads(k, comm), seq_to_heads(v, comm),
                                                  {.causal = true, .document_ids = all_doc, .positions = all_pos})
                         .out;
  return heads_to_seq(out, comm);
}

// ---- ring ----------------------------------------------------------------------------------

// One rank's keys: k (B, Hkv, T, D), v (B, Hkv, T, Dv) in the input dtype, and their positions
// and documents (B, T) i32 (doc may be undefined).
struct Block {
  Tensor k, v, pos, doc;
};

Tensor like(const Tensor& x) { return x.defined() ? Tensor::empty(x.shape(), {.dtype = x.dtype()}) : Tensor(); }

// Starts sending `cur` to the next rank and receiving the previous rank's block into `nxt`.
Work rotate(Communicator& c, const Block& cur, Block& nxt) {
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  nxt = {like(cur.k), like(cur.v), like(cur.pos), like(cur.doc)};
  std::vector<P2POp> ops{P2POp::send(cur.k, next, kTagK), P2POp::send(cur.v, next, kTagV),
                         P2POp::send(cur.pos, next, kTagPos), P2POp::recv(nxt.k, prev, kTagK),
                         P2POp::recv(nxt.v, prev, kTagV), P2POp::recv(nxt.pos, prev, kTagPos)};
  if (cur.doc.defined()) {
    ops.push_back(P2POp::send(cur.doc, next, kTagDoc));
    ops.push_back(P2POp::recv(nxt.doc, prev, kTagDoc));
  }
  return c.batch_p2p(ops, /*async_op=*/true);
}

// False when no query of `pos`/`doc` can see a key of `blk` (per batch row: every key after
// every query, or no document in common); true may still hide everything pair by pair.
bool sees_any(const Tensor& pos, const Tensor& doc, const Block& blk) {
  const int64_t b = pos.size(0), t = pos.size(1), s = blk.pos.size(1);
  for (int64_t r = 0; r < b; ++r) {
    const int32_t *qp = pos.data<int32_t>() + r * t, *kp = blk.pos.data<int32_t>() + r * s;
    if (*std::min_element(kp, kp + s) > *std::max_element(qp, qp + t)) continue;
    if (doc.defined()) {
      const int32_t *qd = doc.data<int32_t>() + r * t, *kd = blk.doc.data<int32_t>() + r * s;
      const auto [qlo, qhi] = std::minmax_element(qd, qd + t);
      const auto [klo, khi] = std::minmax_element(kd, kd + s);
      if (*qhi < *klo || *khi < *qlo) continue;
    }
    return true;
  }
  return false;
}

// acc += x, both contiguous of one floating dtype (f32 or f64).
void add_into(const Tensor& acc, const Tensor& x) {
  const int64_t n = acc.numel();
  if (acc.dtype() == DType::f64) {
    double* a = acc.data<double>();
    const double* b = x.data<double>();
    for (int64_t i = 0; i < n; ++i) a[i] += b[i];
  } else {
    float* a = acc.data<float>();
    const float* b = x.data<float>();
    for (int64_t i = 0; i < n; ++i) a[i] += b[i];
  }
}

// (out, lse) = the merge of (out, lse) and a partial (o, l) over other keys, rows (R, Dv) / (R).
template <class C>
void merge(C* out, C* lse, const C* o, const C* l, int64_t rows, int64_t dv) {
  for (int64_t r = 0; r < rows; ++r) {
    if (l[r] == -std::numeric_limits<C>::infinity()) continue;  // this block showed the row nothing
    const C m = std::max(lse[r], l[r]);
    const C a = std::exp(lse[r] - m), b = std::exp(l[r] - m), z = a + b;
    for (int64_t j = 0; j < dv; ++j) out[r * dv + j] = (a * out[r * dv + j] + b * o[r * dv + j]) / z;
    lse[r] = m + std::log(z);
  }
}

// (q, k, v, pos, [doc]) -> out; q, k, v of one floating dtype, pos/doc (B, T) i32.
class RingAttention final : public Primitive {
 public:
  explicit RingAttention(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}
  const char* name() const override { return "context_parallel_ring_attention"; }

  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    dt_ = in[0].dtype();
    cd_ = kernels::cpu::stat_dtype(dt_);  // f32, f64 for f64: the kernels' compute and merge type
    q_ = widen(contiguous(in[0].detach()));
    own_ = {contiguous(in[1].detach()), contiguous(in[2].detach()), in[3], in.size() > 4 ? in[4] : Tensor()};
    const int64_t b = q_.size(0), hq = q_.size(1), t = q_.size(2), dv = own_.v.size(3);
    out_ = zeros({b, hq, t, dv}, {.dtype = cd_});
    lse_ = full({b, hq, t}, -std::numeric_limits<double>::infinity(), {.dtype = cd_});
    Tensor o = Tensor::empty(out_.shape(), {.dtype = cd_}), l = Tensor::empty(lse_.shape(), {.dtype = cd_});
    Block cur = own_;
    const int cp = comm_->size();
    for (int i = 0; i < cp; ++i) {
      Block nxt;
      Work w;
      if (i + 1 < cp) w = rotate(*comm_, cur, nxt);  // under this step's computation
      if (sees_any(own_.pos, own_.doc, cur)) {
        kernels::cpu::attention_forward(cd_, args(cur), o.data_ptr(), l.data_ptr(), q_.data_ptr(),
                                        widen(cur.k).data_ptr(), widen(cur.v).data_ptr());
        if (cd_ == DType::f64)
          merge(out_.data<double>(), lse_.data<double>(), o.data<double>(), l.data<double>(), b * hq * t, dv);
        else
          merge(out_.data<float>(), lse_.data<float>(), o.data<float>(), l.data<float>(), b * hq * t, dv);
      }
      if (i + 1 < cp) {
        w.wait();
        cur = std::move(nxt);
      }
    }
    return {dt_ == cd_ ? out_ : cast(out_, dt_)};
  }

  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    Communicator& c = *comm_;
    const int cp = c.size(), next = (c.rank() + 1) % cp, prev = (c.rank() + cp - 1) % cp;
    const Tensor dout = widen(contiguous(ctx.grads[0].detach()));
    const Tensor dq = zeros(q_.shape(), {.dtype = cd_});
    const Tensor dq_part = like(dq);
    const Shape kshape = own_.k.shape(), vshape = own_.v.shape();
    std::vector<Work> sends;
    std::vector<Tensor> in_flight;  // the accumulators being sent, alive until their sends end
    Tensor dk, dv;
    Block cur = own_;
    for (int i = 0; i < cp; ++i) {
      Block nxt;
      Work w;
      if (i + 1 < cp) w = rotate(c, cur, nxt);
      // The accumulator of this block, from the rank that held it last step.
      Tensor acc_k = zeros(kshape, {.dtype = cd_}), acc_v = zeros(vshape, {.dtype = cd_});
      Work got;
      if (i > 0)
        got = c.batch_p2p({P2POp::recv(acc_k, prev, kTagDK), P2POp::recv(acc_v, prev, kTagDV)}, /*async_op=*/true);
      Tensor dk_part, dv_part;
      if (sees_any(own_.pos, own_.doc, cur)) {
        dk_part = Tensor::empty(kshape, {.dtype = cd_});
        dv_part = Tensor::empty(vshape, {.dtype = cd_});
        kernels::cpu::attention_backward(cd_, args(cur), dq_part.data_ptr(), dk_part.data_ptr(), dv_part.data_ptr(),
                                         dout.data_ptr(), nullptr, q_.data_ptr(), widen(cur.k).data_ptr(),
                                         widen(cur.v).data_ptr(), out_.data_ptr(), lse_.data_ptr());
        add_into(dq, dq_part);
      }
      got.wait();
      if (dk_part.defined()) {
        add_into(acc_k, dk_part);
        add_into(acc_v, dv_part);
      }
      if (cp == 1) {
        dk = acc_k;
        dv = acc_v;
      } else {
        sends.push_back(c.batch_p2p({P2POp::send(acc_k, next, kTagDK), P2POp::send(acc_v, next, kTagDV)}, true));
        in_flight.insert(in_flight.end(), {acc_k, acc_v});
      }
      if (i + 1 < cp) {
        w.wait();
        cur = std::move(nxt);
      }
    }
    if (cp > 1) {  // the last step's accumulators went to their owners: ours comes from prev
      dk = Tensor::empty(kshape, {.dtype = cd_});
      dv = Tensor::empty(vshape, {.dtype = cd_});
      c.batch_p2p({P2POp::recv(dk, prev, kTagDK), P2POp::recv(dv, prev, kTagDV)});
      wait_all(sends);
    }
    auto narrow_to = [&](const Tensor& g) { return dt_ == cd_ ? g : cast(g, dt_); };
    std::vector<Tensor> grads{narrow_to(dq), narrow_to(dk), narrow_to(dv), Tensor()};
    if (own_.doc.defined()) grads.emplace_back();
    return grads;
  }

 private:
  Tensor widen(const Tensor& x) const { return x.dtype() == cd_ ? x : contiguous(cast(x, cd_)); }

  kernels::cpu::AttentionArgs args(const Block& blk) const {
    return {.batch = q_.size(0), .q_heads = q_.size(1), .kv_heads = blk.k.size(1), .t = q_.size(2),
            .s = blk.k.size(2), .d = q_.size(3), .dv = blk.v.size(3), .scale = 1.0 / std::sqrt(double(q_.size(3))),
            .causal = true, .q_doc = own_.doc.defined() ? own_.doc.data<int32_t>() : nullptr,
            .k_doc = blk.doc.defined() ? blk.doc.data<int32_t>() : nullptr, .q_pos = own_.pos.data<int32_t>(),
            .k_pos = blk.pos.data<int32_t>()};
  }

  std::shared_ptr<Communicator> comm_;
  DType dt_ = DType::f32, cd_ = DType::f32;
  Tensor q_;          // (B, Hq, T, D) in cd_
  Block own_;         // this rank's k, v (input dtype), positions, documents
  Tensor out_, lse_;  // the merged output (B, Hq, T, Dv) and lse (B, Hq, T), in cd_
};

Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& pos, const Tensor& doc,
                      const std::shared_ptr<Communicator>& comm) {
  std::vector<Tensor> in{q, k, v, pos};
  if (doc.defined()) in.push_back(doc);
  return apply1(std::make_shared<RingAttention>(comm), in);
}

// True when every placement cuts batch or heads (or replicates): attention is then per shard.
bool per_shard(const Tensor& x) {
  for (const Placement& p : placements_of(x))
    if (p.is_shard() && !p.is_shard(0) && !p.is_shard(1)) return false;
  return true;
}

}  // namespace

const char* cp_comm_type_name(CpCommType type) {
  switch (type) {
    case CpCommType::ring: return "ring";
    case CpCommType::all_gather: return "all_gather";
    case CpCommType::a2a: return "a2a";
  }
  return "?";
}

CpCommType parse_cp_comm_type(const std::string& name) {
  for (CpCommType t : {CpCommType::ring, CpCommType::all_gather, CpCommType::a2a})
    if (name == cp_comm_type_name(t)) return t;
  fail("[config] distributed.cp_comm_type: unknown '", name, "' (valid: ring, all_gather, a2a)");
}

std::vector<int64_t> cp_token_indices(int64_t seq_len, int cp, int rank) {
  return cp_document_token_indices({0, seq_len}, cp, rank);
}

std::vector<int64_t> cp_document_token_indices(const std::vector<int64_t>& cu_seqlens, int cp, int rank) {
  QUILT_CHECK(cp >= 1 && rank >= 0 && rank < cp, "[context_parallel] rank ", rank, " is not in [0, cp = ", cp, ")");
  QUILT_CHECK(!cu_seqlens.empty() && cu_seqlens.front() == 0, "[context_parallel] cu_seqlens must start at 0");
  const bool one = cu_seqlens.size() == 2;
  std::vector<int64_t> idx;
  for (size_t d = 0; d + 1 < cu_seqlens.size(); ++d) {
    const int64_t start = cu_seqlens[d], len = cu_seqlens[d + 1] - start;
    QUILT_CHECK(len >= 0, "[context_parallel] cu_seqlens must not decrease, got ", start, " before ", cu_seqlens[d + 1]);
    const int64_t c = chunk_of(len, cp, one ? std::string("seq_len") : "document " + std::to_string(d) + "'s length");
    for (int64_t chunk : {int64_t(rank), int64_t(2 * cp - 1 - rank)})
      for (int64_t i = 0; i < c; ++i) idx.push_back(start + chunk * c + i);
  }
  return idx;
}

Tensor cp_shard_sequence(const Tensor& x, int64_t dim, const std::vector<int64_t>& indices) {
  std::vector<double> v(indices.begin(), indices.end());
  const Tensor idx = from_vector(v, {int64_t(indices.size())}, {.dtype = DType::i64, .device = x.device()});
  return index_select(x, dim, idx);
}

Tensor context_parallel_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
                                  const Tensor& document_ids, const std::shared_ptr<Communicator>& cp_comm,
                                  CpCommType type) {
  QUILT_CHECK(cp_comm, "[", kOp, "] needs the cp communicator, got none");
  QUILT_CHECK(q.defined() && k.defined() && v.defined() && positions.defined(), "[", kOp,
              "] q, k, v and positions must be defined");
  if (q.is_distributed() || k.is_distributed() || v.is_distributed()) {
    // Batch or head cuts (data, tensor parallel): attention of each shard is its own.
    QUILT_CHECK(q.is_distributed() && k.is_distributed() && v.is_distributed() && per_shard(q) &&
                    placements_of(k) == placements_of(q) && placements_of(v) == placements_of(q),
                "[", kOp, "] distributed q, k, v must all be cut alike along batch or heads");
    const Tensor out = context_parallel_attention(to_local(q), to_local(k), to_local(v), positions, document_ids,
                                                  cp_comm, type);
    return from_local(out, mesh_of(q), placements_of(q), Shape{q.size(0), q.size(1), q.size(2), v.size(3)});
  }
  require_cpu(kOp, {q, k, v, positions, document_ids});
  QUILT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "[", kOp, "] q, k, v must be (B, H, T, D), got ",
              q.shape(), ", ", k.shape(), ", ", v.shape());
  QUILT_CHECK(is_floating(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype(), "[", kOp,
              "] q, k, v must share one floating dtype, got ", dtype_name(q.dtype()), ", ", dtype_name(k.dtype()),
              ", ", dtype_name(v.dtype()));
  const int64_t b = q.size(0), t = q.size(2);
  QUILT_CHECK(k.size(0) == b && v.size(0) == b && k.size(2) == t && v.size(2) == t && v.size(1) == k.size(1) &&
                  k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "[", kOp, "] q ", q.shape(), ", k ", k.shape(), ", v ", v.shape(),
              " must be (B, Hq, T, D), (B, Hkv, T, D), (B, Hkv, T, Dv) with Hkv dividing Hq");
  const Tensor pos = rows_i32(positions, b, t, "positions");
  const Tensor doc = document_ids.defined() ? rows_i32(document_ids, b, t, "document_ids") : Tensor();
  switch (type) {
    case CpCommType::all_gather: return all_gather_attention(q, k, v, pos, doc, cp_comm);
    case CpCommType::a2a: return a2a_attention(q, k, v, pos, doc, cp_comm);
    case CpCommType::ring: break;
  }
  return ring_attention(q, k, v, pos, doc, cp_comm);
}

CpAttentionFlops context_parallel_attention_flops(int64_t seq_len, int cp, int rank, CpCommType type, int64_t heads,
                                                  int64_t head_dim, const std::vector<int64_t>& cu_seqlens) {
  const std::vector<int64_t> cu = cu_seqlens.empty() ? std::vector<int64_t>{0, seq_len} : cu_seqlens;
  QUILT_CHECK(cu.back() == seq_len, "[context_parallel] cu_seqlens end at ", cu.back(), ", not at seq_len ", seq_len);
  // Every token's position (restarting at each document, as packed rows have them) and document,
  // in each rank's layout.
  std::vector<int32_t> pos_of(static_cast<size_t>(seq_len)), doc_of(static_cast<size_t>(seq_len));
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t i = cu[d]; i < cu[d + 1]; ++i) {
      pos_of[size_t(i)] = int32_t(i - cu[d]);
      doc_of[size_t(i)] = int32_t(d);
    }
  std::vector<std::vector<int32_t>> pos(static_cast<size_t>(cp)), doc(static_cast<size_t>(cp));
  for (int r = 0; r < cp; ++r)
    for (int64_t i : cp_document_token_indices(cu, cp, r)) {
      pos[size_t(r)].push_back(pos_of[size_t(i)]);
      doc[size_t(r)].push_back(doc_of[size_t(i)]);
    }
  const bool docs = cu.size() > 2;
  const double per_pair = 4.0 * double(head_dim);
  CpAttentionFlops f;
  if (type == CpCommType::a2a) {  // heads / cp heads of the whole sequence, keys and queries in rank order
    std::vector<int32_t> all_pos, all_doc;
    for (int r = 0; r < cp; ++r) {
      all_pos.insert(all_pos.end(), pos[size_t(r)].begin(), pos[size_t(r)].end());
      all_doc.insert(all_doc.end(), doc[size_t(r)].begin(), doc[size_t(r)].end());
    }
    double visible = 0;
    for (size_t d = 0; d + 1 < cu.size(); ++d) visible += double(cu[d + 1] - cu[d]) * double(cu[d + 1] - cu[d] + 1) / 2;
    const kernels::cpu::AttentionArgs a{.batch = 1, .q_heads = 1, .kv_heads = 1, .t = seq_len, .s = seq_len,
                                        .d = head_dim, .dv = head_dim, .causal = true,
                                        .q_doc = docs ? all_doc.data() : nullptr, .k_doc = docs ? all_doc.data() : nullptr,
                                        .q_pos = all_pos.data(), .k_pos = all_pos.data()};
    f.visible = visible * per_pair * double(heads) / cp;
    f.computed = double(kernels::cpu::attention_forward_pairs(a)) * per_pair * double(heads) / cp;
    return f;
  }
  const std::vector<int32_t>& qp = pos[size_t(rank)];
  const std::vector<int32_t>& qd = doc[size_t(rank)];
  for (int32_t p : qp) f.visible += double(p + 1);
  f.visible *= per_pair * double(heads);
  // ring: the queries against each rank's block; all_gather: against the blocks concatenated.
  std::vector<std::vector<int32_t>> kpos = pos, kdoc = doc;
  if (type == CpCommType::all_gather) {
    kpos.assign(1, {});
    kdoc.assign(1, {});
    for (int r = 0; r < cp; ++r) {
      kpos[0].insert(kpos[0].end(), pos[size_t(r)].begin(), pos[size_t(r)].end());
      kdoc[0].insert(kdoc[0].end(), doc[size_t(r)].begin(), doc[size_t(r)].end());
    }
  }
  for (size_t blk = 0; blk < kpos.size(); ++blk) {
    const kernels::cpu::AttentionArgs a{.batch = 1, .q_heads = 1, .kv_heads = 1, .t = int64_t(qp.size()),
                                        .s = int64_t(kpos[blk].size()), .d = head_dim, .dv = head_dim, .causal = true,
                                        .q_doc = docs ? qd.data() : nullptr, .k_doc = docs ? kdoc[blk].data() : nullptr,
                                        .q_pos = qp.data(), .k_pos = kpos[blk].data()};
    f.computed += double(kernels::cpu::attention_forward_pairs(a)) * per_pair * double(heads);
  }
  return f;
}

}  // namespace quilt
