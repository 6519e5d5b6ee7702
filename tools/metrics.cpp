// Step lines and metrics.jsonl: see metrics.h.
#include "tools/metrics.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "collectives/launch.h"
#include "engine/engine.h"
#include "engine/error.h"

namespace quilt {
namespace {

std::string with_commas(double v) {
  std::string s = std::to_string(static_cast<long long>(std::llround(v)));
  for (int i = int(s.size()) - 3; i > 0; i -= 3) s.insert(size_t(i), ",");
  return s;
}

}  // namespace

std::string short_duration(double seconds) {
  const long long s = std::llround(std::max(0.0, seconds));
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s % 3600) / 60);
  return buf;
}

namespace {

// TFLOP/s of a 1024^3 GEMM in `dt` on this rank's threads: the best of repeated calls. The first
// calls of a process run well below the machine's rate (the clock ramping up, the allocator and
// the thread pool warming: on a 2-vCPU EPYC the bf16 rate climbed from 0.07 to 0.65 TFLOP/s over
// the first dozen calls, so a best of three read 0.25 and steps then showed an MFU of 165%), so
// calls go on until the best has not risen by 2% for six calls in a row (at most 64 calls or
// half a second).
double measured_gemm_tflops(DType dt) {
  NoGradGuard ng;
  const int64_t n = 1024;
  const Tensor a = randn({n, n}, RngKey(0, "peak a"), {.dtype = dt});
  const Tensor b = randn({n, n}, RngKey(0, "peak b"), {.dtype = dt});
  const auto start = std::chrono::steady_clock::now();
  double best = 0;
  int since_rise = 0;
  for (int i = 0; i < 64 && since_rise < 6; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const Tensor c = matmul(a, b);
    const auto t1 = std::chrono::steady_clock::now();
    const double rate = 2.0 * double(n * n * n) / std::chrono::duration<double>(t1 - t0).count() / 1e12;
    if (rate > best * 1.02) since_rise = 0;
    else ++since_rise;
    best = std::max(best, rate);
    if (std::chrono::duration<double>(t1 - start).count() > 0.5) break;
  }
  return best;
}

}  // namespace

double peak_tflops_per_rank(Device device, DType compute) {
  if (const char* s = std::getenv("QUILT_PEAK_TFLOPS")) {
    const double peak = std::atof(s);
    return device.is_cpu() ? peak / double(std::max(1, launch_info().local_size)) : peak;
  }
  // A GPU: a Hopper's dense bf16 rate (H100/H200 SXM).
  if (!device.is_cpu()) return 989.0;
  const DType dt = compute == DType::bf16 ? DType::bf16 : DType::f32;
  static std::map<DType, double> measured;  // once per process and dtype
  auto it = measured.find(dt);
  if (it == measured.end()) it = measured.emplace(dt, measured_gemm_tflops(dt)).first;
  return it->second;
}

std::string step_line(const StepMetrics& m) {
  char line[320];
  int n = std::snprintf(line, sizeof line,
                        "step: %lld  loss: %.4f  grad_norm: %.4f  memory: %.2fGiB  tps: %s  tflops: %.3f  mfu: %.2f%%",
                        static_cast<long long>(m.step), m.loss, m.grad_norm, m.memory_gib, with_commas(m.tps).c_str(),
                        m.tflops, m.mfu * 100);
  if (m.gather_wait_s >= 0 && n > 0 && size_t(n) < sizeof line)
    n += std::snprintf(line + n, sizeof line - size_t(n), "  gather_wait: %.1fms", m.gather_wait_s * 1e3);
  if (m.moe_load > 0 && n > 0 && size_t(n) < sizeof line)
    n += std::snprintf(line + n, sizeof line - size_t(n), "  moe_load: %.2f", m.moe_load);
  if (m.elapsed_s >= 0 && n > 0 && size_t(n) < sizeof line)
    n += std::snprintf(line + n, sizeof line - size_t(n), "  elapsed: %s", short_duration(m.elapsed_s).c_str());
  if (m.eta_s >= 0 && n > 0 && size_t(n) < sizeof line)
    std::snprintf(line + n, sizeof line - size_t(n), "  eta: %s", short_duration(m.eta_s).c_str());
  return line;
}

MetricsLog::MetricsLog(const LoggingConfig& cfg, int rank) {
  if (!cfg.dir || rank != 0) return;
  std::filesystem::create_directories(*cfg.dir);
  path_ = (std::filesystem::path(*cfg.dir) / "metrics.jsonl").string();
  jsonl_.open(path_, std::ios::app);
  QUILT_CHECK(jsonl_.is_open(), "[logging.dir] cannot open ", path_, " for writing");
  if (cfg.tensorboard) {
    tensorboard_ = std::make_unique<TensorBoardWriter>(*cfg.dir);
    log_line("tensorboard: ", tensorboard_->path(), " (tensorboard --logdir ", *cfg.dir, ")");
  }
}

void MetricsLog::step(const StepMetrics& m, bool print) {
  if (print) log_line(step_line(m));
  if (!jsonl_.is_open()) return;
  nlohmann::json j = {{"step", m.step}, {"loss", m.loss}, {"grad_norm", m.grad_norm}, {"lr", m.lr},
                      {"tps", m.tps}, {"tflops", m.tflops}, {"mfu", m.mfu}, {"memory_gib", m.memory_gib}};
  if (m.gather_wait_s >= 0) j["gather_wait_s"] = m.gather_wait_s;
  if (m.moe_load > 0) j["moe_load"] = m.moe_load;
  if (m.skipped) j["skipped"] = true;
  if (m.elapsed_s >= 0) j["elapsed_s"] = m.elapsed_s;
  if (tensorboard_)
    tensorboard_->scalars(m.step, {{"loss", m.loss}, {"lr", m.lr}, {"grad_norm", m.grad_norm}, {"tps", m.tps},
                                   {"memory_gib", m.memory_gib}});
  jsonl_ << j.dump() << "\n";
  jsonl_.flush();
  // Rank 0 alone writes it: a full disk here ends every rank at once (exit_on_error).
  QUILT_CHECK(jsonl_.good(), "[logging.dir] writing ", path_, " failed at step ", m.step, " (disk full?)");
}

}  // namespace quilt
