// Expert parallelism: the all-to-all of rows and its gradient, and a Qwen3-MoE under every
// layout (ep, ep x ep_shard, fsdp without ep, tp, AC keeping the routing) giving the one-rank
// gradients; the balancing bias identical on every rank.
#include <doctest/doctest.h>

#include "collectives/communicator.h"
#include "collectives/observer.h"
#include "dtensor/dtensor.h"
#include "dtensor/grad_norm.h"
#include "models/llama/parallelize.h"
#include "parallel/expert_parallel.h"
#include "tests/parallel/tiny_llama.h"

using namespace quilt;
using namespace quilt::test;

namespace {

LlamaConfig tiny_moe(double balance = 0.0) {
  LlamaConfig c = tiny_llama();
  c.model_type = "qwen3_moe";
  c.qk_norm = true;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 16;
  c.mlp_only_layers = {0};  // layer 0 dense, layer 1 MoE
  c.load_balance_coeff = balance;
  c.score_correction_bias = true;
  return c;
}

// One forward + backward of the rows of `tok` this data-parallel rank reads under `dc` on
// `world` ranks; rank r's result in out[r].
std::vector<StepResult> run_layout(int world, const DistributedConfig& dc, const Tensor& tok, const Tensor& tgt,
                                   uint64_t seed, const LlamaConfig& cfg = tiny_moe()) {
  std::vector<StepResult> out(static_cast<size_t>(world));
  run_threads_group(world, [&](Communicator& c) {
    const ParallelDims dims(dc, world);
    const Meshes meshes = dims.build_meshes(c.shared_from_this());
    LlamaForCausalLM m(cfg);
    m.init_weights(seed);
    const DataParallelism dp = parallelize_llama(m, meshes, dc);
    const int64_t rows = tok.size(0) / dims.dp(), row = dims.dp_rank(c.rank()) * rows;
    out[size_t(c.rank())] = llama_step(m, tok.narrow(0, row, rows), tgt.narrow(0, row, rows), [&] { dp.finish_backward(); });
  });
  return out;
}

double worst_grad_diff(const StepResult& a, const StepResult& b) {
  if (a.grads.size() != b.grads.size()) return INFINITY;
  double w = 0;
  for (const auto& [name, g] : a.grads) {
    auto it = b.grads.find(name);
    w = std::max(w, it == b.grads.end() ? INFINITY : max_diff(g, it->second));
  }
  return w;
}

}  // namespace

TEST_CASE("all_to_all_rows: uneven splits arrive in rank order, and the gradient takes the way back") {
  run_threads_group(3, [](Communicator& c) {
    const int r = c.rank();
    // Rank r sends (r + j) % 3 rows to rank j, each row [r, j, i].
    std::vector<int64_t> in, out;
    std::vector<double> vals;
    for (int j = 0; j < 3; ++j) {
      in.push_back((r + j) % 3);
      out.push_back((j + r) % 3);  // what rank j sends me
      for (int i = 0; i < (r + j) % 3; ++i)
        for (double v : {double(r), double(j), double(i)}) vals.push_back(v);
    }
    Tensor x = from_vector(vals, {int64_t(vals.size() / 3), 3}).set_requires_grad(true);
    Tensor y = all_to_all_rows(x, c.shared_from_this(), in, out);
    const std::vector<double> got = y.to_vector();
    size_t k = 0;
    for (int s = 0; s < 3; ++s)
      for (int i = 0; i < (s + r) % 3; ++i) {
        CHECK(got[k++] == s);
        CHECK(got[k++] == r);
        CHECK(got[k++] == i);
      }
    CHECK(k == got.size());
    // d(sum(y * w))/dx = w taken back: each row of x gets the weight its destination gave it.
    Tensor w = y.detach() * 10.0 + double(r);
    (y * w).sum().backward();
    const std::vector<double> g = x.grad().to_vector();
    k = 0;
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < (r + j) % 3; ++i)
        for (double v : {double(r), double(j), double(i)}) CHECK(g[k++] == v * 10.0 + double(j));
    CHECK_THROWS_WITH(all_to_all_rows(x, c.shared_from_this(), {5, 0, 0}, out), doctest::Contains("in_splits add up to 5 rows, x has 3"));
    CHECK_THROWS_WITH(all_to_all_rows(x, c.shared_from_this(), {3}, out), doctest::Contains("1 in_splits and 3 out_splits for 3 ranks"));
  });
}

