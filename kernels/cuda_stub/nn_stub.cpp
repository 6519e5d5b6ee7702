// Builds without CUDA link this: every entry point of kernels/cuda/nn.h throws, naming the op.
#include <stdexcept>
#include <string>

#include "kernels/cuda/nn.h"

namespace quilt::kernels::cuda {
namespace {
[[noreturn]] void missing(const char* op) {
  throw std::runtime_error(std::string("[") + op + "] has no CUDA implementation in this build");
}
}  // namespace

void rms_norm_forward(DType, void*, void*, const void*, const void*, int64_t, int64_t, double, void*) {
  missing("rms_norm");
}
void rms_norm_backward(DType, void*, void*, const void*, const void*, const void*, const void*, int64_t, int64_t,
                       void*) {
  missing("rms_norm_backward");
}
void layer_norm_forward(DType, void*, void*, void*, const void*, const void*, const void*, int64_t, int64_t, double,
                        void*) {
  missing("layer_norm");
}
void layer_norm_backward(DType, void*, void*, void*, const void*, const void*, const void*, const void*, const void*,
                         int64_t, int64_t, void*) {
  missing("layer_norm_backward");
}
void embedding_forward(DType, void*, const void*, DType, const void*, int64_t, int64_t, int64_t, void*) {
  missing("embedding");
}
void embedding_backward(DType, void*, const void*, DType, const void*, int64_t, int64_t, int64_t, void*) {
  missing("embedding_backward");
}
void gather(DType, DType, const IndexLoop&, int64_t, DeviceErrorOp, void*) { missing("gather"); }
void scatter_add(DType, DType, const IndexLoop&, int64_t, DeviceErrorOp, void*) { missing("scatter_add"); }
void sort(DType, const RowLoop&, bool, void*) { missing("sort"); }
void cumsum(DType, DType, const RowLoop&, bool, void*) { missing("cumsum"); }
void adamw_multi(std::span<const AdamWTensor>, void*, const OptimLaunch&) { missing("adamw"); }
size_t adamw_table_bytes(std::span<const AdamWTensor>) { missing("adamw"); }
void adamw_stage(std::span<const AdamWTensor>, const StagedTable&) { missing("adamw"); }
void sgd_multi(std::span<const SgdTensor>, void*, const OptimLaunch&) { missing("sgd"); }
size_t sgd_table_bytes(std::span<const SgdTensor>) { missing("sgd"); }
void sgd_stage(std::span<const SgdTensor>, const StagedTable&) { missing("sgd"); }

}  // namespace quilt::kernels::cuda
