// Fuzzes the YAML recipe loader: the input is a recipe, optionally followed by a NUL byte and
// "key=value" overrides one per line. A recipe that parses must pass through recipe_to_yaml and
// parse back to the same settings (the header's promise), and check_recipe must answer for a
// few world sizes. quilt::Error is the expected answer to a bad recipe; anything else (another
// exception, a round trip that changes a setting, a sanitizer report) is a bug.
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "tools/config.h"

using namespace quilt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  std::vector<std::string> overrides;
  if (nul != std::string::npos) {
    std::istringstream lines(input.substr(nul + 1));
    for (std::string line; std::getline(lines, line);) overrides.push_back(line);
  }
  RecipeConfig cfg;
  try {
    cfg = parse_recipe(input.substr(0, nul), overrides, "<fuzz>");
  } catch (const Error&) {
    return 0;
  }
  const std::string yaml = recipe_to_yaml(cfg);
  if (!(parse_recipe(yaml, {}, "<fuzz round trip>") == cfg)) {
    std::fprintf(stderr, "recipe_to_yaml does not read back to the same settings:\n%s", yaml.c_str());
    std::abort();
  }
  for (int64_t world : {1, 2, 4, 8}) {
    try {
      check_recipe(cfg, world);
    } catch (const Error&) {
    }
  }
  return 0;
}
