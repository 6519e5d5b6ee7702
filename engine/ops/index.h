// Indexing, joining and ordering ops.
//
//   auto [vals, idx] = topk(scores, 2);          Tensor y = cat({a, b}, 1);
#pragma once

#include <utility>
#include <vector>

#include "engine/tensor.h"

namespace quilt {

/// out[i][j] = x[i][index[i][j]] along `dim` (index same rank as x).
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
/// x with src added at positions index along `dim` (out of place).
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
/// Slices of x along `dim` picked by a 1-D integer index.
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
/// x with src's slices added at rows index along `dim` (out of place; duplicates accumulate).
Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
Tensor cat(const std::vector<Tensor>& xs, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& xs, int64_t dim = 0);
/// Pieces of size `size` along `dim` (the last may be smaller); views.
std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim = 0);
/// Pieces of the given sizes along `dim`; views.
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim = 0);
/// `chunks` near-equal pieces along `dim` (as torch.chunk: ceil-sized, possibly fewer); views.
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
/// The k largest (or smallest) along `dim`, sorted; values and i64 indices.
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true);
/// Stable sort along `dim`; values and i64 indices.
std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim = -1, bool descending = false);
Tensor argsort(const Tensor& x, int64_t dim = -1, bool descending = false);
Tensor cumsum(const Tensor& x, int64_t dim);
/// (…, num_classes) of `dtype` from integer indices.
Tensor one_hot(const Tensor& indices, int64_t num_classes, DType dtype = DType::i64);

}  // namespace quilt
