// Builds without CUDA link this: every CUDA MoE kernel entry point throws, naming the op.
#include <stdexcept>
#include <string>

#include "kernels/cuda/moe.h"

namespace quilt::kernels::cuda {
namespace {
[[noreturn]] void missing(const char* op) {
  throw std::runtime_error(std::string("[") + op + "] has no CUDA implementation in this build");
}
}  // namespace

void grouped_gemm(DType, const GroupedGemmArgs&, void*) { missing("grouped_mm"); }
void grouped_gemm_weight_grad(DType, const GroupedGemmWeightGradArgs&, void*) { missing("grouped_mm_weight_grad"); }
// The selection is plain state (no kernel behind it), so tests can set it in any build.
namespace {
GroupedGemmKernel selected = GroupedGemmKernel::mma;
}  // namespace
GroupedGemmKernel grouped_gemm_kernel() { return selected; }
void set_grouped_gemm_kernel(GroupedGemmKernel kernel) { selected = kernel; }
bool grouped_gemm_mma(DType, const GroupedGemmArgs&, void*) { missing("grouped_mm"); }
bool grouped_gemm_weight_grad_mma(DType, const GroupedGemmWeightGradArgs&, void*) {
  missing("grouped_mm_weight_grad");
}
void moe_route(const int64_t*, int64_t, int64_t, int64_t*, int64_t*, int64_t*, void*) { missing("moe_route"); }
void moe_invert_order(int64_t, const int64_t*, int64_t*, void*) { missing("moe_invert_order"); }
void moe_permute(DType, int64_t, int64_t, int64_t, const int64_t*, const void*, int64_t, const void*, void*, void*) {
  missing("moe_permute");
}
void moe_unpermute(DType, int64_t, int64_t, int64_t, const int64_t*, const void*, int64_t, const void*, void*, void*) {
  missing("moe_unpermute");
}
void moe_slot_dot(DType, int64_t, int64_t, int64_t, const int64_t*, const void*, int64_t, const void*, int64_t, void*,
                  void*) {
  missing("moe_slot_dot");
}

}  // namespace quilt::kernels::cuda
