// `quilt inspect --file F.safetensors`: lists a safetensors file's tensors (name, shape, dtype)
// and metadata, reading only its header.
#include <cstdio>

#include "engine/io/safetensors.h"
#include "tools/command.h"

namespace quilt {
namespace {

int inspect(const CommandArgs& a) {
  const SafetensorsIndex idx = read_safetensors_index(a.get("--file"));
  for (const auto& e : idx.entries) {
    std::string shape = "(";
    for (size_t i = 0; i < e.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(e.shape[i]);
    shape += e.shape.size() == 1 ? ",)" : ")";
    std::printf("%s %s %s\n", e.name.c_str(), shape.c_str(), dtype_name(e.dtype));
  }
  for (const auto& [k, v] : idx.metadata) std::printf("# %s: %s\n", k.c_str(), v.c_str());
  return 0;
}

CommandRegistrar reg({
    .path = {"inspect"},
    .help = "List the tensors (name, shape, dtype) and metadata of a safetensors file",
    .options = {{.name = "-f,--file", .help = "safetensors file", .required = true}},
    .run = inspect,
});

}  // namespace
}  // namespace quilt
