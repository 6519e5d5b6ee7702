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
Allocator* pinned_host_allocator() { return cpu_allocator(); }
Allocator* allocator(int) { fail("[cuda] this build has no CUDA support: no CUDA allocator"); }
MemoryStats memory_stats(int) { return {}; }
void empty_cache(int) {}
void reset_peak_memory(int) {}
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
}  // namespace detail

}  // namespace quilt
