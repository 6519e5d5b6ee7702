// apply_fsdp / apply_ddp: see data_parallel.h.
#include "parallel/data_parallel.h"

#include "parallel/module_names.h"

namespace quilt {

void DataParallelism::set_requires_gradient_sync(bool sync) const {
  if (fsdp) fsdp->set_requires_gradient_sync(sync);
  if (ddp) ddp->set_requires_gradient_sync(sync);
}

void DataParallelism::finish_backward() const {
  if (fsdp) fsdp->finish_backward();
  if (ddp) ddp->finish_backward();
}

std::shared_ptr<FSDPModule> apply_fsdp(Module& root, const DeviceMesh& mesh, const FSDPPolicy& policy,
                                       const std::vector<std::string>& unit_patterns) {
  for (const std::string& pattern : unit_patterns) {
    const std::vector<std::string> names = match_modules(root, pattern);
    QUILT_CHECK(!names.empty(), "[apply_fsdp] no module of ", root.type_name(), " matches '", pattern, "'");
    for (const std::string& n : names) fully_shard(root.submodule(n), mesh, policy);
  }
  return fully_shard(root, mesh, policy);
}

std::shared_ptr<ReplicateModule> apply_ddp(Module& root, const DeviceMesh& mesh, DDPOptions opts) {
  return replicate(root, mesh, opts);
}

}  // namespace quilt
