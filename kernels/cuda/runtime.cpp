// Host-side helpers of the CUDA kernels: error throwing for QUILT_CHECK_CUDA / QUILT_CHECK_CUBLAS,
// the cached multiprocessor count, and compiled().
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <stdexcept>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/kernels.h"

namespace quilt::kernels::cuda {
namespace {

// Paths shown relative to the repository (the part after the last "kernels/", "engine/", ...).
const char* short_path(const char* file) {
  const std::string f(file);
  for (const char* root : {"/kernels/", "/engine/", "/collectives/", "/tests/", "/bench/"}) {
    const size_t at = f.rfind(root);
    if (at != std::string::npos) return file + at + 1;
  }
  return file;
}

}  // namespace

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw std::runtime_error(std::string("[cuda] ") + expr + " failed: " + cudaGetErrorString(err) + " (" +
                           cudaGetErrorName(err) + ") at " + short_path(file) + ":" + std::to_string(line));
}

void throw_cublas_error(int status, const char* expr, const char* file, int line) {
  throw std::runtime_error(std::string("[cublas] ") + expr + " failed: " +
                           cublasGetStatusString(static_cast<cublasStatus_t>(status)) + " (status " +
                           std::to_string(status) + ") at " + short_path(file) + ":" + std::to_string(line));
}

int sm_count() {
  static std::array<std::atomic<int>, 64> cache{};
  int dev = 0;
  QUILT_CHECK_CUDA(cudaGetDevice(&dev));
  const bool cached = dev >= 0 && dev < int(cache.size());
  int n = cached ? cache[size_t(dev)].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    QUILT_CHECK_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    if (cached) cache[size_t(dev)].store(n, std::memory_order_relaxed);
  }
  return n;
}

void fail_dtype(const char* what, DType dt) {
  throw std::runtime_error(std::string("[") + what + "] has no CUDA kernel for dtype " + dtype_name(dt));
}

void fail_msg(const char* what, const char* message) {
  throw std::runtime_error(std::string("[") + what + "] " + message);
}

bool compiled() { return true; }

namespace {
WorkspaceAlloc g_workspace_alloc = nullptr;
WorkspaceFree g_workspace_free = nullptr;
}  // namespace

void set_workspace_allocator(WorkspaceAlloc alloc, WorkspaceFree free) {
  g_workspace_alloc = alloc;
  g_workspace_free = free;
}

void* workspace_alloc(size_t bytes, cudaStream_t stream) {
  int dev = 0;
  QUILT_CHECK_CUDA(cudaGetDevice(&dev));
  if (g_workspace_alloc) return g_workspace_alloc(bytes, dev, stream);
  void* p = nullptr;
  QUILT_CHECK_CUDA(cudaMallocAsync(&p, bytes, stream));
  return p;
}

void workspace_free(void* ptr, cudaStream_t stream) {
  if (!ptr) return;
  if (g_workspace_free) {
    int dev = 0;
    QUILT_CHECK_CUDA(cudaGetDevice(&dev));
    g_workspace_free(ptr, dev, stream);
    return;
  }
  QUILT_CHECK_CUDA(cudaFreeAsync(ptr, stream));
}

}  // namespace quilt::kernels::cuda
