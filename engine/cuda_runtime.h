// Internal to the engine: the few CUDA runtime calls the device-agnostic engine code needs.
// Implemented in engine/cuda/ (with CUDA) or engine/cuda_stub/ (throws).
#pragma once

#include <cstddef>

#include "engine/device.h"

namespace quilt::cuda_rt {

enum class CopyKind { host_to_device, device_to_host, device_to_device };
/// Asynchronous copy on `stream` (host memory should be pinned for true asynchrony).
void memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind, const Stream& stream);
/// Raw device allocation bypassing the cache (the caching allocator's backing store).
void* raw_malloc(size_t bytes, int device);
void raw_free(void* ptr, int device);

}  // namespace quilt::cuda_rt

namespace quilt::detail {
// Event and stream handles as void* (cudaEvent_t / cudaStream_t underneath).
void* cuda_event_create(int device);
void cuda_event_destroy(void* ev);
void cuda_event_record(void* ev, void* stream);
void cuda_event_wait(void* ev, void* stream);
void cuda_event_synchronize(void* ev);
bool cuda_event_query(void* ev);
void* cuda_stream_create(int device);
void cuda_stream_synchronize(void* stream);
/// Throws what a kernel on `device` reported about its input since the last check (an index out
/// of range, kernels::cuda::DeviceError), naming the op; nothing when none. After a sync.
void cuda_check_device_errors(int device);
// Graph capture in device `device`'s caching allocator (CachingPool::begin_capture & co.);
// a pool is released once the last graph using it is reset.
int cuda_pool_begin_capture(int device, void* stream, int pool);
void cuda_pool_end_capture(int device, void* stream);
void cuda_pool_release(int device, int pool, void* replay_stream);
}  // namespace quilt::detail
