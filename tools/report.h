// The start-up report rank 0 prints before the first step (the layout and the GEMM choice are
// printed while the run is built): where this rank runs, its parameter, gradient and optimizer
// bytes, and the peak memory the step is expected to reach.
//
//   log_startup_report(run);   // "launch: srun, rank 0 of 4, ..." and "memory per rank: ..."
#pragma once

#include <cstdint>

#include "tools/run.h"

namespace quilt {

/// Bytes one rank holds or needs, as log_startup_report estimates them.
struct MemoryEstimate {
  int64_t parameters = 0;   // this rank's master parameters (its shards under FSDP/TP)
  int64_t gradients = 0;    // their gradients, in the parameters' dtype
  int64_t optimizer = 0;    // AdamW's two f32 moments per parameter
  int64_t gathered = 0;     // FSDP: two units gathered whole at once (the current and the prefetched)
  int64_t activations = 0;  // what backward keeps for the micro-batches in flight, and the logits
  int64_t peak() const { return parameters + gradients + optimizer + gathered + activations; }
};

/// The estimate for this rank of `r` (see report.cpp for how each part is counted).
MemoryEstimate estimate_memory(const Run& r);

/// Prints (every rank, through log_line) the launch facts and the memory estimate.
void log_startup_report(const Run& r);

}  // namespace quilt
