// Mixed precision as a policy on a module tree: parameters stay in their (f32) master dtype and
// are cast to `param_dtype` for each forward (the cast is in the graph, so gradients arrive at
// the masters in f32 and every reduction of them runs in f32); modules of the FP32-island types
// keep computing in f32 (their inputs cast up, their outputs cast back).
//
//   apply_mixed_precision(*model, {.param_dtype = DType::bf16});
#pragma once

#include <string>
#include <vector>

#include "engine/nn/module.h"

namespace quilt {

struct MixedPrecisionPolicy {
  DType param_dtype = DType::bf16;                          // compute dtype of parameters
  std::vector<std::string> fp32_islands = {"RMSNorm", "LayerNorm"};  // module types kept in f32
};

/// Installs the policy's forward hooks on every module of `root` that owns parameters.
void apply_mixed_precision(Module& root, const MixedPrecisionPolicy& policy);

}  // namespace quilt
