// Checks a merged pipeline trace (logging.trace): valid JSON in Chrome's trace event format,
// one named process per rank, and on each rank the expected number of compute slices (every
// forward and backward of its stages), none overlapping another.
//
//   trace_check trace_step2.json RANKS COMPUTE_SLICES_PER_RANK
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: trace_check TRACE.json RANKS COMPUTE_SLICES_PER_RANK\n");
    return 2;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::ifstream(argv[1]));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s is not valid JSON: %s\n", argv[1], e.what());
    return 1;
  }
  const int ranks = std::stoi(argv[2]), per_rank = std::stoi(argv[3]);
  std::map<int, std::string> names;
  std::map<int, std::vector<std::pair<double, double>>> compute;
  for (const auto& e : j.at("traceEvents")) {
    const int pid = e.at("pid").get<int>();
    if (e.at("ph") == "M") names[pid] = e.at("args").at("name").get<std::string>();
    else if (e.at("ph") == "X" && e.at("cat") == "compute")
      compute[pid].push_back({e.at("ts").get<double>(), e.at("ts").get<double>() + e.at("dur").get<double>()});
  }
  int bad = 0;
  for (int r = 0; r < ranks; ++r) {
    if (names[r] != "rank " + std::to_string(r)) {
      std::fprintf(stderr, "process %d is named '%s'\n", r, names[r].c_str());
      ++bad;
    }
    auto& c = compute[r];
    if (int(c.size()) != per_rank) {
      std::fprintf(stderr, "rank %d has %zu compute slices, expected %d\n", r, c.size(), per_rank);
      ++bad;
    }
    for (size_t i = 1; i < c.size(); ++i)
      if (c[i].first < c[i - 1].second) {
        std::fprintf(stderr, "rank %d: slice %zu starts before slice %zu ends\n", r, i, i - 1);
        ++bad;
      }
  }
  if (int(names.size()) != ranks) {
    std::fprintf(stderr, "%zu processes, expected %d\n", names.size(), ranks);
    ++bad;
  }
  std::printf("trace_check: %s: %d ranks, %d compute slices each%s\n", argv[1], ranks, per_rank, bad ? ": FAILED" : "");
  return bad ? 1 : 0;
}
