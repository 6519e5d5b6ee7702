// Context-parallel attention on thread ranks: each comm type (ring, all_gather, a2a) at cp 2
// and 4, causal with grouped heads, with and without packed documents, gives the output and
// q/k/v gradients of one rank's scaled_dot_product_attention on the whole sequence; the
// load-balanced layouts are permutations; every rank does the same work at cp 4; bad input is
// refused by name.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>

#include "engine/engine.h"
#include "parallel/context_parallel.h"
#include "tests/dtensor/util.h"

using namespace quilt;
using quilt::test::max_abs_diff;

namespace {

struct Case {
  int cp;
  int64_t b, hq, hkv, t, d;
  std::vector<int64_t> cu;  // document boundaries of every row; empty: one document
  DType dtype;
};

std::string describe(const Case& c) {
  return "cp " + std::to_string(c.cp) + ", B " + std::to_string(c.b) + ", Hq " + std::to_string(c.hq) + ", Hkv " +
      std::to_string(c.hkv) + ", T " + std::to_string(c.t) + (c.cu.empty() ? "" : ", documents") + ", " +
      dtype_name(c.dtype);
}

Tensor index_tensor(const std::vector<int64_t>& idx) {
  return from_vector(std::vector<double>(idx.begin(), idx.end()), {int64_t(idx.size())}, {.dtype = DType::i64});
}

// Runs `type` on case c over c.cp thread ranks and checks every rank's output and gradients
// against the one-rank result at that rank's tokens. `contiguous` lays the sequence out as cp
// plain chunks instead (no load balance: rank 0's queries see nothing of the later blocks,
// which the ring must skip).
// On a GPU (`device` cuda) every rank's inputs move there; the reference stays the CPU's.
void check_case(CpCommType type, const Case& c, bool contiguous = false, Device device = Device::cpu(),
                double gpu_tol = 0) {
  const std::string what = std::string(cp_comm_type_name(type)) + ": " + describe(c) +
      (contiguous ? ", contiguous chunks" : "") + (device.is_cuda() ? ", on " + device.str() : "");
  const double tol = device.is_cuda() ? gpu_tol : c.dtype == DType::f64 ? 1e-12 : 1e-5;
  const uint64_t seed = uint64_t(c.t * 7 + c.cp);
  const Tensor q = randn({c.b, c.hq, c.t, c.d}, RngKey(seed, "q"), {.dtype = c.dtype});
  const Tensor k = randn({c.b, c.hkv, c.t, c.d}, RngKey(seed, "k"), {.dtype = c.dtype});
  const Tensor v = randn({c.b, c.hkv, c.t, c.d}, RngKey(seed, "v"), {.dtype = c.dtype});
  const Tensor w = randn({c.b, c.hq, c.t, c.d}, RngKey(seed, "w"), {.dtype = c.dtype});
  // Documents and positions restarting at each document, as the packer makes them.
  std::vector<double> doc(size_t(c.t)), pos(size_t(c.t));
  const std::vector<int64_t> cu = c.cu.empty() ? std::vector<int64_t>{0, c.t} : c.cu;
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t i = cu[d]; i < cu[d + 1]; ++i) {
      doc[size_t(i)] = double(d);
      pos[size_t(i)] = double(i - cu[d]);
    }
  const Tensor docs = c.cu.empty() ? Tensor() : expand(from_vector(doc, {1, c.t}, {.dtype = DType::i32}), {c.b, c.t});
  const Tensor positions = from_vector(pos, {c.t}, {.dtype = DType::i64});

  Tensor qg = q.clone().set_requires_grad(), kg = k.clone().set_requires_grad(), vg = v.clone().set_requires_grad();
  const Tensor want = scaled_dot_product_attention(qg, kg, vg, {.causal = true, .document_ids = docs}).out;
  sum(want * w).backward();

  run_threads_group(c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<int64_t> idx;
    if (contiguous) {
      idx.resize(size_t(c.t / c.cp));
      std::iota(idx.begin(), idx.end(), r * c.t / c.cp);
    } else {
      idx = c.cu.empty() ? cp_token_indices(c.t, c.cp, r) : cp_document_token_indices(c.cu, c.cp, r);
    }
    if (device.is_cuda()) cuda::set_device(device.index);
    auto shard = [&](const Tensor& x, int64_t dim) { return cp_shard_sequence(x, dim, idx).to(device); };
    Tensor ql = shard(q, 2).set_requires_grad(), kl = shard(k, 2).set_requires_grad(),
           vl = shard(v, 2).set_requires_grad();
    const Tensor out = context_parallel_attention(ql, kl, vl, shard(positions, 0),
                                                  docs.defined() ? shard(docs, 1) : Tensor(), comm.shared_from_this(),
                                                  type);
    CHECK(out.shape() == Shape{c.b, c.hq, int64_t(idx.size()), c.d});
    sum(out * shard(w, 2)).backward();
    INFO(what, ", rank ", r);
    CHECK(out.device() == device);
    auto host = [](const Tensor& x) { return cast(x.to(Device::cpu()), DType::f64); };
    CHECK(max_abs_diff(host(out), host(shard(want, 2))) < tol);
    CHECK(max_abs_diff(host(ql.grad()), host(shard(qg.grad(), 2))) < tol);
    CHECK(max_abs_diff(host(kl.grad()), host(shard(kg.grad(), 2))) < tol);
    CHECK(max_abs_diff(host(vl.grad()), host(shard(vg.grad(), 2))) < tol);
  });
}

