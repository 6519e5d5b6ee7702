// CPU GEMM: Eigen (OpenMP) by default, OpenBLAS for f32/f64 when QUILT_GEMM=openblas and the
// build found it; bf16/f16 are widened to f32, multiplied, and rounded back.
#pragma once

#include "kernels/dtype.h"
#include "kernels/loop.h"

namespace quilt::kernels::cpu {

/// Batched row-major GEMM (see GemmArgs).
void gemm(DType dt, const GemmArgs& args);
/// Which library does f32 GEMM in this build ("openblas" or "eigen").
const char* gemm_backend();
/// Threads the GEMM may use (OpenMP for Eigen, the BLAS library's own pool otherwise); ranks
/// sharing a host each take their share of its cores.
void set_gemm_threads(int n);
/// Forces Eigen even when BLAS is present (benchmarks compare the two).
void set_gemm_use_blas(bool use);

}  // namespace quilt::kernels::cpu
