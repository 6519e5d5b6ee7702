// The MFU denominator: measured on the host, fixed on a GPU, overridden by QUILT_PEAK_TFLOPS.
#include <doctest/doctest.h>

#include <cstdlib>

#include "tools/metrics.h"

using namespace quilt;

TEST_CASE("metrics: the host's peak is a GEMM measured once per dtype, a GPU's is a Hopper's, and the variable overrides") {
  unsetenv("QUILT_PEAK_TFLOPS");
  const double f32 = peak_tflops_per_rank(Device::cpu(), DType::f32);
  CHECK(f32 > 0.001);  // any CPU multiplies 1024^3 at over 1 GFLOP/s
  CHECK(f32 < 100.0);
  CHECK(peak_tflops_per_rank(Device::cpu(), DType::f32) == f32);  // measured once, then kept
  CHECK(peak_tflops_per_rank(Device::cpu(), DType::f64) == f32);  // non-bf16 compute: the f32 rate
  const double bf16 = peak_tflops_per_rank(Device::cpu(), DType::bf16);
  CHECK(bf16 > 0.001);
  CHECK(peak_tflops_per_rank(Device::cpu(), DType::bf16) == bf16);
  CHECK(peak_tflops_per_rank(Device::cuda(0), DType::bf16) == 989.0);
  setenv("QUILT_PEAK_TFLOPS", "2.5", 1);
  CHECK(peak_tflops_per_rank(Device::cuda(0)) == 2.5);
  unsetenv("QUILT_PEAK_TFLOPS");
}
