// Batched row-major GEMM through cuBLAS. cuBLAS is column-major, and a row-major matrix is
// the column-major transpose, so C = op(A) op(B) runs as C^T = op(B)^T op(A)^T with the
// operands swapped and the same leading dimensions. f32 and f64 stay exact (no TF32); bf16 and
// f16 multiply on tensor cores with f32 accumulation. Batches whose offsets form one stride
// each (broadcast = stride 0) use the strided-batched call; others a pointer-array call.
#include <climits>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cublas_api.h"
#include "kernels/cuda/kernels.h"

namespace quilt::kernels::cuda {
namespace {

// cuBLAS keeps one default workspace per handle, which two streams would share; each
// (device, stream) gets its own so GEMMs on different streams never race on it.
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

struct ThreadBlas {
  std::unordered_map<int, cublasHandle_t> handles;               // per device
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;      // per (device, stream)
};

// Handles are per thread (a cuBLAS handle must not be used by two threads at once) and are
// never destroyed: tearing them down at thread exit could run after the driver shut down.
cublasHandle_t blas_for(cudaStream_t stream) {
  thread_local ThreadBlas* t = new ThreadBlas();
  int dev = 0;
  QUILT_CHECK_CUDA(cudaGetDevice(&dev));
  cublasHandle_t& h = t->handles[dev];
  if (!h) QUILT_CHECK_CUBLAS(cublas().create(&h));
  QUILT_CHECK_CUBLAS(cublas().set_stream(h, stream));
  void*& ws = t->workspaces[{dev, stream}];
  if (!ws) ws = workspace_alloc(kWorkspaceBytes, stream);  // kept with the handle
  QUILT_CHECK_CUBLAS(cublas().set_workspace(h, ws, kWorkspaceBytes));
  return h;
}

struct BlasTypes {
  cudaDataType_t data;
  cublasComputeType_t compute;
  bool f64_scale;  // alpha/beta are double for f64, float otherwise
};

BlasTypes blas_types(DType dt) {
  switch (dt) {
    case DType::f32: return {CUDA_R_32F, CUBLAS_COMPUTE_32F, false};
    case DType::f64: return {CUDA_R_64F, CUBLAS_COMPUTE_64F, true};
    case DType::bf16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F, false};
    case DType::f16: return {CUDA_R_16F, CUBLAS_COMPUTE_32F, false};
    default: fail_dtype("matmul", dt);
  }
}

// Offsets first + i * stride for every batch i (stride 0 = broadcast)?
bool uniform(const int64_t* off, int64_t batch, int64_t& first, int64_t& stride) {
  first = off ? off[0] : 0;
  stride = off && batch > 1 ? off[1] - off[0] : 0;
  if (!off) return true;
  for (int64_t i = 0; i < batch; ++i)
    if (off[i] != first + i * stride) return false;
  return true;
}

// C = beta * C for k == 0 (nothing to multiply; A and B may not even be valid pointers).
template <class T>
__global__ void scale_kernel(T* c, int64_t m, int64_t n, int64_t ldc, float beta) {
  const int64_t total = m * n, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    T& v = c[(i / n) * ldc + i % n];
    v = Num<T>::store(Num<T>::load(v) * static_cast<compute_t<T>>(beta));
  }
}

void empty_k(DType dt, const GemmArgs& g, cudaStream_t s) {
  const size_t es = dtype_size(dt);
  for (int64_t b = 0; b < g.batch; ++b) {
    char* c = static_cast<char*>(g.c) + (g.c_offsets ? g.c_offsets[b] : 0) * int64_t(es);
    if (g.beta == 0.0f) {
      QUILT_CHECK_CUDA(cudaMemset2DAsync(c, size_t(g.ldc) * es, 0, size_t(g.n) * es, size_t(g.m), s));
    } else {
      QUILT_DISPATCH_FLOATING(dt, [&] {
        scale_kernel<scalar_t><<<grid_for(g.m * g.n, 256), 256, 0, s>>>(reinterpret_cast<scalar_t*>(c), g.m, g.n,
                                                                         g.ldc, g.beta);
        QUILT_CHECK_LAUNCH();
      });
    }
  }
}

