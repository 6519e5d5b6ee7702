// logging.trace's files: one step's slices (engine/trace.h: ops with shapes, collectives with
// bytes and mesh axis, FSDP gathers and reduce-scatters, data loading, optimizer; plus pipeline
// actions under pp) as Chrome/Perfetto trace JSON, one file per rank and one merged by rank 0
// with one process per rank. Collective: every rank calls it for the same step.
//
//   trace::set_enabled(true);  ... the step ...  trace::set_enabled(false);
//   write_step_trace(run, step, trace::take(), pipeline_spans_or_null);
//   // logging.dir/trace_step2_rank0.json ... and logging.dir/trace_step2.json
#pragma once

#include <cstdint>
#include <vector>

#include "engine/trace.h"
#include "parallel/pipeline/runtime.h"
#include "tools/run.h"

namespace quilt {

/// Writes the step's trace files under logging.dir and logs where (with the pipeline's idle
/// share when `pipeline` holds the runner's spans).
void write_step_trace(Run& r, int64_t step, const std::vector<trace::Event>& events,
                      const std::vector<pipeline::Span>* pipeline);

}  // namespace quilt