// The cases every comm type runs: cp 2 and 4, grouped heads, with and without documents (each
// document's length a multiple of 2·cp), f64 and f32.
void check_comm_type(CpCommType type) {
  const bool a2a = type == CpCommType::a2a;
  for (DType dt : {DType::f64, DType::f32}) {
    check_case(type, {2, 2, 4, 2, 96, 8, {}, dt});
    check_case(type, {2, 1, 4, 2, 96, 8, {0, 40, 44, 96}, dt});
    check_case(type, {4, 2, a2a ? 8 : 4, a2a ? 4 : 2, 128, 8, {}, dt});
    check_case(type, {4, 1, a2a ? 8 : 4, a2a ? 4 : 2, 128, 8, {0, 48, 56, 128}, dt});
  }
  // Chunks of two whole 64-token tiles, so the kernel's tile skipping meets the layout.
  check_case(type, {2, 1, 4, 2, 512, 16, {}, DType::f32});
}

}  // namespace

TEST_CASE("context parallel: ring attention equals one rank's attention, outputs and gradients") {
  check_comm_type(CpCommType::ring);
  // Without load balance whole blocks are hidden from some ranks: skipped, still exact.
  check_case(CpCommType::ring, {4, 2, 4, 2, 128, 8, {}, DType::f64}, /*contiguous=*/true);
  check_case(CpCommType::ring, {2, 1, 4, 2, 96, 8, {0, 40, 44, 96}, DType::f64}, /*contiguous=*/true);
}

TEST_CASE("context parallel: all_gather attention equals one rank's attention, outputs and gradients") {
  check_comm_type(CpCommType::all_gather);
}

TEST_CASE("context parallel: a2a attention equals one rank's attention, outputs and gradients") {
  check_comm_type(CpCommType::a2a);
}

TEST_CASE("context parallel: the load-balanced layouts are permutations that round-trip") {
  for (int cp : {1, 2, 4}) {
    for (const std::vector<int64_t>& cu : {std::vector<int64_t>{0, 64}, std::vector<int64_t>{0, 16, 24, 64}}) {
      std::vector<int64_t> all;
      for (int r = 0; r < cp; ++r) {
        const std::vector<int64_t> idx =
            cu.size() == 2 ? cp_token_indices(64, cp, r) : cp_document_token_indices(cu, cp, r);
        CHECK(int64_t(idx.size()) == 64 / cp);
        all.insert(all.end(), idx.begin(), idx.end());
      }
      std::vector<int64_t> sorted = all;
      std::sort(sorted.begin(), sorted.end());
      std::vector<int64_t> iota(64);
      std::iota(iota.begin(), iota.end(), 0);
      CHECK(sorted == iota);
      // Sharding every rank's tokens and putting them back at their indices gives the sequence.
      const Tensor x = randn({2, 64, 3}, RngKey(1, "x"));
      const Tensor back = index_add(zeros({2, 64, 3}), 1, index_tensor(all), cp_shard_sequence(x, 1, all));
      CHECK(max_abs_diff(back, x) == 0.0);
    }
  }
  // Rank r holds chunks r and 2·cp−1−r, in that order: cp 2 over 8 tokens.
  CHECK(cp_token_indices(8, 2, 0) == std::vector<int64_t>{0, 1, 6, 7});
  CHECK(cp_token_indices(8, 2, 1) == std::vector<int64_t>{2, 3, 4, 5});
  // Per document: documents [0, 4) and [4, 12) at cp 2, in document order.
  CHECK(cp_document_token_indices({0, 4, 12}, 2, 0) == std::vector<int64_t>{0, 3, 4, 5, 10, 11});
  CHECK(cp_document_token_indices({0, 4, 12}, 2, 1) == std::vector<int64_t>{1, 2, 6, 7, 8, 9});
}

