// Whole training steps on one GPU through the public API: a ~1B-parameter dense Llama (hidden
// 2048, 16 layers, 16 heads of 128, 8 kv heads, intermediate 5632, vocab 32000, 2 x 2048 tokens)
// and an MoE of the same width (64 experts, top 8, expert width 768), each step = forward, mean
// next-token loss, backward, AdamW. The rate is model FLOPs (6N + attention, the model's own
// flops_per_token) per second; pct_peak is MFU against the H200's 989 TFLOP/s dense bf16 peak.
// A step that cannot run on the device yet reports the op that refused, as an error row.
#include <memory>
#include <string>

#include "bench/kernels/cuda_bench.h"
#include "models/llama/llama.h"

namespace quilt::cuda_bench {
namespace {

constexpr double kMfuPeakTflops = 989.0;  // H200 dense bf16, datasheet: the MFU denominator

LlamaConfig dense_1b() {
  LlamaConfig cfg;
  cfg.hidden_size = 2048;
  cfg.intermediate_size = 5632;
  cfg.num_hidden_layers = 16;
  cfg.num_attention_heads = 16;
  cfg.num_key_value_heads = 8;
  cfg.head_dim = 128;
  cfg.vocab_size = 32000;
  cfg.max_position_embeddings = 4096;
  return cfg;
}

LlamaConfig moe_of(LlamaConfig cfg) {
  cfg.model_type = "qwen3_moe";
  cfg.num_hidden_layers = 8;
  cfg.num_experts = 64;
  cfg.num_experts_per_tok = 8;
  cfg.moe_intermediate_size = 768;
  return cfg;
}

void bm_step(benchmark::State& state, const LlamaConfig& cfg, DType dt, int64_t batch, int64_t seq) {
  try {
    LlamaForCausalLM model(cfg);
    model.init_weights(1);
    if (dt != DType::f32) model.to(dt);
    model.to(kGpu);
    AdamW opt(model.parameters(), {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1});
    const Tensor tokens = randint(0, cfg.vocab_size, {batch, seq + 1}, RngKey(1, "tokens")).to(kGpu);
    const Tensor inputs = contiguous(narrow(tokens, 1, 0, seq)), targets = contiguous(narrow(tokens, 1, 1, seq));
    const Tensor positions = arange(0, double(seq), 1, {.dtype = DType::i64, .device = kGpu});
    const double flops = model.flops_per_token(seq) * double(batch * seq);
    timed(state, 1, flops, true, kMfuPeakTflops, [&] {
      Tensor logits = model(inputs, positions);
      Tensor loss = cross_entropy(reshape(cast(logits, DType::f32), {-1, cfg.vocab_size}), reshape(targets, {-1}));
      loss.backward();
      opt.step();
      opt.zero_grad();
    });
    state.counters["tokens_per_s"] = double(state.counters["TFLOPs"]) * 1e12 / model.flops_per_token(seq);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void register_steps() {
  const int64_t batch = 2, seq = 2048;
  const LlamaConfig dense = dense_1b(), moe = moe_of(dense_1b());
  // bf16 weights and activations; an f32 step measures cuBLAS's f32 GEMM, timed elsewhere.
  reg("llama1b_step_bf16/" + shape_of({batch, seq}), [=](benchmark::State& s) { bm_step(s, dense, DType::bf16, batch, seq); });
  reg("moe64x8_step_bf16/" + shape_of({batch, seq}),
      [=](benchmark::State& s) { bm_step(s, moe, DType::bf16, batch, seq); });
}

const Registrar steps(register_steps);

}  // namespace
}  // namespace quilt::cuda_bench
