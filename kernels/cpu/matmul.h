// CPU GEMM: BLAS (OpenBLAS) for f32/f64 when the build found one, Eigen otherwise;
// bf16/f16 are widened to f32, multiplied, and rounded back.
#pragma once

#include "kernels/dtype.h"
#include "kernels/loop.h"

namespace quilt::kernels::cpu {

/// Batched row-major GEMM (see GemmArgs).
void gemm(DType dt, const GemmArgs& args);
/// Which library does f32 GEMM in this build ("openblas" or "eigen").
const char* gemm_backend();
/// Forces Eigen even when BLAS is present (benchmarks compare the two).
void set_gemm_use_blas(bool use);

}  // namespace quilt::kernels::cpu
