// Builds without CUDA link this: devices report unavailable, CUDA entry points throw.
#include "engine/cuda_runtime.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/storage.h"

namespace quilt {

namespace cuda {
bool is_available() { return false; }
int device_count() { return 0; }
std::string unavailable_reason() { return "this build has no CUDA support (configured with QUILT_CUDA=OFF)"; }
void set_device(int) { fail("[cuda] this build has no CUDA support"); }
std::string pci_bus_id(int) { fail("[cuda] this build has no CUDA support"); }
std::string uuid(int) { fail("[cuda] this build has no CUDA support"); }
Allocator* pinned_host_allocator() { return cpu_allocator(); }
Allocator* allocator(int) { fail("[cuda] this build has no CUDA support: no CUDA allocator"); }
MemoryStats memory_stats(int) { return {}; }
void empty_cache(int) {}
void reset_peak_memory(int) {}

Graph::~Graph() = default;
void Graph::capture_begin(const Stream& s, const Graph*) {
  QUILT_CHECK(s.device.is_cuda(), "[cuda graph] capture_begin on a stream of ", s.device.str(),
              ": graphs capture CUDA streams");
  fail("[cuda graph] has no CUDA implementation in this build");
}
void Graph::capture_end() { fail("[cuda graph] capture_end without capture_begin"); }
void Graph::replay(const Stream&) { fail("[cuda graph] replay of a graph that was not captured"); }
void Graph::reset() {}
}  // namespace cuda

namespace cuda_rt {
void memcpy_async(void*, const void*, size_t, CopyKind, const Stream&) {
  fail("[copy] has no CUDA implementation in this build");
}
void* raw_malloc(size_t, int) { fail("[cuda] this build has no CUDA support"); }
void raw_free(void*, int) {}
}  // namespace cuda_rt

namespace detail {
void* cuda_event_create(int) { fail("[event] has no CUDA implementation in this build"); }
void cuda_event_destroy(void*) {}
void cuda_event_record(void*, void*) { fail("[event] has no CUDA implementation in this build"); }
void cuda_event_wait(void*, void*) { fail("[event] has no CUDA implementation in this build"); }
void cuda_event_synchronize(void*) {}
bool cuda_event_query(void*) { return true; }
void* cuda_stream_create(int) { fail("[stream] has no CUDA implementation in this build"); }
void cuda_stream_synchronize(void*) { fail("[stream] has no CUDA implementation in this build"); }
void cuda_check_device_errors(int) {}  // no device: no kernel ran, nothing to report
int cuda_pool_begin_capture(int, void*, int) { fail("[cuda graph] has no CUDA implementation in this build"); }
void cuda_pool_end_capture(int, void*) {}
void cuda_pool_release(int, int, void*) {}
}  // namespace detail

}  // namespace quilt
