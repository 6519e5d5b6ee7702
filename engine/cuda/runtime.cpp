// The engine's CUDA runtime calls: device discovery and selection (engine/device.h), copies,
// raw allocations, events and streams (engine/cuda_runtime.h). engine/cuda_stub/cuda_stub.cpp
// is the no-CUDA twin of this file and the allocator: keep the two in sync.
#include <cuda_runtime_api.h>

#include <string>

#include "engine/cuda/device_guard.h"
#include "engine/cuda_runtime.h"
#include "engine/device.h"
#include "engine/error.h"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/kernels.h"

namespace quilt {
namespace {

struct Probe {
  int count = 0;
  std::string reason;  // empty when count > 0
};

// Asked once per process: without a driver (no libcuda.so.1) cudaGetDeviceCount fails and its
// message ("CUDA driver version is insufficient for CUDA runtime version", ...) is the reason.
const Probe& probe() {
  static const Probe p = [] {
    Probe r;
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      r.reason = std::string(cudaGetErrorString(err)) + " (" + cudaGetErrorName(err) + ")";
      cudaGetLastError();  // the failure is reported through the reason; clear it
    } else if (n == 0) {
      r.reason = "no CUDA device found";
    } else {
      r.count = n;
    }
    return r;
  }();
  return p;
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Entry points that create CUDA state check for a device first, so a machine without one gets
// the same quilt::Error (naming the op and the driver's reason) as a build without CUDA.
void require_cuda(const char* op) {
  if (probe().count == 0) fail("[", op, "] CUDA is not available: ", probe().reason);
}
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

}  // namespace

namespace cuda {
bool is_available() { return probe().count > 0; }
int device_count() { return probe().count; }
std::string unavailable_reason() { return probe().reason; }

void set_device(int i) {
  QUILT_CHECK(is_available(), "[cuda] set_device(", i, "): CUDA is not available: ", unavailable_reason());
  QUILT_CHECK(i >= 0 && i < device_count(), "[cuda] set_device(", i, "): this process sees ", device_count(),
              " CUDA device(s)");
  QUILT_CHECK_CUDA(cudaSetDevice(i));
}

std::string pci_bus_id(int i) {
  QUILT_CHECK(i >= 0 && i < device_count(), "[cuda] pci_bus_id(", i, "): this process sees ", device_count(),
              " CUDA device(s)");
  char id[32] = {};
  QUILT_CHECK_CUDA(cudaDeviceGetPCIBusId(id, int(sizeof id), i));
  return id;
}

std::string uuid(int i) {
  QUILT_CHECK(i >= 0 && i < device_count(), "[cuda] uuid(", i, "): this process sees ", device_count(),
              " CUDA device(s)");
  cudaDeviceProp prop{};
  QUILT_CHECK_CUDA(cudaGetDeviceProperties(&prop, i));
  static const char* const kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : prop.uuid.bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}
}  // namespace cuda

namespace cuda_rt {

void memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind, const Stream& stream) {
  if (bytes == 0) return;
  const cudaMemcpyKind k = kind == CopyKind::host_to_device   ? cudaMemcpyHostToDevice
                           : kind == CopyKind::device_to_host ? cudaMemcpyDeviceToHost
                                                              : cudaMemcpyDeviceToDevice;
  QUILT_CHECK(stream.device.is_cuda(), "[copy] a CUDA copy needs a CUDA stream, got one of ", stream.device.str());
  require_cuda("copy");
  cuda_detail::DeviceGuard g(stream.device.index);
  QUILT_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, k, as_stream(stream.handle)));
}

void* raw_malloc(size_t bytes, int device) {
  require_cuda("cuda");
  cuda_detail::DeviceGuard g(device);
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    fail("[cuda] out of memory: cudaMalloc of ", bytes, " bytes on cuda:", device, " failed");
  }
  QUILT_CHECK_CUDA(err);
  return p;
}

void raw_free(void* ptr, int device) {
  if (!ptr) return;
  cuda_detail::DeviceGuard g(device);
  QUILT_CHECK_CUDA(cudaFree(ptr));
}

}  // namespace cuda_rt

namespace detail {

void* cuda_event_create(int device) {
  require_cuda("event");
  cuda_detail::DeviceGuard g(device);
  cudaEvent_t e = nullptr;
  QUILT_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void cuda_event_destroy(void* ev) {
  if (ev) cudaEventDestroy(as_event(ev));  // called from ~Event: never throws
}

void cuda_event_record(void* ev, void* stream) { QUILT_CHECK_CUDA(cudaEventRecord(as_event(ev), as_stream(stream))); }

void cuda_event_wait(void* ev, void* stream) {
  QUILT_CHECK_CUDA(cudaStreamWaitEvent(as_stream(stream), as_event(ev), 0));
}

void cuda_event_synchronize(void* ev) { QUILT_CHECK_CUDA(cudaEventSynchronize(as_event(ev))); }

bool cuda_event_query(void* ev) {
  const cudaError_t err = cudaEventQuery(as_event(ev));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();  // "not ready" is an answer, not an error: do not leave it behind
    return false;
  }
  QUILT_CHECK_CUDA(err);
  return true;
}

// Non-blocking: a side stream does not serialise with the legacy default stream, so
// communication on it can overlap compute there (order them with events).
void* cuda_stream_create(int device) {
  require_cuda("stream");
  cuda_detail::DeviceGuard g(device);
  cudaStream_t s = nullptr;
  QUILT_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void cuda_stream_synchronize(void* stream) {
  require_cuda("stream");  // the default stream (nullptr) needs no creation, so check here too
  QUILT_CHECK_CUDA(cudaStreamSynchronize(as_stream(stream)));
}

void cuda_check_device_errors(int device) {
  const kernels::cuda::DeviceError e = kernels::cuda::take_device_error(device);
  if (e.op != 0)
    fail(kernels::cuda::describe_device_error(e), " (found by a kernel on cuda:", device,
         ", reported at the next synchronisation with the host)");
}

}  // namespace detail

}  // namespace quilt
