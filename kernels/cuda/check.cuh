// Error checks for CUDA runtime and cuBLAS calls: QUILT_CHECK_CUDA(cudaMalloc(...)) throws an
// exception whose message names the call, the error and file:line. Only files under
// kernels/cuda, engine/cuda and collectives/nccl include this (it pulls in the CUDA runtime).
//
//   QUILT_CHECK_CUDA(cudaMemsetAsync(p, 0, n, stream));
//   my_kernel<<<grid, block, 0, stream>>>(...);  QUILT_CHECK_LAUNCH();
#pragma once

#include <cuda_runtime_api.h>

namespace quilt::kernels::cuda {

/// Throws "[cuda] <expr> failed: <message> (<error name>) at <file>:<line>".
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
/// Throws "[cublas] <expr> failed: <status name> at <file>:<line>".
[[noreturn]] void throw_cublas_error(int status, const char* expr, const char* file, int line);
/// Scratch memory on the current device for work queued on `stream` (set_workspace_allocator).
void* workspace_alloc(size_t bytes, cudaStream_t stream);
/// Returns it once the work using it is queued on `stream` (stream order makes reuse safe).
void workspace_free(void* ptr, cudaStream_t stream);

}  // namespace quilt::kernels::cuda

/// Evaluates a CUDA runtime call and throws (naming the call and file:line) unless it succeeded.
#define QUILT_CHECK_CUDA(expr)                                                         \
  do {                                                                                 \
    const cudaError_t quilt_cuda_err_ = (expr);                                        \
    if (quilt_cuda_err_ != cudaSuccess)                                                \
      ::quilt::kernels::cuda::throw_cuda_error(quilt_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Evaluates a cuBLAS / cuBLASLt call and throws unless it returned CUBLAS_STATUS_SUCCESS.
#define QUILT_CHECK_CUBLAS(expr)                                                       \
  do {                                                                                 \
    const int quilt_cublas_st_ = static_cast<int>(expr);                               \
    if (quilt_cublas_st_ != 0)                                                         \
      ::quilt::kernels::cuda::throw_cublas_error(quilt_cublas_st_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Right after a <<<...>>> launch: surfaces bad launch configurations at the launch site.
#define QUILT_CHECK_LAUNCH() QUILT_CHECK_CUDA(cudaGetLastError())