TEST_CASE("context parallel: every rank does the same attention work at cp 4") {
  const int64_t t = 4096, d = 64, heads = 8;
  const std::vector<int64_t> docs{0, 1024, 1536, 3584, 4096};  // packed: lengths divisible by 8
  for (CpCommType type : {CpCommType::ring, CpCommType::all_gather, CpCommType::a2a})
    for (const std::vector<int64_t>& cu : {std::vector<int64_t>{}, docs}) {
      double lo[2] = {1e300, 1e300}, hi[2] = {0, 0};
      for (int r = 0; r < 4; ++r) {
        const CpAttentionFlops f = context_parallel_attention_flops(t, 4, r, type, heads, d, cu);
        const std::string label = std::string(cp_comm_type_name(type)) + (cu.empty() ? "" : " (packed documents)");
        MESSAGE(label, " rank ", r,
                ": visible ", f.visible / 1e9, " GFLOP, computed ", f.computed / 1e9, " GFLOP");
        lo[0] = std::min(lo[0], f.visible), hi[0] = std::max(hi[0], f.visible);
        lo[1] = std::min(lo[1], f.computed), hi[1] = std::max(hi[1], f.computed);
      }
      CHECK(hi[0] / lo[0] < 1.05);
      CHECK(hi[1] / lo[1] < 1.05);
    }
  // The whole causal matrix, once, over the ranks: T (T + 1) / 2 pairs per head.
  double total = 0;
  for (int r = 0; r < 4; ++r) total += context_parallel_attention_flops(t, 4, r, CpCommType::ring, 1, 1).visible;
  CHECK(total == 4.0 * double(t) * double(t + 1) / 2);
}

TEST_CASE("context parallel: bad input is refused by name") {
  CHECK_THROWS_WITH_AS(cp_token_indices(100, 4, 0),
                       doctest::Contains("seq_len 100 is not divisible by 2·cp = 8 (cp 4)"), Error);
  CHECK_THROWS_WITH_AS(cp_document_token_indices({0, 30, 64}, 4, 1),
                       doctest::Contains("document 0's length 30 is not divisible by 2·cp = 8 (cp 4)"), Error);
  CHECK_THROWS_WITH_AS(parse_cp_comm_type("ulysses"),
                       doctest::Contains("distributed.cp_comm_type: unknown 'ulysses' (valid: ring, all_gather, a2a)"),
                       Error);
  CHECK(parse_cp_comm_type("a2a") == CpCommType::a2a);
  CHECK(parse_cp_comm_type("all_gather") == CpCommType::all_gather);
  CHECK(parse_cp_comm_type("ring") == CpCommType::ring);
  run_threads_group(4, [](Communicator& comm) {
    const Tensor q = randn({1, 4, 8, 4}, RngKey(2, "q")), kv = randn({1, 2, 8, 4}, RngKey(2, "k"));
    const Tensor pos = from_vector({0, 1, 2, 3, 4, 5, 6, 7}, {8}, {.dtype = DType::i32});
    CHECK_THROWS_WITH_AS(
        context_parallel_attention(q, kv, kv, pos, {}, comm.shared_from_this(), CpCommType::a2a),
        doctest::Contains("distributed.cp_comm_type a2a cuts the heads over cp: query heads (4) and key/value heads "
                          "(2) must both be divisible by the cp size 4"),
        Error);
    CHECK_THROWS_WITH_AS(context_parallel_attention(q, kv, kv, zeros({2, 8}, {.dtype = DType::i32}), {},
                                                    comm.shared_from_this(), CpCommType::ring),
                         doctest::Contains("positions must be (T) = (8) or (B, T) = (1, 8)"), Error);
  });
}

TEST_CASE("cuda: context-parallel attention on GPUs equals one rank's CPU attention, every comm type") {
  if (!cuda::is_available()) {
    MESSAGE("skipped: no CUDA device (", cuda::unavailable_reason(), ")");
    return;
  }
  const Device gpu = Device::cuda(0);
  // Head dim 64 (the fused kernels' size; ring computes in f32 there), grouped heads, with and
  // without documents, load-balanced and in plain chunks (ring skips hidden blocks), f32 and bf16.
  for (CpCommType type : {CpCommType::ring, CpCommType::all_gather, CpCommType::a2a}) {
    check_case(type, {2, 2, 4, 2, 128, 64, {}, DType::f32}, false, gpu, 5e-3);
    check_case(type, {2, 1, 4, 2, 128, 64, {0, 40, 44, 128}, DType::f32}, false, gpu, 5e-3);
    check_case(type, {4, 1, 8, 4, 256, 64, {}, DType::bf16}, false, gpu, 0.15);
  }
  check_case(CpCommType::ring, {4, 2, 4, 2, 128, 64, {}, DType::f32}, /*contiguous=*/true, gpu, 5e-3);
  // Other head dims: ring names what the GPU kernels take and the comm types that take any.
  run_threads_group(2, [&](Communicator& comm) {
    cuda::set_device(0);
    const Tensor q = randn({1, 2, 8, 16}, RngKey(3, "q")).to(gpu), kv = randn({1, 2, 8, 16}, RngKey(3, "k")).to(gpu);
    const Tensor pos = from_vector({0, 1, 2, 3, 4, 5, 6, 7}, {8}, {.dtype = DType::i32, .device = gpu});
    CHECK_THROWS_WITH_AS(context_parallel_attention(q, kv, kv, pos, {}, comm.shared_from_this(), CpCommType::ring),
                         doctest::Contains("which take head dims of 64 or 128"), Error);
  });
}
