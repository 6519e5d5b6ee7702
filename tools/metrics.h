// Step figures: the step line rank 0 prints and the metrics.jsonl record of every step.
//
//   MetricsLog log(cfg.logging, rank);
//   log.step(metrics, /*print=*/true);    // "step: 10  loss: 2.3412  grad_norm: ..." + one JSON line
#pragma once

#include <fstream>
#include <memory>
#include <string>

#include "tools/config.h"
#include "tools/tensorboard.h"
#include "tools/trainer.h"

namespace quilt {

/// Peak throughput per rank for MFU. On the host: a 1024^3 GEMM in `compute` (the parameters'
/// dtype: f32, or bf16 where the CPU multiplies it natively) timed once per process on this
/// rank's threads (best of three), so MFU is against what this machine's GEMM does, whatever
/// the CPU; on a GPU (train.device cuda): a Hopper's dense bf16 rate, 989 TFLOP/s.
/// QUILT_PEAK_TFLOPS (TFLOP/s per host, or per GPU) overrides either.
double peak_tflops_per_rank(Device device = Device::cpu(), DType compute = DType::f32);

/// "step: 10  loss: 2.3412  grad_norm: 0.5123  memory: 0.01GiB  tps: 12,345  tflops: 0.012  mfu: 4.80%
/// elapsed: 1m05s  eta: 20m40s".
std::string step_line(const StepMetrics& m);

/// "45s", "3m05s", "2h03m": a duration for progress lines.
std::string short_duration(double seconds);

/// Writes metrics.jsonl (and with logging.tensorboard an events file) under logging.dir
/// (rank 0) and prints step lines every logging.every_steps.
class MetricsLog {
 public:
  MetricsLog(const LoggingConfig& cfg, int rank);
  /// Records one step; prints its line when `print`.
  void step(const StepMetrics& m, bool print);

 private:
  std::string path_;
  std::ofstream jsonl_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace quilt
