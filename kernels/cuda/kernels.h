// CUDA kernels and runtime calls on raw device pointers. This header has no CUDA types
// (streams are void*), so every layer can include it; builds without CUDA link stubs
// (kernels/cuda_stub/) that throw "[op] has no CUDA implementation in this build".
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/dtype.h"
#include "kernels/loop.h"

namespace quilt::kernels::cuda {

/// out = op(in) (logical_not gives bool).
void unary(UnaryOp op, DType dt, const Loop<2>& loop, void* stream);
/// out = op(a, b) (predicates give bool).
void binary(BinaryOp op, DType dt, const Loop<3>& loop, void* stream);
/// out = cond ? a : b.
void where(DType dt, const Loop<4>& loop, void* stream);
/// out = cast(in) on the device, any dtype pair, strided.
void copy(DType out_dt, DType in_dt, const Loop<2>& loop, void* stream);
/// out = value.
void fill(DType dt, double value, const Loop<1>& loop, void* stream);
/// Same numbers as the CPU kernels for the same (seed, key, index).
void random_uniform(DType dt, void* out, const RandomArgs& args, void* stream);
/// cpu::random_int's numbers, on the device: n contiguous elements in [low, high).
void random_int(DType dt, void* out, int64_t n, int64_t low, int64_t high, uint64_t seed, uint64_t key, void* stream);
void random_normal(DType dt, void* out, const RandomArgs& args, void* stream);
/// Reductions as on the CPU (ReduceLoop with device pointers).
void reduce(ReduceOp op, DType in_dt, DType out_dt, const ReduceLoop& loop, void* stream);
/// Batched GEMM through cuBLAS (f32, bf16, f16 with f32 accumulation; f64).
void gemm(DType dt, const GemmArgs& args, void* stream);
/// Row softmax / log-softmax over the last dim of a contiguous (rows, cols) block.
void softmax_forward(DType dt, void* out, const void* in, int64_t rows, int64_t cols, bool log, void* stream);
/// Gradient of (log-)softmax: gin = y * (g - sum(g*y)) or g - exp(y) * sum(g).
void softmax_backward(DType dt, void* grad_in, const void* grad_out, const void* out, int64_t rows,
                      int64_t cols, bool log, void* stream);
/// Per-row cross entropy: loss[r] = logsumexp(x[r]) - x[r][t[r]] (0 where t == ignore);
/// logits (rows, cols) contiguous, targets i64. A target outside [0, cols) gives NaN and is
/// reported on the device (DeviceError below).
void cross_entropy_forward(DType dt, float* loss, const void* logits, const int64_t* target, int64_t rows,
                           int64_t cols, int64_t ignore_index, void* stream);
/// grad_logits[r] = scale[r] * (softmax(x[r]) - onehot(t[r])) (0 rows where ignored);
/// `scale` is per-row (device f32).
void cross_entropy_backward(DType dt, void* grad_logits, const void* logits, const int64_t* target,
                            const float* scale, int64_t rows, int64_t cols, int64_t ignore_index, void* stream);

/// True when kernels were compiled into this build.
bool compiled();

/// cuBLAS is opened (dlopen) at the first GEMM on a GPU, not linked: a process that links it
/// loads cuBLAS and the cuBLASLt under it at start-up, about 0.2 s of CPU on an AVX2 EPYC (most
/// of a CPU test's start), GPU or not. Whether this process has opened it; and open it now from
/// `lib` (a soname or a path; empty: this build's libcublas.so.<CUDA major>), which throws naming
/// the library, or the entry point it lacks. Builds without CUDA: false, and the stub's error.
bool cublas_loaded();
void load_cublas(const std::string& lib = {});

/// Bad input a kernel finds on the device, where it cannot stop (an index or a target out of
/// range): it does what keeps memory safe (reads zero, skips, or writes NaN) and reports here.
/// The first report on a device since the last take_device_error() wins; the engine takes it at
/// its next synchronisation with that device and throws describe_device_error(). No host sync
/// happens inside the op.
enum class DeviceErrorOp : int32_t { none = 0, gather, scatter_add, index_select, index_add, embedding, cross_entropy };
struct DeviceError {
  int32_t op = 0;         // a DeviceErrorOp; 0: nothing reported
  int32_t reserved = 0;
  int64_t value = 0;      // the offending index or target
  int64_t bound = 0;      // it had to lie in [0, bound) (a target may also be ignore_index)
  int64_t position = 0;   // its element: the offset into the index tensor, or the target's row
};
/// The report slot of the current device (device memory, zeroed, made on first use), for a
/// kernel launch; marks the device as having a reporting kernel in flight.
DeviceError* device_error_slot();
/// The report of `device` since the last take (op 0 when none), cleared. Reads the device only
/// when a reporting kernel was launched there since the last take; call after a synchronisation.
DeviceError take_device_error(int device);
/// "[embedding] index 70000 (element 5 of the indices) is out of range for 32000 rows", ...
std::string describe_device_error(const DeviceError& e);

/// Where kernels get device scratch memory (reduction partials, GEMM pointer arrays, cuBLAS
/// workspaces): stream-ordered blocks, freed right after the kernels that use them are queued.
/// The engine installs its caching allocator; until then cudaMallocAsync is used.
using WorkspaceAlloc = void* (*)(size_t bytes, int device, void* stream);
using WorkspaceFree = void (*)(void* ptr, int device, void* stream);
void set_workspace_allocator(WorkspaceAlloc alloc, WorkspaceFree free);

}  // namespace quilt::kernels::cuda
