// Indexing, joining and ordering ops.
//
//   auto [vals, idx] = topk(scores, 2);          Tensor y = cat({a, b}, 1);
//   Tensor rows = index_select(table, 0, ids);   Tensor g = scatter_add(zeros_like(x), 1, idx, src);
//
// Conventions shared by the whole family:
//  - Index tensors are i32 or i64. An index outside [0, size of the indexed dim) throws an
//    Error naming the op, the offending value and the size (negative indices do not wrap).
//  - dims may be negative (counted from the end); a 0-d tensor counts as one element along
//    dim 0 / -1 for gather, scatter_add, sort, topk and cumsum.
//  - Ordering ops rank NaN above every number: last in an ascending sort, first in a
//    descending one and in topk(largest=true). Ties keep their original order (stable sort;
//    topk takes the lower position first), so results are deterministic.
//  - gather, scatter_add, index_select, index_add, sort, topk and cumsum have CPU kernels
//    only for now; a CUDA input throws "[op] has no CUDA implementation in this build".
//    cat, stack, split, chunk and one_hot are made of ops with device support of their own.
#pragma once

#include <utility>
#include <vector>

#include "engine/tensor.h"

namespace quilt {

/// out[i][j] = x[i][index[i][j]] along `dim` (for dim 1 of a matrix). index has x's rank,
/// and no dim of it but `dim` may be larger than x's; out has index's shape.
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
/// A copy of x with out[i][index[i][j]] += src[i][j] along `dim`; src has index's shape,
/// duplicate indices accumulate. x and src are promoted to a common dtype (not bool).
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
/// Slices of x along `dim` picked by a 0-d or 1-D integer index (dim's size becomes its length).
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
/// A copy of x with src's slices along `dim` added at the slices index names (duplicates
/// accumulate); src is x's shape with dim's size = index length. dtypes promote as in scatter_add.
Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
/// Concatenation along `dim`. All tensors have the same rank (>= 1) and equal sizes outside
/// `dim`; pieces empty along `dim` are fine. Mixed dtypes promote as binary ops do
/// (promote_types), and each gradient comes back in its input's dtype.
Tensor cat(const std::vector<Tensor>& xs, int64_t dim = 0);
/// Tensors of one shape joined along a new dim `dim` (unsqueeze + cat; dtypes promote as in cat).
Tensor stack(const std::vector<Tensor>& xs, int64_t dim = 0);
/// Pieces of size `size` along `dim` (the last may be smaller; one empty piece for an empty
/// dim); views.
std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim = 0);
/// Pieces of the given sizes (which must add up to dim's size) along `dim`; views.
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim = 0);
/// `chunks` near-equal pieces along `dim` (as torch.chunk: ceil-sized, possibly fewer;
/// exactly `chunks` empty pieces for an empty dim); views.
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
/// The k largest (or smallest) along `dim`, sorted (largest first when `largest`); values
/// and i64 positions. Equal values: lower position first; NaN counts as the largest.
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true);
/// Stable sort along `dim`; values and i64 positions. NaN sorts as the largest value.
std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim = -1, bool descending = false);
/// The i64 positions that sort x along `dim` (stable; sort()'s second output).
Tensor argsort(const Tensor& x, int64_t dim = -1, bool descending = false);
/// Running sum along `dim`; floating inputs keep their dtype, integer and bool ones give i64.
Tensor cumsum(const Tensor& x, int64_t dim);
/// indices.shape + (num_classes) of `dtype`: 1 where the last coordinate equals the index.
/// num_classes = -1 takes max(indices) + 1.
Tensor one_hot(const Tensor& indices, int64_t num_classes, DType dtype = DType::i64);

}  // namespace quilt
