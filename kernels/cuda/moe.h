// CUDA kernels of the mixture-of-experts ops (engine/ops/moe.h): the grouped GEMM and its
// weight gradient, the routing sort, and the row permutation / weighted combine around them.
// No CUDA types here (streams are void*); builds without CUDA link kernels/cuda_stub/moe_stub.cpp,
// whose entry points throw "[op] has no CUDA implementation in this build".
//
//   kernels::GroupedGemmArgs g = ...;   // as for the CPU kernel, but every pointer (offsets too) on the device
//   kernels::cuda::grouped_gemm(DType::bf16, g, stream);
//
// Nothing here copies to the host or waits: expert offsets are read on the device by the
// kernels themselves. Inputs are trusted (the CPU path checks offsets and orders; here an
// offset outside [0, m] is clamped and an order entry outside [0, n) contributes zeros, so no
// access goes out of bounds, but no error is raised).
#pragma once

#include <cstdint>

#include "kernels/cpu/moe.h"  // GroupedGemmArgs, GroupedGemmWeightGradArgs
#include "kernels/dtype.h"

namespace quilt::kernels::cuda {

/// The grouped GEMM (see GroupedGemmArgs; args.offsets is a device pointer); f32, f64, bf16, f16.
/// bf16/f16 multiply on tensor cores with f32 accumulation; f32/f64 stay exact (no TF32).
void grouped_gemm(DType dt, const GroupedGemmArgs& args, void* stream);

/// The grouped weight gradient (see GroupedGemmWeightGradArgs; device offsets), zeros for empty groups.
void grouped_gemm_weight_grad(DType dt, const GroupedGemmWeightGradArgs& args, void* stream);

/// The bf16/f16 kernel family grouped_gemm and grouped_gemm_weight_grad run: `mma`
/// (grouped_gemm_mma.cu: mma.sync, ldmatrix, a 4-stage cp.async pipeline; the default since it
/// passed its tests on an H200 at 1.8x the WMMA kernel's rate) or `wmma` (grouped_gemm.cu).
/// Shapes `mma` cannot take fall back to wmma.
enum class GroupedGemmKernel { wmma, mma };

/// The selected kernel: the last set_grouped_gemm_kernel, else QUILT_CUDA_GROUPED_GEMM ("wmma" or
/// "mma", read once; another value throws), else mma.
GroupedGemmKernel grouped_gemm_kernel();

/// Selects the kernel for every later call in this process (tests and benchmarks switch with it).
void set_grouped_gemm_kernel(GroupedGemmKernel kernel);

/// grouped_gemm on the mma kernel when it takes the arguments (bf16/f16, x row-major, K, N, leading
/// dims and w's group stride multiples of 8, 16-byte aligned pointers): returns false, launching nothing, otherwise.
bool grouped_gemm_mma(DType dt, const GroupedGemmArgs& args, void* stream);

/// grouped_gemm_weight_grad on the mma kernel under the same conditions (x and dy row-major), else false.
bool grouped_gemm_weight_grad_mma(DType dt, const GroupedGemmWeightGradArgs& args, void* stream);

/// Routing of n = T*k slots, expert_idx (n) i64 on the device: counts (E) rows per expert,
/// offsets (E) their cumulative sums, order (n) the slots stably sorted by expert. A slot whose
/// expert is outside [0, E) is not counted and sorts last (the caller checks sum(counts) == n).
void moe_route(const int64_t* expert_idx, int64_t n, int64_t num_experts, int64_t* order, int64_t* counts,
               int64_t* offsets, void* stream);

/// slot_row[order[p]] = p for p < n; entries no p names stay -1.
void moe_invert_order(int64_t n, const int64_t* order, int64_t* slot_row, void* stream);

/// out[p] = w[order[p]] * x[order[p] / k] for p < n, as kernels::cpu::moe_permute.
void moe_permute(DType dt, int64_t n, int64_t h, int64_t k, const int64_t* order, const void* x, int64_t ldx,
                 const void* w, void* out, void* stream);

/// out[t] = sum_{j < k} w[t*k+j] * y[slot_row[t*k+j]], summed in order j (a gather, no atomics:
/// the same bits every run), as kernels::cpu::moe_unpermute.
void moe_unpermute(DType dt, int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const void* y,
                   int64_t ldy, const void* w, void* out, void* stream);

/// d[s] = dot(a[s / k], b[slot_row[s]]) for s < tokens * k, in a fixed order, as kernels::cpu::moe_slot_dot.
void moe_slot_dot(DType dt, int64_t tokens, int64_t h, int64_t k, const int64_t* slot_row, const void* a,
                  int64_t lda, const void* b, int64_t ldb, void* d, void* stream);

}  // namespace quilt::kernels::cuda
