// Factories: filled, ranged and random tensors. Random ones draw from Philox keyed by
// (seed, key, global index) — see engine/random.h.
//
//   Tensor x = randn({4, 8}, RngKey(7, "x"), {.dtype = DType::f64});
//   Tensor i = arange(0, 10);                      // i64
#pragma once

#include <vector>

#include "engine/random.h"
#include "engine/tensor.h"

namespace quilt {

Tensor empty(const Shape& shape, TensorOptions opts = {});
Tensor zeros(const Shape& shape, TensorOptions opts = {});
Tensor ones(const Shape& shape, TensorOptions opts = {});
Tensor full(const Shape& shape, double value, TensorOptions opts = {});
/// A 0-d tensor holding `value`.
Tensor scalar_tensor(double value, TensorOptions opts = {});
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
Tensor empty_like(const Tensor& t);
/// start, start+step, ... < end; i64 unless opts say otherwise.
Tensor arange(double start, double end, double step = 1, TensorOptions opts = {.dtype = DType::i64});
/// A tensor from row-major values (converted to opts.dtype).
Tensor from_vector(const std::vector<double>& values, const Shape& shape, TensorOptions opts = {});

/// Where a local block sits inside a larger (global) tensor, so random values depend on the
/// global index: a shard draws exactly the numbers the full tensor has at its positions.
struct GlobalView {
  Shape global_shape;  // empty: the tensor is its own global tensor
  Shape offsets;       // start of the block in each dim
};

/// Uniform on [low, high).
Tensor rand(const Shape& shape, RngKey key, TensorOptions opts = {}, double low = 0, double high = 1,
            const GlobalView& view = {});
/// Normal with mean and std (Box-Muller on Philox pairs).
Tensor randn(const Shape& shape, RngKey key, TensorOptions opts = {}, double mean = 0, double std = 1,
             const GlobalView& view = {});
/// Integers uniform in [low, high).
Tensor randint(int64_t low, int64_t high, const Shape& shape, RngKey key,
               TensorOptions opts = {.dtype = DType::i64});

}  // namespace quilt
