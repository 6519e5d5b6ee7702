// CUDA kernels of the norm, embedding, indexing/ordering and optimizer ops, on raw device
// pointers. Like kernels/cuda/kernels.h this header has no CUDA types (streams are void*);
// builds without CUDA link kernels/cuda_stub/nn_stub.cpp, whose entry points throw
// "[op] has no CUDA implementation in this build". Semantics match the CPU kernels of
// kernels/cpu/{nn,index,optim}.h; per-row statistics are compute_t<T> (f32 for f32/bf16/f16
// data, f64 for f64).
//
//   kernels::cuda::rms_norm_forward(DType::bf16, y, rstd, x, w, rows, cols, 1e-6, stream);
#pragma once

#include <cstdint>
#include <span>

#include "kernels/cpu/index.h"  // IndexLoop, RowLoop: plain descriptors, nothing CPU-specific
#include "kernels/cpu/optim.h"  // AdamWTensor, SgdHyper
#include "kernels/cuda/kernels.h"  // DeviceErrorOp
#include "kernels/dtype.h"

namespace quilt::kernels::cuda {

// ---- norms (kernels/cuda/nn.cu) ----

/// y (rows, cols) = x * rstd * weight, rstd (rows) = 1 / sqrt(mean(x^2) + eps); weight (cols)
/// may be null. x, y, weight contiguous of `dt`; rstd of the stat dtype.
void rms_norm_forward(DType dt, void* y, void* rstd, const void* x, const void* weight, int64_t rows, int64_t cols,
                      double eps, void* stream);
/// grad_x (rows, cols) and grad_weight (cols; null: not wanted) of rms_norm. grad_weight sums
/// rows in a fixed order (per-block partials, then blocks in order): deterministic.
void rms_norm_backward(DType dt, void* grad_x, void* grad_weight, const void* g, const void* x, const void* weight,
                       const void* rstd, int64_t rows, int64_t cols, void* stream);
/// y = (x - mean) * rstd * weight + bias per row (biased variance); writes mean and rstd
/// (rows, stat dtype); weight and bias (cols) may be null.
void layer_norm_forward(DType dt, void* y, void* mean, void* rstd, const void* x, const void* weight,
                        const void* bias, int64_t rows, int64_t cols, double eps, void* stream);
/// grad_x (rows, cols), grad_weight and grad_bias (cols; null: not wanted) of layer_norm;
/// deterministic like rms_norm_backward.
void layer_norm_backward(DType dt, void* grad_x, void* grad_weight, void* grad_bias, const void* g, const void* x,
                         const void* weight, const void* mean, const void* rstd, int64_t rows, int64_t cols,
                         void* stream);

// ---- embedding (kernels/cuda/nn.cu) ----

/// out (n, dim) = weight[index[i]] rows; weight (vocab, dim); index (n) of `index_dt` (i32/i64).
/// A row whose index is outside [0, vocab) is written as zeros and the index is reported on the
/// device (kernels.h's DeviceError; no host sync here).
void embedding_forward(DType dt, void* out, const void* weight, DType index_dt, const void* index, int64_t n,
                       int64_t vocab, int64_t dim, void* stream);
/// grad_weight (vocab, dim) = sum over i with index[i] == v of grad_out[i] (n, dim), zero rows
/// elsewhere. Deterministic: positions are stably sorted by index, then each row sums its
/// positions in order in f32 (f64). Out-of-range indices are skipped.
void embedding_backward(DType dt, void* grad_weight, const void* grad_out, DType index_dt, const void* index,
                        int64_t n, int64_t vocab, int64_t dim, void* stream);

// ---- indexing and ordering (kernels/cuda/index.cu) ----

/// other[p] = self[p with dim := index[p]] (IndexLoop as on the CPU, device pointers). An
/// index outside [0, dim_size) reads zero and, unless `report_as` is none, is reported on the
/// device under that op's name (kernels.h's DeviceError).
void gather(DType dt, DType index_dt, const IndexLoop& l, int64_t dim_size, DeviceErrorOp report_as, void* stream);
/// self[p with dim := index[p]] += other[p]; each target element is owned by one thread that
/// walks the indexed dim in order, so duplicates accumulate deterministically. Out-of-range
/// indices are skipped and reported like gather's.
void scatter_add(DType dt, DType index_dt, const IndexLoop& l, int64_t dim_size, DeviceErrorOp report_as,
                 void* stream);
/// Stable sort of each row (NaN last ascending, first descending), first l.k written (top-k);
/// out0 values, out1 i64 positions. Rows of at most kSortMaxRow elements.
void sort(DType dt, const RowLoop& l, bool descending, void* stream);
/// Longest row sort() takes (one block sorts a row in shared memory).
inline constexpr int64_t kSortMaxRow = 4096;
/// out0 = running sum of in along each row (from the end when `reverse`); as cpu::cumsum.
void cumsum(DType in_dt, DType out_dt, const RowLoop& l, bool reverse, void* stream);

// ---- optimizers (kernels/cuda/optim.cu) ----

/// Where a multi-tensor step keeps its tensor table across steps (a CUDA graph's step): `host`
/// (pinned) is written on the host and copied to `device` inside the step, so a graph that
/// captured the copy reads what was staged last (*_stage). `bytes`: the room in each.
struct StagedTable {
  void* host = nullptr;
  void* device = nullptr;
  size_t bytes = 0;
};
/// How a multi-tensor step runs. `skip`: a device bool (or null) that, when true, leaves every
/// tensor untouched (a non-finite step decided on the device); `table`: a staged table (or
/// null: a stream-ordered workspace buffer per launch). Outside a capture, a staged step first
/// waits for the stream, since an earlier step's copy may still read the host side.
struct OptimLaunch {
  const bool* skip = nullptr;
  StagedTable* table = nullptr;
};

/// One tensor of a multi-tensor AdamW step: the CPU kernel's descriptor, with device pointers.
using AdamWTensor = cpu::AdamWTensor;
/// cpu::adamw on every tensor of the list, all on the current device: one launch per dtype
/// combination, each block updating one chunk of one tensor.
void adamw_multi(std::span<const AdamWTensor> tensors, void* stream, const OptimLaunch& launch = {});
/// The bytes of adamw_multi's tables for `tensors`, as a StagedTable lays them out.
size_t adamw_table_bytes(std::span<const AdamWTensor> tensors);
/// Writes adamw_multi's tables for `tensors` into table.host only (no copy, no launch): the
/// hyperparameters of the next replay of a captured step. Nothing reading it may be in flight.
void adamw_stage(std::span<const AdamWTensor> tensors, const StagedTable& table);

/// One tensor of a multi-tensor SGD step (buf null without momentum).
struct SgdTensor {
  DType param_dt = DType::f32, grad_dt = DType::f32, state_dt = DType::f32;
  void* param = nullptr;
  const void* grad = nullptr;
  void* buf = nullptr;
  int64_t n = 0;
  cpu::SgdHyper hyper;
};
/// cpu::sgd on every tensor of the list, launched like adamw_multi.
void sgd_multi(std::span<const SgdTensor> tensors, void* stream, const OptimLaunch& launch = {});
/// As adamw_table_bytes / adamw_stage, for SGD.
size_t sgd_table_bytes(std::span<const SgdTensor> tensors);
void sgd_stage(std::span<const SgdTensor> tensors, const StagedTable& table);

}  // namespace quilt::kernels::cuda
