// Mixed precision: see mixed_precision.h.
#include "parallel/mixed_precision.h"

#include <algorithm>
#include <memory>

#include "engine/ops/view.h"

namespace quilt {
namespace {

void cast_floating(std::vector<Tensor>& ts, DType dt) {
  for (Tensor& t : ts)
    if (t.defined() && is_floating(t.dtype()) && t.dtype() != dt) t = cast(t, dt);
}

}  // namespace

void apply_mixed_precision(Module& root, const MixedPrecisionPolicy& policy) {
  for (auto& [path, m] : root.named_modules()) {
    NamedTensors own = m->named_parameters("", /*recurse=*/false);
    if (own.empty()) continue;
    const bool island = std::find(policy.fp32_islands.begin(), policy.fp32_islands.end(), m->type_name()) !=
                        policy.fp32_islands.end();
    const DType compute = island ? DType::f32 : policy.param_dtype;
    // The master parameters, put back after each forward (the slots hold casts during it).
    auto masters = std::make_shared<NamedTensors>();
    m->register_forward_pre_hook([compute, island, masters](Module& mod, std::vector<Tensor>& inputs) {
      cast_floating(inputs, compute);
      if (island) return;
      *masters = mod.named_parameters("", false);
      for (auto& [name, p] : *masters)
        if (p.defined() && is_floating(p.dtype()) && p.dtype() != compute) mod.replace_parameter(name, cast(p, compute));
    });
    const DType out_dt = policy.param_dtype;
    m->register_forward_hook([island, masters, out_dt](Module& mod, const std::vector<Tensor>&, std::vector<Tensor>& outputs) {
      if (island) {
        cast_floating(outputs, out_dt);
        return;
      }
      for (auto& [name, p] : *masters) mod.replace_parameter(name, p);
      masters->clear();
    });
  }
}

}  // namespace quilt
