// Fused (flash-style) scaled dot-product attention on CUDA: forward with the per-query
// log-sum-exp, and a backward that recomputes the probabilities from it. Same contract as the
// CPU kernels (kernels/cpu/attention.h, whose AttentionArgs it takes, with device pointers):
// GQA, causal by index or by position, document masks. No CUDA types here (streams are void*);
// builds without CUDA link kernels/cuda_stub/attention_stub.cpp, which throws. Two forward
// kernels: mma.sync (FlashAttention-2 style, the default since it passed every attention test
// on an H200 at 5-6x the WMMA kernel's rate) and WMMA (QUILT_CUDA_ATTENTION=wmma or
// set_attention_kernel). The backward has its own choice: WMMA, or an mma.sync backward in the
// same style (opt-in with QUILT_CUDA_ATTENTION_BWD=mma or set_attention_backward_kernel until
// it has passed on a GPU).
//
//   if (kernels::cuda::attention_supported(DType::bf16, 128, 128))
//     kernels::cuda::attention_forward(DType::bf16, args, out, lse, q, k, v, stream);
#pragma once

#include <cstdint>

#include "kernels/cpu/attention.h"
#include "kernels/dtype.h"

namespace quilt::kernels::cuda {

using AttentionArgs = cpu::AttentionArgs;

/// The forward or backward kernels for bf16/f16 calls. f32, and calls the mma.sync kernels do
/// not take (unaligned pointers), always run WMMA.
enum class AttentionKernel { wmma, mma };
/// The forward kernel in use: set_attention_kernel's choice, else wmma when the environment has
/// QUILT_CUDA_ATTENTION=wmma (read once), else mma.
AttentionKernel attention_kernel();
/// Chooses the forward kernel for the rest of the process (tests and benchmarks run both).
void set_attention_kernel(AttentionKernel k);
/// The backward kernels in use: set_attention_backward_kernel's choice, else mma when the
/// environment has QUILT_CUDA_ATTENTION_BWD=mma (read once), else wmma.
AttentionKernel attention_backward_kernel();
/// Chooses the backward kernels for the rest of the process (tests and benchmarks run both).
void set_attention_backward_kernel(AttentionKernel k);

/// True when the fused kernels take this call on the current device: f32, bf16 or f16, head
/// dims d == dv of 64 or 128, and the shared memory the kernels need is there.
bool attention_supported(DType dt, int64_t d, int64_t dv);
/// out (B, Hq, T, Dv) and lse (B, Hq, T, f32) as kernels::cpu::attention_forward, on device pointers.
void attention_forward(DType dt, const AttentionArgs& a, void* out, void* lse, const void* q, const void* k,
                       const void* v, void* stream);
/// dq, dk, dv as kernels::cpu::attention_backward (dlse may be null), on device pointers.
/// Deterministic: dK/dV and dQ are two passes, no atomics.
void attention_backward(DType dt, const AttentionArgs& a, void* dq, void* dk, void* dv, const void* dout,
                        const void* dlse, const void* q, const void* k, const void* v, const void* out,
                        const void* lse, void* stream);

}  // namespace quilt::kernels::cuda
