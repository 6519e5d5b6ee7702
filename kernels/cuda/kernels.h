// CUDA kernels and runtime calls on raw device pointers. This header has no CUDA types
// (streams are void*), so every layer can include it; builds without CUDA link stubs
// (kernels/cuda_stub/) that throw "[op] has no CUDA implementation in this build".
#pragma once

#include <cstddef>
#include <cstdint>

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
/// logits (rows, cols) contiguous, targets i64.
void cross_entropy_forward(DType dt, float* loss, const void* logits, const int64_t* target, int64_t rows,
                           int64_t cols, int64_t ignore_index, void* stream);
/// grad_logits[r] = scale[r] * (softmax(x[r]) - onehot(t[r])) (0 rows where ignored);
/// `scale` is per-row (device f32).
void cross_entropy_backward(DType dt, void* grad_logits, const void* logits, const int64_t* target,
                            const float* scale, int64_t rows, int64_t cols, int64_t ignore_index, void* stream);

/// True when kernels were compiled into this build.
bool compiled();

/// Where kernels get device scratch memory (reduction partials, GEMM pointer arrays, cuBLAS
/// workspaces): stream-ordered blocks, freed right after the kernels that use them are queued.
/// The engine installs its caching allocator; until then cudaMallocAsync is used.
using WorkspaceAlloc = void* (*)(size_t bytes, int device, void* stream);
using WorkspaceFree = void (*)(void* ptr, int device, void* stream);
void set_workspace_allocator(WorkspaceAlloc alloc, WorkspaceFree free);

}  // namespace quilt::kernels::cuda
