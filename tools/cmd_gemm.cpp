// `quilt gemm`: the GEMM libraries this machine has, the one the engine uses and why (the
// forcing QUILT_GEMM, or the GFLOP/s measured at training shapes and the cache file holding
// them), and the shape classes of large GEMMs measured so far with the library each uses.
// `--measure` measures the per-mode choice again and rewrites the cache; `--list` prints the names only.
#include <cstdio>

#include "kernels/cpu/gemm_libs.h"
#include "kernels/cpu/matmul.h"
#include "tools/command.h"

namespace quilt {
namespace {

int gemm_info(const CommandArgs& a) {
  if (a.has("--list")) {
    for (const std::string& name : kernels::cpu::gemm_backends()) std::printf("%s\n", name.c_str());
    return 0;
  }
  std::printf("gemm libraries present:");
  for (const std::string& name : kernels::cpu::gemm_backends()) std::printf(" %s", name.c_str());
  std::printf("\nthreads: %d\n", kernels::cpu::gemm_threads());
  if (a.has("--measure")) {
    const auto c = kernels::cpu::gemm_libs::choose(/*remeasure=*/true);
    std::printf("gemm:");
    for (int mode = 0; mode < 4; ++mode)
      std::printf(" %s%s=%s", mode & 2 ? "T" : "N", mode & 1 ? "T" : "N", kernels::cpu::gemm_libs::lib_name(c.by_mode[mode]));
    std::printf(" (%s)\n", c.reason.c_str());
    return 0;
  }
  std::printf("gemm: %s (%s)\n", kernels::cpu::gemm_backend().c_str(), kernels::cpu::gemm_backend_reason().c_str());
  const auto classes = kernels::cpu::gemm_libs::shape_choices();
  std::printf("shape classes measured on this machine: %zu\n", classes.size());
  for (const std::string& c : classes) std::printf("  %s\n", c.c_str());
  return 0;
}

CommandRegistrar reg({
    .path = {"gemm"},
    .help = "Show the GEMM libraries present and the one in use (QUILT_GEMM=name forces one)",
    .options = {{.name = "--measure", .help = "measure them again and rewrite the cache", .kind = OptionKind::kFlag},
                {.name = "--list", .help = "print only the names of the libraries present", .kind = OptionKind::kFlag}},
    .run = gemm_info});

}  // namespace
}  // namespace quilt