TEST_CASE("expert parallel: ep 2, ep 4, ep 2 x ep_shard 2 and fsdp 4 without ep give the one-rank gradients") {
  const Tensor tok = randint(0, 50, {4, 8}, RngKey(41, "tokens")), tgt = randint(0, 50, {4, 8}, RngKey(41, "targets"));
  LlamaForCausalLM ref(tiny_moe());
  ref.init_weights(5);
  const StepResult want = llama_step(ref, tok, tgt);
  struct Layout {
    const char* name;
    int world;
    int64_t ep;
  };
  for (const Layout& l : {Layout{"ep 2", 2, 2}, Layout{"ep 4", 4, 4}, Layout{"ep 2 x ep_shard 2", 4, 2},
                          Layout{"fsdp 4", 4, 1}}) {
    CAPTURE(l.name);
    DistributedConfig dc;
    dc.ep_size = l.ep;
    const EPStats before = ep_stats();
    const std::vector<StepResult> got = run_layout(l.world, dc, tok, tgt, 5);
    double loss = 0;
    for (const StepResult& r : got) {
      CHECK(worst_grad_diff(r, want) < 2e-6);
      loss += r.loss / double(l.world);
    }
    CHECK(loss == doctest::Approx(want.loss).epsilon(1e-6));
    // Tokens really travelled (one MoE layer: one dispatch per rank in forward).
    const EPStats after = ep_stats();
    if (l.ep > 1) {
      CHECK(after.dispatches - before.dispatches == l.world);
      CHECK(after.tokens_sent > before.tokens_sent);
    } else {
      CHECK(after.dispatches == before.dispatches);
    }
  }
}

TEST_CASE("expert parallel: the experts' weights are Shard(0) over ep, FSDP-sharded over ep_shard, each rank holding its experts") {
  run_threads_group(4, [](Communicator& c) {
    DistributedConfig dc;
    dc.ep_size = 2;
    const Meshes meshes = ParallelDims(dc, 4).build_meshes(c.shared_from_this());
    LlamaForCausalLM m(tiny_moe());
    m.init_weights(5);
    parallelize_llama(m, meshes, dc);
    const Tensor& w = m.parameter("model.layers.1.mlp.experts.gate_proj");
    REQUIRE(w.is_distributed());
    CHECK(w.shape() == Shape{8, 16, 32});
    // ep 2: 4 experts per rank, then split again over the 2 ranks of ep_shard.
    CHECK(w.local().numel() == 4 * 16 * 32 / 2);
    CHECK(str(placements_of(w)) == "(S(0), S(0))");
    // The router and the dense layer stay with the blocks' FSDP over all 4 ranks.
    CHECK(m.parameter("model.layers.1.mlp.gate.weight").local().numel() == 8 * 32 / 4);
  });
}

TEST_CASE("expert parallel: with more ep_shard ranks than experts per rank the experts are cut on dim 1, and still give the one-rank gradients") {
  const Tensor tok = randint(0, 50, {8, 8}, RngKey(46, "tokens")), tgt = randint(0, 50, {8, 8}, RngKey(46, "targets"));
  LlamaConfig cfg = tiny_moe();
  cfg.num_experts = 4;  // ep 2 on 8 ranks: 2 experts per rank, FSDP over ep_shard 4
  LlamaForCausalLM ref(cfg);
  ref.init_weights(11);
  const StepResult want = llama_step(ref, tok, tgt);
  DistributedConfig dc;
  dc.ep_size = 2;
  for (const StepResult& r : run_layout(8, dc, tok, tgt, 11, cfg)) CHECK(worst_grad_diff(r, want) < 2e-6);
  run_threads_group(8, [&](Communicator& c) {
    const Meshes meshes = ParallelDims(dc, 8).build_meshes(c.shared_from_this());
    LlamaForCausalLM m(cfg);
    m.init_weights(11);
    parallelize_llama(m, meshes, dc);
    const Tensor& w = m.parameter("model.layers.1.mlp.experts.gate_proj");
    CHECK(str(placements_of(w)) == "(S(0), S(1))");
    CHECK(w.local().shape() == Shape{2, 4, 32});  // 2 experts, a quarter of the 16 rows each
  });
}