int as_int(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX) fail_msg("matmul", (std::string(what) + " does not fit cuBLAS's 32-bit int").c_str());
  return static_cast<int>(v);
}

}  // namespace

void gemm(DType dt, const GemmArgs& g, void* stream) {
  const BlasTypes ty = blas_types(dt);
  const cudaStream_t s = as_stream(stream);
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  if (g.k == 0) return empty_k(dt, g, s);
  const int m = as_int(g.m, "m"), n = as_int(g.n, "n"), k = as_int(g.k, "k");
  const int lda = as_int(g.lda, "lda"), ldb = as_int(g.ldb, "ldb"), ldc = as_int(g.ldc, "ldc");
  const int batch = as_int(g.batch, "batch");
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS's first operand
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const double alpha_d = g.alpha, beta_d = g.beta;
  const float alpha_f = g.alpha, beta_f = g.beta;
  const void* alpha = ty.f64_scale ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = ty.f64_scale ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
  const size_t es = dtype_size(dt);
  cublasHandle_t h = blas_for(s);

  int64_t a0, as, b0, bs, c0, cs;
  const bool ua = uniform(g.a_offsets, g.batch, a0, as);
  const bool ub = uniform(g.b_offsets, g.batch, b0, bs);
  const bool uc = uniform(g.c_offsets, g.batch, c0, cs);
  const char* a = static_cast<const char*>(g.a);
  const char* b = static_cast<const char*>(g.b);
  char* c = static_cast<char*>(g.c);
  if (batch == 1) {
    QUILT_CHECK_CUBLAS(cublas().gemm_ex(h, op_b, op_a, n, m, k, alpha, b + b0 * int64_t(es), ty.data, ldb,
                                        a + a0 * int64_t(es), ty.data, lda, beta, c + c0 * int64_t(es), ty.data,
                                        ldc, ty.compute, CUBLAS_GEMM_DEFAULT));
    return;
  }
  if (ua && ub && uc) {
    QUILT_CHECK_CUBLAS(cublas().gemm_strided_batched_ex(
        h, op_b, op_a, n, m, k, alpha, b + b0 * int64_t(es), ty.data, ldb, bs, a + a0 * int64_t(es), ty.data, lda, as,
        beta, c + c0 * int64_t(es), ty.data, ldc, cs, batch, ty.compute, CUBLAS_GEMM_DEFAULT));
    return;
  }
  // Pointer arrays (B, A, C per batch) staged to the device in one stream-ordered buffer. The
  // host vector may go right after cudaMemcpyAsync: a copy from pageable memory is staged first.
  std::vector<const void*> ptrs(size_t(batch) * 3);
  for (int64_t i = 0; i < batch; ++i) {
    ptrs[size_t(i)] = b + (g.b_offsets ? g.b_offsets[i] : 0) * int64_t(es);
    ptrs[size_t(batch + i)] = a + (g.a_offsets ? g.a_offsets[i] : 0) * int64_t(es);
    ptrs[size_t(2 * batch + i)] = c + (g.c_offsets ? g.c_offsets[i] : 0) * int64_t(es);
  }
  const size_t bytes = ptrs.size() * sizeof(void*);
  void* dev = workspace_alloc(bytes, s);
  QUILT_CHECK_CUDA(cudaMemcpyAsync(dev, ptrs.data(), bytes, cudaMemcpyHostToDevice, s));
  const void* const* dp = static_cast<const void* const*>(dev);
  const cublasStatus_t st =
      cublas().gemm_batched_ex(h, op_b, op_a, n, m, k, alpha, dp, ty.data, ldb, dp + batch, ty.data, lda, beta,
                               const_cast<void* const*>(dp + 2 * batch), ty.data, ldc, batch, ty.compute,
                               CUBLAS_GEMM_DEFAULT);
  workspace_free(dev, s);  // before checking, so a failed call does not leak it
  QUILT_CHECK_CUBLAS(st);
}

}  // namespace quilt::kernels::cuda
