// Finding modules by name for the parallelize plans: dotted patterns with "*" for one name
// component (tensor-parallel plans, activation checkpointing) and dotted-name suffixes (a
// model's fp32_modules).
//
//   match_modules(*model, "model.layers.*.mlp");          // {"model.layers.0.mlp", ...}
//   modules_with_suffix(*model, "input_layernorm");       // {"model.layers.0.input_layernorm", ...}
#pragma once

#include <string>
#include <vector>

#include "engine/nn/module.h"

namespace quilt {

/// Names of `root`'s modules (dotted, from root; "" is root) that `pattern` matches: equal
/// component counts, each component equal or "*". Depth-first order, parents first.
std::vector<std::string> match_modules(Module& root, const std::string& pattern);

/// Names of `root`'s modules whose dotted name is `suffix` or ends with "." + suffix.
std::vector<std::string> modules_with_suffix(Module& root, const std::string& suffix);

}  // namespace quilt
