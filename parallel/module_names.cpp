// Finding modules by name: see module_names.h.
#include "parallel/module_names.h"

namespace quilt {
namespace {

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  size_t start = 0;
  while (true) {
    const size_t p = s.find('.', start);
    out.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) return out;
    start = p + 1;
  }
}

}  // namespace

std::vector<std::string> match_modules(Module& root, const std::string& pattern) {
  const std::vector<std::string> want = split_dots(pattern);
  std::vector<std::string> out;
  for (auto& [name, m] : root.named_modules("")) {
    const std::vector<std::string> have = split_dots(name);
    if (have.size() != want.size()) continue;
    bool ok = true;
    for (size_t i = 0; i < have.size() && ok; ++i) ok = want[i] == "*" || want[i] == have[i];
    if (ok) out.push_back(name);
  }
  return out;
}

std::vector<std::string> modules_with_suffix(Module& root, const std::string& suffix) {
  std::vector<std::string> out;
  for (auto& [name, m] : root.named_modules("")) {
    const bool whole = name == suffix;
    const bool tail = name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
                      name[name.size() - suffix.size() - 1] == '.';
    if (!suffix.empty() && (whole || tail)) out.push_back(name);
  }
  return out;
}

}  // namespace quilt
