// What every CUDA test file shares: the skip when no device is usable, the device, and
// element-wise comparison against the CPU with the worst offender reported.
//
//   TEST_CASE("cuda: exp matches the CPU") {
//     SKIP_WITHOUT_CUDA();
//     check_close(exp(gpu(x)), exp(x), rtol_of(x.dtype()), 1e-6, "exp");
//   }
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/engine.h"

/// Returns from the test case, saying why, when no CUDA device is usable (a skip, not a pass).
#define SKIP_WITHOUT_CUDA()                                                           \
  do {                                                                                \
    if (!::quilt::cuda::is_available()) {                                                      \
      MESSAGE("skipped: no CUDA device (" << ::quilt::cuda::unavailable_reason() << ")"); \
      return;                                                                         \
    }                                                                                 \
  } while (0)

namespace quilt::cuda_test {

inline const Device kGpu = Device::cuda(0);

/// A copy of `t` on the GPU.
inline Tensor gpu(const Tensor& t) { return t.to(kGpu); }

// Every element within atol + rtol * |want| (NaN matches NaN); reports the worst offender.
inline void check_close(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what) {
  REQUIRE_MESSAGE(got.shape() == want.shape(), what);
  CHECK_MESSAGE(got.dtype() == want.dtype(), what << ": dtype " << dtype_name(got.dtype()) << " vs "
                                                  << dtype_name(want.dtype()));
  const std::vector<double> g = got.to_vector(), w = want.to_vector();
  size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < g.size(); ++i) {
    if (g[i] == w[i] || (std::isnan(g[i]) && std::isnan(w[i]))) continue;
    const double err = std::fabs(g[i] - w[i]), tol = atol + rtol * std::fabs(w[i]);
    if (!(err <= tol)) {
      ++bad;
      if (!(err - tol <= worst_excess)) { worst_excess = err - tol; worst = i; }
    }
  }
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << g.size() << " elements differ; worst at " << worst
                               << ": got " << (g.empty() ? 0.0 : g[worst]) << ", want " << (w.empty() ? 0.0 : w[worst]));
}

inline void check_equal(const Tensor& got, const Tensor& want, const std::string& what) { check_close(got, want, 0, 0, what); }

// Tolerances for results computed in float and rounded to the storage dtype.
inline double rtol_of(DType dt) {
  switch (dt) {
    case DType::bf16: return 1.6e-2;
    case DType::f16: return 2e-3;
    case DType::f64: return 1e-12;
    default: return 2e-5;
  }
}

}  // namespace quilt::cuda_test
