// Internal to kernels/cpu: row-major Eigen views of strided matrices, for the GEMM kernels.
#pragma once

#include <Eigen/Core>

namespace quilt::kernels::cpu {

template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
/// A read-only (rows, cols) view with a row stride.
template <class T>
using CMap = Eigen::Map<const RowMat<T>, 0, Eigen::OuterStride<>>;
/// A writable (rows, cols) view with a row stride.
template <class T>
using MMap = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;

}  // namespace quilt::kernels::cpu
