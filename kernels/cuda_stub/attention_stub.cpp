// Builds without CUDA link this: the fused attention kernels are never supported, and calling
// them throws, naming the op.
#include <stdexcept>
#include <string>

#include "kernels/cuda/attention.h"

namespace quilt::kernels::cuda {
namespace {
[[noreturn]] void missing(const char* op) {
  throw std::runtime_error(std::string("[") + op + "] has no CUDA implementation in this build");
}
}  // namespace

// The choice is kept (nothing runs it) so that code setting it builds and behaves alike.
namespace {
AttentionKernel g_kernel = AttentionKernel::mma;
AttentionKernel g_backward = AttentionKernel::wmma;
}  // namespace
AttentionKernel attention_kernel() { return g_kernel; }
void set_attention_kernel(AttentionKernel k) { g_kernel = k; }
AttentionKernel attention_backward_kernel() { return g_backward; }
void set_attention_backward_kernel(AttentionKernel k) { g_backward = k; }

bool attention_supported(DType, int64_t, int64_t) { return false; }
void attention_forward(DType, const AttentionArgs&, void*, void*, const void*, const void*, const void*, void*) {
  missing("scaled_dot_product_attention");
}
void attention_backward(DType, const AttentionArgs&, void*, void*, void*, const void*, const void*, const void*,
                        const void*, const void*, const void*, const void*, void*) {
  missing("scaled_dot_product_attention_backward");
}

}  // namespace quilt::kernels::cuda
