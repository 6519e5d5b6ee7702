// CPU GEMM on the fastest library the machine has (Eigen, OpenBLAS, BLIS or oneDNN: see
// kernels/cpu/gemm_libs.h for how it is chosen); bf16/f16 accumulate in f32.
#pragma once

#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/loop.h"

namespace quilt::kernels::cpu {

/// Batched row-major GEMM (see GemmArgs).
void gemm(DType dt, const GemmArgs& args);
/// The library doing f32 GEMM in this process ("eigen", "openblas", "blis" or "onednn"), or
/// one per transpose mode ("NN=blis NT=blis TN=onednn TT=blis") when they differ; the first
/// call makes the choice (QUILT_GEMM=name forces one library).
std::string gemm_backend();
/// How it was chosen, for the startup log (the forcing variable, or the measured GFLOP/s).
std::string gemm_backend_reason();
/// The libraries this process can use, Eigen first.
std::vector<std::string> gemm_backends();
/// Switches library by name; throws naming the Debian package when it is not installed.
void set_gemm_backend(const std::string& name);
/// Threads the GEMM and every other kernel may use (one OpenMP pool, which every library
/// follows); ranks sharing a host each take their share of its cores.
void set_gemm_threads(int n);
/// The threads a GEMM (and every kernel) uses now.
int gemm_threads();

}  // namespace quilt::kernels::cpu
