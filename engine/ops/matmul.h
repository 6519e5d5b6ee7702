// Matrix products: 1-D, 2-D and batched with broadcast batch dims (NumPy matmul rules).
// Eigen/BLAS on the CPU, cuBLAS(Lt) on CUDA.
//
//   Tensor y = matmul(x, w.transpose(0, 1));   // (B, T, C) @ (C, D) -> (B, T, D)
#pragma once

#include "engine/tensor.h"

namespace quilt {

Tensor matmul(const Tensor& a, const Tensor& b);
/// x @ w^T + bias (w is (out, in) as nn.Linear stores it; bias may be undefined).
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias = {});

}  // namespace quilt
