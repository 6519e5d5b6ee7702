// Host-side helpers of the CUDA kernels: error throwing for QUILT_CHECK_CUDA / QUILT_CHECK_CUBLAS,
// cuBLAS opened at its first use, the cached multiprocessor count, compiled(), the scratch-memory
// hook and the device-side error reports.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/cublas_api.h"
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

// The name of an entry point as the headers spell it after their macros (cublasCreate is
// cublasCreate_v2).
#define QUILT_CUBLAS_NAME(fn) QUILT_CUBLAS_NAME_(fn)
#define QUILT_CUBLAS_NAME_(fn) #fn

CublasApi open_cublas(const std::string& lib) {
  // The soname first (LD_LIBRARY_PATH, our RUNPATH, the loader's cache), then the toolkit's
  // directory this build was configured with.
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = h ? "" : dlerror();
  if (!h && lib == QUILT_CUBLAS_LIB) h = dlopen(QUILT_CUDA_LIBDIR "/" QUILT_CUBLAS_LIB, RTLD_NOW | RTLD_LOCAL);
  if (!h)
    throw std::runtime_error("[cublas] " + lib + " could not be opened (" + why +
                             "): GPU GEMMs need the CUDA toolkit's cuBLAS on the library path");
  CublasApi api;
  auto get = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    if (fn) return;
    dlclose(h);  // not the library we need: nothing of it stays open
    throw std::runtime_error("[cublas] " + lib + " has no " + name + ": not the cuBLAS this build needs");
  };
  get(api.create, QUILT_CUBLAS_NAME(cublasCreate));
  get(api.set_stream, QUILT_CUBLAS_NAME(cublasSetStream));
  get(api.set_workspace, QUILT_CUBLAS_NAME(cublasSetWorkspace));
  get(api.status_string, QUILT_CUBLAS_NAME(cublasGetStatusString));
  get(api.gemm_ex, QUILT_CUBLAS_NAME(cublasGemmEx));
  get(api.gemm_strided_batched_ex, QUILT_CUBLAS_NAME(cublasGemmStridedBatchedEx));
  get(api.gemm_batched_ex, QUILT_CUBLAS_NAME(cublasGemmBatchedEx));
  return api;
}

std::atomic<bool> g_cublas_loaded{false};

}  // namespace

const CublasApi& cublas() {
  static const CublasApi api = [] {
    CublasApi a = open_cublas(QUILT_CUBLAS_LIB);
    g_cublas_loaded.store(true);
    return a;
  }();
  return api;
}

bool cublas_loaded() { return g_cublas_loaded.load(); }

void load_cublas(const std::string& lib) {
  if (lib.empty() || lib == QUILT_CUBLAS_LIB) cublas();
  else open_cublas(lib);
}

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw std::runtime_error(std::string("[cuda] ") + expr + " failed: " + cudaGetErrorString(err) + " (" +
                           cudaGetErrorName(err) + ") at " + short_path(file) + ":" + std::to_string(line));
}

void throw_cublas_error(int status, const char* expr, const char* file, int line) {
  throw std::runtime_error(std::string("[cublas] ") + expr + " failed: " +
                           cublas().status_string(static_cast<cublasStatus_t>(status)) + " (status " +
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

// ---- device-side error reports ----

namespace {
constexpr int kMaxDevices = 64;
std::mutex g_slots_mu;
DeviceError* g_slots[kMaxDevices] = {};
std::atomic<bool> g_pending[kMaxDevices] = {};

int current_device() {
  int dev = 0;
  QUILT_CHECK_CUDA(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) fail_msg("device errors", "device index out of range");
  return dev;
}
}  // namespace

DeviceError* device_error_slot() {
  const int dev = current_device();
  std::lock_guard lk(g_slots_mu);
  if (!g_slots[dev]) {
    // Kept for the life of the process. Made outside any graph capture's rules (a capture may
    // run the first reporting kernel): the thread's capture mode is relaxed for the two calls.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    QUILT_CHECK_CUDA(cudaThreadExchangeStreamCaptureMode(&mode));
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, sizeof(DeviceError));
    if (err == cudaSuccess) err = cudaMemset(p, 0, sizeof(DeviceError));
    cudaThreadExchangeStreamCaptureMode(&mode);
    QUILT_CHECK_CUDA(err);
    g_slots[dev] = static_cast<DeviceError*>(p);
  }
  g_pending[dev].store(true, std::memory_order_release);
  return g_slots[dev];
}

DeviceError take_device_error(int device) {
  if (device < 0 || device >= kMaxDevices || !g_pending[device].exchange(false, std::memory_order_acq_rel)) return {};
  DeviceError* slot = nullptr;
  {
    std::lock_guard lk(g_slots_mu);
    slot = g_slots[device];
  }
  if (!slot) return {};
  int prev = 0;
  QUILT_CHECK_CUDA(cudaGetDevice(&prev));
  QUILT_CHECK_CUDA(cudaSetDevice(device));
  DeviceError e;
  // Plain copies: the caller has synchronised the streams that ran the reporting kernels.
  cudaError_t err = cudaMemcpy(&e, slot, sizeof e, cudaMemcpyDeviceToHost);
  if (err == cudaSuccess && e.op != 0) err = cudaMemset(slot, 0, sizeof e);
  cudaSetDevice(prev);
  QUILT_CHECK_CUDA(err);
  return e;
}

std::string describe_device_error(const DeviceError& e) {
  const auto v = std::to_string(e.value), b = std::to_string(e.bound), at = std::to_string(e.position);
  switch (static_cast<DeviceErrorOp>(e.op)) {
    case DeviceErrorOp::none: return "";
    case DeviceErrorOp::gather:
    case DeviceErrorOp::scatter_add:
    case DeviceErrorOp::index_select:
    case DeviceErrorOp::index_add: {
      static const char* const names[] = {"", "gather", "scatter_add", "index_select", "index_add"};
      return std::string("[") + names[e.op] + "] index " + v + " (element " + at +
             " of the index) is out of range for a dim of size " + b;
    }
    case DeviceErrorOp::embedding:  // worded as the CPU's check words it
      return "[embedding] index " + v + " at position " + at + " is out of range for a vocabulary of " + b + " rows";
    case DeviceErrorOp::cross_entropy:
      return "[cross_entropy] target " + v + " at row " + at + " is out of range for " + b + " classes (valid: 0 to " +
             std::to_string(e.bound - 1) + ", or ignore_index)";
  }
  return "[cuda] a kernel reported bad input (op code " + std::to_string(e.op) + ")";
}

}  // namespace quilt::kernels::cuda
