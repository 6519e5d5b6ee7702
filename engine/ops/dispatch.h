// Internal to engine/ops: turning tensors into kernel loop descriptors and picking the
// device's kernel.
#pragma once

#include <array>
#include <optional>

#include "engine/tensor.h"
#include "kernels/loop.h"

namespace quilt::ops {

/// t's strides viewed at `shape` (t broadcasts to it): 0 on broadcast dims.
Shape broadcast_strides(const Tensor& t, const Shape& shape);

/// True when shape `s` broadcasts to exactly `target` (NumPy rules, never growing target).
bool broadcasts_to(const Shape& s, const Shape& target);

/// A coalesced loop over `shape` with operands ts (each broadcastable to shape).
template <int N>
kernels::Loop<N> loop_over(const Shape& shape, const std::array<const Tensor*, N>& ts) {
  QUILT_CHECK(shape.size() <= size_t(kernels::kMaxDims), "[loop] tensors of more than ",
              kernels::kMaxDims, " dims are not supported, got shape ", shape);
  std::array<Shape, N> st;
  const int64_t* sp[N];
  void* data[N];
  for (int k = 0; k < N; ++k) {
    st[k] = broadcast_strides(*ts[k], shape);
    sp[k] = st[k].data();
    data[k] = ts[k]->data_ptr();
  }
  return kernels::make_loop<N>(static_cast<int>(shape.size()), shape.data(), sp, data);
}

/// How a (rows, cols) matrix view maps to a row-major GEMM operand: as it is with leading dim
/// `ld`, or transposed when its rows are adjacent in memory (a transposed view needs no copy).
struct GemmOperand {
  bool trans = false;
  int64_t ld = 0;
};
/// The operand a (rows, cols) view with strides (rs, cs) is, or none when neither layout fits.
std::optional<GemmOperand> gemm_operand_of(int64_t rows, int64_t cols, int64_t rs, int64_t cs);
/// The last two dims of t as a GEMM operand; t is replaced by a contiguous copy when its strides
/// allow neither layout.
GemmOperand gemm_operand(Tensor& t);

/// The device stream handle for kernels (nullptr on the CPU).
void* stream_handle(Device d);

}  // namespace quilt::ops