TEST_CASE("expert parallel: with full AC and ignore_router_for_ac the recomputed dispatch gives bit-identical gradients") {
  const Tensor tok = randint(0, 50, {4, 8}, RngKey(42, "tokens")), tgt = randint(0, 50, {4, 8}, RngKey(42, "targets"));
  DistributedConfig plain;
  plain.ep_size = 2;
  DistributedConfig ac = plain;
  ac.activation_checkpointing = true;
  ac.moe.ignore_router_for_ac = true;
  const EPStats before = ep_stats();
  const std::vector<StepResult> a = run_layout(2, plain, tok, tgt, 6), b = run_layout(2, ac, tok, tgt, 6);
  // The AC run dispatched again in its recomputation: 2 ranks x (forward) + 2 x (forward + recompute).
  CHECK(ep_stats().dispatches - before.dispatches == 2 + 4);
  for (int r = 0; r < 2; ++r) {
    CHECK(a[size_t(r)].loss == b[size_t(r)].loss);
    CHECK(worst_grad_diff(a[size_t(r)], b[size_t(r)]) == 0.0);
  }
}

TEST_CASE("expert parallel: tp 2 (experts and router tensor-parallel) and fsdp 2 x tp 2 give the one-rank gradients") {
  const Tensor tok = randint(0, 50, {4, 8}, RngKey(43, "tokens")), tgt = randint(0, 50, {4, 8}, RngKey(43, "targets"));
  LlamaConfig cfg = tiny_moe();
  cfg.n_shared_experts = 1;
  LlamaForCausalLM ref(cfg);
  ref.init_weights(7);
  const StepResult want = llama_step(ref, tok, tgt);
  for (int world : {2, 4}) {
    for (bool sp : {false, true}) {
      CAPTURE(world);
      CAPTURE(sp);
      DistributedConfig dc;
      dc.tp_size = 2;
      dc.sequence_parallel = sp;
      const std::vector<StepResult> got = run_layout(world, dc, tok, tgt, 7, cfg);
      for (const StepResult& r : got) CHECK(worst_grad_diff(r, want) < 2e-6);
    }
  }
}

TEST_CASE("expert parallel: ep 2 x tp 2 (experts cut over both) and ep 2 x ep_shard 2 x tp 2 give the one-rank gradients") {
  const Tensor tok = randint(0, 50, {4, 8}, RngKey(44, "tokens")), tgt = randint(0, 50, {4, 8}, RngKey(44, "targets"));
  LlamaConfig cfg = tiny_moe();
  cfg.n_shared_experts = 1;
  LlamaForCausalLM ref(cfg);
  ref.init_weights(9);
  const StepResult want = llama_step(ref, tok, tgt);
  for (int world : {4, 8}) {
    CAPTURE(world);
    DistributedConfig dc;
    dc.tp_size = 2;
    dc.ep_size = 2;
    dc.sequence_parallel = true;
    dc.activation_checkpointing = world == 8;
    const std::vector<StepResult> got = run_layout(world, dc, tok, tgt, 9, cfg);
    for (const StepResult& r : got) CHECK(worst_grad_diff(r, want) < 2e-6);
  }
  run_threads_group(4, [&](Communicator& c) {
    DistributedConfig dc;
    dc.tp_size = 2;
    dc.ep_size = 2;
    const Meshes meshes = ParallelDims(dc, 4).build_meshes(c.shared_from_this());
    LlamaForCausalLM m(cfg);
    m.init_weights(9);
    parallelize_llama(m, meshes, dc);
    const Tensor& w = m.parameter("model.layers.1.mlp.experts.down_proj");
    // 4 of the 8 experts on this rank, each its half of the intermediate columns: (4, 32, 8).
    CHECK(w.local().numel() == 4 * 32 * 8);
  });
}

