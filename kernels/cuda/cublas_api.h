// The cuBLAS entry points the kernels call, opened at the first use (kernels.h: load_cublas).
#pragma once

#include <cublas_v2.h>

namespace quilt::kernels::cuda {

// The Ex calls also have C++ overloads taking a cudaDataType compute type (inline wrappers that
// migrate it); these are the exported ones, with a cublasComputeType_t.
using CublasGemmEx = cublasStatus_t(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                    const void*, cudaDataType, int, const void*, cudaDataType, int, const void*,
                                    void*, cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
using CublasGemmStridedBatchedEx = cublasStatus_t(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                                  const void*, const void*, cudaDataType, int, long long int,
                                                  const void*, cudaDataType, int, long long int, const void*, void*,
                                                  cudaDataType, int, long long int, int, cublasComputeType_t,
                                                  cublasGemmAlgo_t);
using CublasGemmBatchedEx = cublasStatus_t(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                           const void*, const void* const[], cudaDataType, int, const void* const[],
                                           cudaDataType, int, const void*, void* const[], cudaDataType, int, int,
                                           cublasComputeType_t, cublasGemmAlgo_t);
// The header declares each with exactly these types (unevaluated: nothing here links cuBLAS).
static_assert(sizeof(static_cast<CublasGemmEx*>(&cublasGemmEx)) > 0);
static_assert(sizeof(static_cast<CublasGemmStridedBatchedEx*>(&cublasGemmStridedBatchedEx)) > 0);
static_assert(sizeof(static_cast<CublasGemmBatchedEx*>(&cublasGemmBatchedEx)) > 0);

struct CublasApi {
  decltype(&cublasCreate) create = nullptr;
  decltype(&cublasSetStream) set_stream = nullptr;
  decltype(&cublasSetWorkspace) set_workspace = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  CublasGemmEx* gemm_ex = nullptr;
  CublasGemmStridedBatchedEx* gemm_strided_batched_ex = nullptr;
  CublasGemmBatchedEx* gemm_batched_ex = nullptr;
};

/// This build's cuBLAS, opened on the first call (thread-safe; a failed open throws and the next
/// call tries again).
const CublasApi& cublas();

}  // namespace quilt::kernels::cuda
