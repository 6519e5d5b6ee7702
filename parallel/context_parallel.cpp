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
#include "engine/ops/dispatch.h"
#include "engine/primitive.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/nn.h"
#include "kernels/cuda/attention.h"
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
class CpAllGather final : public AnyDevicePrimitive {
 public:
  explicit CpAllGather(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}
  const char* name() const override { return "context_parallel_all_gather"; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    const Tensor x = contiguous(in[0]);
    Shape shape = x.shape();
    shape.insert(shape.begin(), comm_->size());
    Tensor out = Tensor::empty(shape, {.dtype = x.dtype(), .device = x.device()});
    comm_->all_gather(out, x);
    return {out};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor g = contiguous(ctx.grads[0].detach());
    Shape shape = g.shape();
    shape.erase(shape.begin());
    Tensor out = Tensor::empty(shape, {.dtype = g.dtype(), .device = g.device()});
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
  Tensor g = Tensor::empty({comm.size(), x.size(0), x.size(1)}, {.dtype = x.dtype(), .device = x.device()});
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

// One rank's keys: k (B, Hkv, T, D), v (B, Hkv, T, Dv) in the input dtype where the inputs lie,
// and their positions and documents (B, T) i32 in host memory (doc may be undefined): the host
// decides which blocks a query can see, and a GPU kernel reads a device copy of them.
struct Block {
  Tensor k, v, pos, doc;
};

Tensor like(const Tensor& x) {
  return x.defined() ? Tensor::empty(x.shape(), {.dtype = x.dtype(), .device = x.device()}) : Tensor();
}

// Starts sending `cur` to the next rank and receiving the previous rank's block into `nxt`.
// Every rank issues the ring's transfers in one order (this rotation, then the gradient
// accumulators' exchange of the next step, ...), so a backend that matches a pair's messages
// by order alone (NCCL) pairs them as the tags do.
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

// (out, lse) = the merge of (out, lse) and a partial (o, l) over other keys: out (B, H, T, Dv),
// lse (B, H, T), on any device. A row the partial showed nothing (l = −inf) keeps its values.
void merge(Tensor& out, Tensor& lse, const Tensor& o, const Tensor& l) {
  NoGradGuard ng;
  const Tensor seen = gt(l, scalar_like(-std::numeric_limits<double>::infinity(), l));
  const Tensor m = where(seen, maximum(lse, l), lse);
  const Tensor a = exp(lse - m), b = exp(l - m), z = a + b;
  const Tensor merged = (a.unsqueeze(-1) * out + b.unsqueeze(-1) * o) / z.unsqueeze(-1);
  out = where(seen.unsqueeze(-1), merged, out);
  lse = where(seen, m + log(z), lse);
}

// (q, k, v, pos, [doc]) -> out; q, k, v of one floating dtype on one device, pos/doc (B, T) i32.
// The CPU computes in f32 (f64 for f64); a GPU runs its fused kernels in f32.
class RingAttention final : public AnyDevicePrimitive {
 public:
  explicit RingAttention(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}
  const char* name() const override { return "context_parallel_ring_attention"; }

  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    dt_ = in[0].dtype();
    dev_ = in[0].device();
    cd_ = dev_.is_cuda() ? DType::f32 : kernels::cpu::stat_dtype(dt_);  // compute and merge type
    if (dev_.is_cuda())
      QUILT_CHECK(dt_ != DType::f64 && kernels::cuda::attention_supported(cd_, in[0].size(3), in[2].size(3)),
                  "[", name(), "] on ", dev_.str(), " runs the fused attention kernels, which take head dims of 64 or "
                  "128 in f32/bf16/f16; got q ", in[0].shape(), ", v ", in[2].shape(), " in ", dtype_name(dt_),
                  " (distributed.cp_comm_type all_gather or a2a take any head dim)");
    q_ = widen(contiguous(in[0].detach()));
    const Tensor host_doc = in.size() > 4 ? in[4].to(Device::cpu()) : Tensor();
    own_ = {contiguous(in[1].detach()), contiguous(in[2].detach()), in[3].to(Device::cpu()), host_doc};
    own_pos_ = in[3];
    own_doc_ = in.size() > 4 ? in[4] : Tensor();
    const int64_t b = q_.size(0), hq = q_.size(1), t = q_.size(2), dv = own_.v.size(3);
    const TensorOptions opts{.dtype = cd_, .device = dev_};
    out_ = zeros({b, hq, t, dv}, opts);
    lse_ = full({b, hq, t}, -std::numeric_limits<double>::infinity(), opts);
    const Tensor o = Tensor::empty(out_.shape(), opts), l = Tensor::empty(lse_.shape(), opts);
    Block cur = own_;
    const int cp = comm_->size();
    for (int i = 0; i < cp; ++i) {
      Block nxt;
      Work w;
      if (i + 1 < cp) w = rotate(*comm_, cur, nxt);  // under this step's computation
      if (sees_any(own_.pos, own_.doc, cur)) {
        kernel_forward(cur, o, l);
        merge(out_, lse_, o, l);
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
    const TensorOptions opts{.dtype = cd_, .device = dev_};
    Tensor dq = zeros(q_.shape(), opts);
    const Tensor dq_part = like(dq);
    const Shape kshape = own_.k.shape(), vshape = own_.v.shape();
    // The accumulators of the block held last step, on their way to the next rank.
    Tensor sent_k, sent_v;
    Block cur = own_;
    for (int i = 0; i < cp; ++i) {
      // This block's accumulator comes from the rank that held it last step, as ours goes to
      // the next one: one exchange, issued before the rotation on every rank.
      Tensor acc_k = zeros(kshape, opts), acc_v = zeros(vshape, opts);
      Work got;
      if (i > 0)
        got = c.batch_p2p({P2POp::send(sent_k, next, kTagDK), P2POp::send(sent_v, next, kTagDV),
                           P2POp::recv(acc_k, prev, kTagDK), P2POp::recv(acc_v, prev, kTagDV)},
                          /*async_op=*/true);
      Block nxt;
      Work w;
      if (i + 1 < cp) w = rotate(c, cur, nxt);
      Tensor dk_part, dv_part;
      if (sees_any(own_.pos, own_.doc, cur)) {
        dk_part = Tensor::empty(kshape, opts);
        dv_part = Tensor::empty(vshape, opts);
        kernel_backward(cur, dq_part, dk_part, dv_part, dout);
        dq.add_(dq_part);
      }
      got.wait();  // the sent accumulators may be dropped now
      if (dk_part.defined()) {
        acc_k.add_(dk_part);
        acc_v.add_(dv_part);
      }
      sent_k = acc_k;
      sent_v = acc_v;
      if (i + 1 < cp) {
        w.wait();
        cur = std::move(nxt);
      }
    }
    Tensor dk = sent_k, dv = sent_v;
    if (cp > 1) {  // the last step's accumulators go to their owners: ours comes from prev
      dk = Tensor::empty(kshape, opts);
      dv = Tensor::empty(vshape, opts);
      c.batch_p2p({P2POp::send(sent_k, next, kTagDK), P2POp::send(sent_v, next, kTagDV),
                   P2POp::recv(dk, prev, kTagDK), P2POp::recv(dv, prev, kTagDV)});
    }
    auto narrow_to = [&](const Tensor& g) { return dt_ == cd_ ? g : cast(g, dt_); };
    std::vector<Tensor> grads{narrow_to(dq), narrow_to(dk), narrow_to(dv), Tensor()};
    if (own_.doc.defined()) grads.emplace_back();
    return grads;
  }

 private:
  Tensor widen(const Tensor& x) const { return x.dtype() == cd_ ? x : contiguous(cast(x, cd_)); }

  // The kernels' arguments against `blk`, with the positions and documents where they read them.
  kernels::cpu::AttentionArgs args(const Block& blk, const Tensor& q_pos, const Tensor& q_doc, const Tensor& k_pos,
                                   const Tensor& k_doc) const {
    return {.batch = q_.size(0), .q_heads = q_.size(1), .kv_heads = blk.k.size(1), .t = q_.size(2),
            .s = blk.k.size(2), .d = q_.size(3), .dv = blk.v.size(3), .scale = 1.0 / std::sqrt(double(q_.size(3))),
            .causal = true, .q_doc = q_doc.defined() ? q_doc.data<int32_t>() : nullptr,
            .k_doc = k_doc.defined() ? k_doc.data<int32_t>() : nullptr, .q_pos = q_pos.data<int32_t>(),
            .k_pos = k_pos.data<int32_t>()};
  }
  // The block's positions and documents where the kernels read them (copies on a GPU).
  std::pair<Tensor, Tensor> where_read(const Block& blk) const {
    if (!dev_.is_cuda()) return {blk.pos, blk.doc};
    return {contiguous(blk.pos.to(dev_)), blk.doc.defined() ? contiguous(blk.doc.to(dev_)) : Tensor()};
  }

  // o, l = this rank's queries against `blk` alone.
  void kernel_forward(const Block& blk, const Tensor& o, const Tensor& l) const {
    const Tensor k = widen(blk.k), v = widen(blk.v);
    if (!dev_.is_cuda()) {
      kernels::cpu::attention_forward(cd_, args(blk, own_.pos, own_.doc, blk.pos, blk.doc), o.data_ptr(), l.data_ptr(),
                                      q_.data_ptr(), k.data_ptr(), v.data_ptr());
      return;
    }
    const auto [kpos, kdoc] = where_read(blk);
    kernels::cuda::attention_forward(cd_, args(blk, own_pos_, own_doc_, kpos, kdoc), o.data_ptr(), l.data_ptr(),
                                     q_.data_ptr(), k.data_ptr(), v.data_ptr(), ops::stream_handle(dev_));
  }
  // dq, dk, dv = the block's exact share of the gradients (probabilities from the merged lse).
  void kernel_backward(const Block& blk, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout) const {
    const Tensor k = widen(blk.k), v = widen(blk.v);
    if (!dev_.is_cuda()) {
      kernels::cpu::attention_backward(cd_, args(blk, own_.pos, own_.doc, blk.pos, blk.doc), dq.data_ptr(),
                                       dk.data_ptr(), dv.data_ptr(), dout.data_ptr(), nullptr, q_.data_ptr(),
                                       k.data_ptr(), v.data_ptr(), out_.data_ptr(), lse_.data_ptr());
      return;
    }
    const auto [kpos, kdoc] = where_read(blk);
    kernels::cuda::attention_backward(cd_, args(blk, own_pos_, own_doc_, kpos, kdoc), dq.data_ptr(), dk.data_ptr(),
                                      dv.data_ptr(), dout.data_ptr(), nullptr, q_.data_ptr(), k.data_ptr(),
                                      v.data_ptr(), out_.data_ptr(), lse_.data_ptr(), ops::stream_handle(dev_));
  }

  std::shared_ptr<Communicator> comm_;
  DType dt_ = DType::f32, cd_ = DType::f32;
  Device dev_;
  Tensor q_;                 // (B, Hq, T, D) in cd_
  Block own_;                // this rank's k, v (input dtype), positions, documents (host)
  Tensor own_pos_, own_doc_;  // the positions and documents where q lies
  Tensor out_, lse_;         // the merged output (B, Hq, T, Dv) and lse (B, Hq, T), in cd_
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
  const Device dev = q.device();
  for (const Tensor* x : {&k, &v, &positions, &document_ids})
    QUILT_CHECK(!x->defined() || x->device() == dev, "[", kOp, "] q, k, v, positions and document_ids must lie on one "
                "device: q is on ", dev.str(), ", another on ", x->device().str());
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
