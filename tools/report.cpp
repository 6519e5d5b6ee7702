// The start-up report: see report.h.
#include "tools/report.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "collectives/launch.h"

namespace quilt {
namespace {

std::string bytes_text(int64_t b) {
  char buf[32];
  if (b >= (int64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(int64_t(1) << 30));
  else if (b >= (int64_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(1 << 20));
  else std::snprintf(buf, sizeof buf, "%.1f KiB", double(b) / 1024.0);
  return buf;
}

}  // namespace

// Parameters, gradients and optimizer state are counted exactly from this rank's tensors.
// The rest is a model of the Llama block, not a measurement:
// - FSDP keeps two units gathered at once (the one computing and the next, prefetched): a
//   decoder block or the embedding + head, whichever is larger, in the compute dtype, over tp.
// - Backward keeps per token and layer about 8 h + 3 i + 2 kv values (norm outputs, q/k/v,
//   attention and projection outputs, residuals, the SwiGLU gate/up/product) divided by tp, or
//   only the block input h under full activation checkpointing (plus one block recomputed);
//   flash-style attention keeps no (s x s) scores. Tokens are micro_batch_size x seq_len / cp,
//   times the micro-batches a pipeline rank holds at once (pp under 1F1B).
// - The logits, their log-softmax and gradient: 3 x tokens x vocab / tp values in f32.
MemoryEstimate estimate_memory(const Run& r) {
  MemoryEstimate e;
  for (const Tensor& p : r.params) {
    const int64_t n = p.local().numel();
    e.parameters += n * int64_t(dtype_size(p.dtype()));
    e.gradients += n * int64_t(dtype_size(p.dtype()));
    e.optimizer += 2 * n * 4;
  }
  const ModelConfig& m = r.cfg.model;
  const TrainConfig& t = r.cfg.train;
  const int64_t tp = std::max<int64_t>(1, r.dims.tp()), pp = std::max<int64_t>(1, r.dims.pp());
  const int64_t cp = std::max<int64_t>(1, r.dims.cp());
  const int64_t compute = int64_t(dtype_size(t.param_dtype.value_or(t.dtype)));
  const int64_t h = m.hidden_size, q = m.num_attention_heads * m.head_dimension();
  const int64_t kv = m.kv_heads() * m.head_dimension();
  const int64_t ffn = m.num_experts > 0 ? m.num_experts * m.moe_intermediate_size : m.intermediate_size;
  const int64_t block = h * (q + 2 * kv) + q * h + 3 * h * ffn + 2 * h;
  const int64_t root = m.vocab_size * h * (m.tie_word_embeddings ? 1 : 2) + h;
  if (r.cfg.distributed.strategy != Strategy::kDdp && r.dims.dp_shard() > 1)
    e.gathered = 2 * std::max(block, root) / tp * compute;
  const int64_t layers = (m.num_hidden_layers + pp - 1) / pp;
  const int64_t tokens = t.micro_batch_size * t.seq_len / cp * (pp > 1 ? pp : 1);
  const int64_t active_ffn = m.num_experts > 0 ? m.num_experts_per_tok * m.moe_intermediate_size : m.intermediate_size;
  const int64_t per_layer = (8 * h + 3 * active_ffn + 2 * kv) / tp;
  const int64_t kept = r.cfg.distributed.activation_checkpointing ? layers * h + per_layer : layers * per_layer;
  e.activations = tokens * kept * compute + 3 * tokens * m.vocab_size / tp * 4;
  return e;
}

void log_startup_report(const Run& r) {
  const LaunchInfo& li = launch_info();
  log_line("launch: ", li.launcher, ", rank ", li.rank, " of ", li.world_size, ", local rank ", li.local_rank, " of ",
           li.local_size, ", device ", li.device.str());
  const MemoryEstimate e = estimate_memory(r);
  log_line("memory per rank: parameters ", bytes_text(e.parameters), ", gradients ", bytes_text(e.gradients),
           ", optimizer ", bytes_text(e.optimizer), (e.gathered ? ", FSDP gathers " + bytes_text(e.gathered) : ""),
           ", activations ", bytes_text(e.activations), "; expected peak ~", bytes_text(e.peak()),
           " (an estimate: exact state plus a model of the block's saved activations; the step lines' memory is "
           "the measured peak)");
}

}  // namespace quilt
