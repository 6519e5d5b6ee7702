// Strided N-operand loop descriptors shared by the CPU and CUDA kernels. Operand 0 is the
// output; strides are in elements and 0 on broadcast dims. make_loop() drops size-1 dims and
// merges dims that are contiguous for every operand, so most loops become one flat run.
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/host_device.h"

namespace quilt::kernels {

inline constexpr int kMaxDims = 16;

/// Elements of a shape: the product of shape[0, ndim) (1 for ndim 0).
constexpr int64_t shape_numel(int ndim, const int64_t* shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

template <int N>
struct Loop {
  int ndim = 0;                      // after coalescing; 0 means one element
  int64_t shape[kMaxDims] = {};      // outermost first
  int64_t strides[N][kMaxDims] = {};
  void* data[N] = {};
  int64_t numel() const { return shape_numel(ndim, shape); }
  /// True when every operand is a flat run of stride 1 (or there is at most one element).
  bool contiguous() const {
    if (ndim == 0) return true;
    if (ndim != 1) return false;
    for (int k = 0; k < N; ++k)
      if (strides[k][0] != 1) return false;
    return true;
  }
};

/// Builds a coalesced loop over `shape` (ndim dims) with per-operand strides.
template <int N>
Loop<N> make_loop(int ndim, const int64_t* shape, const int64_t* const strides[N], void* const data[N]) {
  Loop<N> l;
  for (int k = 0; k < N; ++k) l.data[k] = data[k];
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] == 1) continue;
    if (shape[d] == 0) {  // empty: a single dim of size 0
      l.ndim = 1;
      l.shape[0] = 0;
      for (int k = 0; k < N; ++k) l.strides[k][0] = 1;
      return l;
    }
    bool merge = l.ndim > 0;
    for (int k = 0; k < N && merge; ++k)
      merge = l.strides[k][l.ndim - 1] == strides[k][d] * shape[d];
    if (merge) {
      l.shape[l.ndim - 1] *= shape[d];
      for (int k = 0; k < N; ++k) l.strides[k][l.ndim - 1] = strides[k][d];
    } else {
      l.shape[l.ndim] = shape[d];
      for (int k = 0; k < N; ++k) l.strides[k][l.ndim] = strides[k][d];
      ++l.ndim;
    }
  }
  return l;
}

enum class UnaryOp : uint8_t {
  neg, exp, log, sqrt, rsqrt, tanh, sigmoid, silu, gelu, relu, abs, sign, sin, cos, square,
  logical_not, gelu_grad
};
enum class BinaryOp : uint8_t {
  add, sub, mul, div, pow, maximum, minimum, eq, ne, lt, le, gt, ge, logical_and, logical_or
};
/// The op's name as users see it ("exp", "add", ...): errors from every layer use these.
constexpr const char* op_name(UnaryOp op) {
  constexpr const char* names[] = {"neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "gelu", "relu",
                                   "abs", "sign", "sin", "cos", "square", "logical_not", "gelu_grad"};
  return names[static_cast<int>(op)];
}
constexpr const char* op_name(BinaryOp op) {
  constexpr const char* names[] = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq",
                                   "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or"};
  return names[static_cast<int>(op)];
}
static_assert(std::string_view(op_name(UnaryOp::gelu_grad)) == "gelu_grad", "op_name table out of step with UnaryOp");
static_assert(std::string_view(op_name(BinaryOp::logical_or)) == "logical_or", "op_name table out of step with BinaryOp");
/// True for ops whose result is bool.
constexpr bool is_predicate(BinaryOp op) {
  return op == BinaryOp::eq || op == BinaryOp::ne || op == BinaryOp::lt || op == BinaryOp::le ||
         op == BinaryOp::gt || op == BinaryOp::ge || op == BinaryOp::logical_and ||
         op == BinaryOp::logical_or;
}

enum class ReduceOp : uint8_t { sum, max, min, argmax, sum_squares };

/// A reduction: output dims (kept) and reduced dims, with input strides for both.
struct ReduceLoop {
  int out_ndim = 0;
  int64_t out_shape[kMaxDims] = {};
  int64_t out_strides[kMaxDims] = {};
  int64_t in_out_strides[kMaxDims] = {};  // input strides along the kept dims
  int red_ndim = 0;
  int64_t red_shape[kMaxDims] = {};
  int64_t red_strides[kMaxDims] = {};     // input strides along the reduced dims
  void* out = nullptr;
  const void* in = nullptr;
};

/// Row-major GEMM batch: C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b].
/// op(X) is X or X^T; each matrix is row-major with its leading dimension.
struct GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
  int64_t batch = 1;
  const int64_t* a_offsets = nullptr;  // per batch, in elements (null: all 0)
  const int64_t* b_offsets = nullptr;
  const int64_t* c_offsets = nullptr;
};

/// Random fill of a contiguous block that sits at `offsets` inside a tensor of `global_strides`.
struct RandomArgs {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t global_strides[kMaxDims] = {};
  int64_t offsets[kMaxDims] = {};
  uint64_t seed = 0, key = 0;
  double a = 0, b = 1;  // uniform: [a, b); normal: mean a, std b
  int64_t numel() const { return shape_numel(ndim, shape); }
  /// Linear index in the whole tensor of the block's element i (row-major within the block).
  QUILT_HD uint64_t global_index(int64_t i) const {
    uint64_t g = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t idx = i % shape[d];
      i /= shape[d];
      g += static_cast<uint64_t>(idx + offsets[d]) * static_cast<uint64_t>(global_strides[d]);
    }
    return g;
  }
};

}  // namespace quilt::kernels