TEST_CASE("expert parallel: the gradient norm and clipping cover every axis, ep included") {
  const Tensor tok = randint(0, 50, {4, 8}, RngKey(45, "tokens")), tgt = randint(0, 50, {4, 8}, RngKey(45, "targets"));
  LlamaForCausalLM ref(tiny_moe());
  ref.init_weights(10);
  llama_step(ref, tok, tgt);
  const double want = dtensor::grad_norm(ref.parameters()).item<double>();
  for (int64_t tp : {1, 2}) {
    CAPTURE(tp);
    std::vector<double> norms(4), clipped(4);
    run_threads_group(4, [&](Communicator& c) {
      DistributedConfig dc;
      dc.ep_size = 2;
      dc.tp_size = tp;
      const ParallelDims dims(dc, 4);
      const Meshes meshes = dims.build_meshes(c.shared_from_this());
      LlamaForCausalLM m(tiny_moe());
      m.init_weights(10);
      const DataParallelism dp = parallelize_llama(m, meshes, dc);
      const int64_t rows = 4 / dims.dp(), row = dims.dp_rank(c.rank()) * rows;
      llama_step(m, tok.narrow(0, row, rows), tgt.narrow(0, row, rows), [&] { dp.finish_backward(); });
      norms[size_t(c.rank())] = dtensor::clip_grad_norm_(m.parameters(), want / 2).item<double>();
      clipped[size_t(c.rank())] = dtensor::grad_norm(m.parameters()).item<double>();
    });
    for (int r = 0; r < 4; ++r) {
      CHECK(norms[size_t(r)] == doctest::Approx(want).epsilon(1e-5));
      CHECK(clipped[size_t(r)] == doctest::Approx(want / 2).epsilon(1e-5));
    }
  }
}

TEST_CASE("expert parallel: after steps of aux-loss-free balancing the bias is bit-identical on every rank") {
  std::vector<std::vector<double>> bias(4);
  std::vector<double> load(4);
  run_threads_group(4, [&](Communicator& c) {
    DistributedConfig dc;
    dc.ep_size = 2;
    const ParallelDims dims(dc, 4);
    const Meshes meshes = dims.build_meshes(c.shared_from_this());
    LlamaForCausalLM m(tiny_moe(0.01));
    m.init_weights(8);
    const DataParallelism dp = parallelize_llama(m, meshes, dc);
    Tensor& b = m.model->layers->at<LlamaDecoderLayer>("1").mlp->buffer("gate.e_score_correction_bias");
    CHECK(b.is_distributed());
    for (int step = 0; step < 5; ++step) {
      // Each rank its own tokens; two micro-batches per step.
      for (int micro = 0; micro < 2; ++micro) {
        const Tensor tok = randint(0, 50, {1, 8}, RngKey(uint64_t(100 + step * 8 + micro * 4 + c.rank()), "tok"));
        llama_step(m, tok, tok, [&] { dp.finish_backward(); });
      }
      load[size_t(c.rank())] = update_moe_load_balance(m);
    }
    bias[size_t(c.rank())] = full_tensor(b).to_vector();
  });
  for (int r = 1; r < 4; ++r) {
    CHECK(bias[size_t(r)] == bias[0]);
    CHECK(load[size_t(r)] == load[0]);
  }
  double spread = 0;
  for (double v : bias[0]) spread = std::max(spread, std::abs(v));
  CHECK(spread > 0.0);  // it moved
}

TEST_CASE("expert parallel: num_experts not divisible by ep_size is refused naming both") {
  run_threads_group(4, [](Communicator& c) {
    DistributedConfig dc;
    dc.ep_size = 4;
    const Meshes meshes = ParallelDims(dc, 4).build_meshes(c.shared_from_this());
    LlamaConfig cfg = tiny_moe();
    cfg.num_experts = 6;
    LlamaForCausalLM m(cfg);
    m.init_weights(1);
    CHECK_THROWS_WITH(parallelize_llama(m, meshes, dc), doctest::Contains("num_experts 6, not divisible by ep_size 4"));
  });
}
