// Builds without CUDA link this: every CUDA kernel entry point throws, naming the op.
#include <stdexcept>
#include <string>

#include "kernels/cuda/kernels.h"

namespace quilt::kernels::cuda {
namespace {
[[noreturn]] void missing(const char* op) {
  throw std::runtime_error(std::string("[") + op + "] has no CUDA implementation in this build");
}
}  // namespace

void unary(UnaryOp, DType, const Loop<2>&, void*) { missing("unary"); }
void binary(BinaryOp, DType, const Loop<3>&, void*) { missing("binary"); }
void where(DType, const Loop<4>&, void*) { missing("where"); }
void copy(DType, DType, const Loop<2>&, void*) { missing("copy"); }
void fill(DType, double, const Loop<1>&, void*) { missing("fill"); }
void random_uniform(DType, void*, const RandomArgs&, void*) { missing("rand"); }
void random_normal(DType, void*, const RandomArgs&, void*) { missing("randn"); }
void random_int(DType, void*, int64_t, int64_t, int64_t, uint64_t, uint64_t, void*) { missing("randint"); }
void reduce(ReduceOp, DType, DType, const ReduceLoop&, void*) { missing("reduce"); }
void gemm(DType, const GemmArgs&, void*) { missing("matmul"); }
void softmax_forward(DType, void*, const void*, int64_t, int64_t, bool, void*) { missing("softmax"); }
void softmax_backward(DType, void*, const void*, const void*, int64_t, int64_t, bool, void*) {
  missing("softmax_backward");
}
void cross_entropy_forward(DType, float*, const void*, const int64_t*, int64_t, int64_t, int64_t, void*) {
  missing("cross_entropy");
}
void cross_entropy_backward(DType, void*, const void*, const int64_t*, const float*, int64_t, int64_t, int64_t,
                            void*) {
  missing("cross_entropy_backward");
}
bool compiled() { return false; }
bool cublas_loaded() { return false; }
void load_cublas(const std::string&) { missing("cuBLAS"); }
DeviceError* device_error_slot() { missing("device errors"); }
DeviceError take_device_error(int) { return {}; }  // no device, so nothing was reported
std::string describe_device_error(const DeviceError&) { return ""; }

}  // namespace quilt::kernels::cuda
