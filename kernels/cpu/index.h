// CPU kernels for the indexing and ordering ops: gather / scatter-add (which also serve
// index_select / index_add through a stride-0 index), sort, top-k, cumulative sum, and the
// min/max of an index tensor that the engine uses to reject out-of-range indices.
//
//   kernels::IndexLoop l = ...;              // built by engine/ops/index.cpp
//   kernels::cpu::gather(DType::f32, DType::i64, l);
//
// The loop descriptors below hold nothing CPU-specific; a CUDA port can move them to
// kernels/loop.h unchanged.
#pragma once

#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/loop.h"

namespace quilt::kernels {

/// A walk over the positions of an index tensor. Operands, in order: `self` (the tensor
/// that is indexed: gather's source, scatter's target), `index` (i32/i64), `other`
/// (gather's output, scatter's source). In `loop`, self's stride along the indexed dim is 0;
/// each element adds index_value * self_dim_stride to it instead.
struct IndexLoop {
  Loop<3> loop;                 // gather: every dim of index; scatter: every dim but `dim`
  int64_t self_dim_stride = 0;  // self's stride along the indexed dim
  // scatter only: the indexed dim is kept out of `loop` and walked in order, so that every
  // target element is updated by one thread, in index order (deterministic, race-free).
  int64_t n = 1;                 // index's size along dim
  int64_t index_dim_stride = 0;  // along dim
  int64_t other_dim_stride = 0;  // along dim
};

/// A walk over "rows": every position of the dims other than `dim`, each row running `n`
/// elements along `dim`. Operands, in order: out0, out1 (may be null), in.
struct RowLoop {
  Loop<3> rows;                 // the other dims, coalesced
  int64_t n = 0;                // in's size along dim
  int64_t k = 0;                // outputs per row along dim (top-k's k; n otherwise)
  int64_t dim_strides[3] = {};  // per operand, along dim
};

}  // namespace quilt::kernels

namespace quilt::kernels::cpu {

/// Smallest and largest value of an i32/i64 tensor walked by `loop`; false if it is empty.
bool index_range(DType index_dt, const Loop<1>& loop, int64_t* lo, int64_t* hi);

/// other[p] = self[p with dim := index[p]] for every position p of index. Indices must be
/// in range (the engine checks); any dtype.
void gather(DType dt, DType index_dt, const IndexLoop& l);

/// self[p with dim := index[p]] += other[p]. Threads split the non-indexed positions, so
/// duplicate indices accumulate correctly and in index order. Numeric dtypes (not bool).
void scatter_add(DType dt, DType index_dt, const IndexLoop& l);

/// Sorts each row: out0 = values (dtype `dt`), out1 = i64 positions in the row. Ties keep
/// their original order (stable); NaN ranks above every number (last ascending, first
/// descending). With l.k < l.n only the first k of the sorted row are written (top-k).
void sort(DType dt, const RowLoop& l, bool descending);

/// out0 = running sum of `in` along each row (from the end when `reverse`); out1 unused.
/// out_dt is in_dt for floating inputs and i64 for integer/bool ones. Accumulates in
/// float for 16-bit floats.
void cumsum(DType in_dt, DType out_dt, const RowLoop& l, bool reverse);

}  // namespace quilt::kernels::cpu
