// Checks a merged trace (logging.trace): valid JSON in Chrome's trace event format, one named
// process per rank, and either on each rank the expected number of pipeline compute slices
// (every forward and backward of its stages), none overlapping another, or on each rank at least
// one slice of every CAT:NAME given (NAME a prefix), with the arguments that kind must carry
// (ops their shapes, collectives and FSDP traffic their bytes, collectives their mesh axis).
//
//   trace_check trace_step2.json RANKS COMPUTE_SLICES_PER_RANK
//   trace_check trace_step2.json RANKS --has op:matmul collective:all_gather fsdp:"fsdp all_gather" ...
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

// Every rank has a slice of each "cat:name" (name a prefix) carrying its kind's arguments.
int check_has(const nlohmann::json& j, int ranks, const std::vector<std::string>& wanted) {
  int bad = 0;
  std::map<int, std::string> names;
  for (const auto& e : j.at("traceEvents"))
    if (e.at("ph") == "M" && e.at("name") == "process_name") names[e.at("pid").get<int>()] = e.at("args").at("name");
  for (int r = 0; r < ranks; ++r)
    if (names[r] != "rank " + std::to_string(r)) {
      std::fprintf(stderr, "process %d is named '%s'\n", r, names[r].c_str());
      ++bad;
    }
  for (const std::string& w : wanted) {
    const size_t colon = w.find(':');
    const std::string cat = w.substr(0, colon), name = colon == std::string::npos ? "" : w.substr(colon + 1);
    std::map<int, int> found;
    for (const auto& e : j.at("traceEvents")) {
      if (e.at("ph") != "X" || e.at("cat") != cat || e.at("name").get<std::string>().rfind(name, 0) != 0) continue;
      const nlohmann::json args = e.value("args", nlohmann::json::object());
      bool ok = e.at("dur").get<double>() >= 0;
      const char* shapes = e.at("name").get<std::string>().ends_with(" backward") ? "grad shapes" : "shapes";
      if (cat == "op") ok = ok && args.contains(shapes) && !args[shapes].get<std::string>().empty();
      if (cat == "collective") ok = ok && args.contains("axis") && !args["axis"].get<std::string>().empty();
      // Waits carry no bytes: the gather they wait for has them.
      const bool wait = e.at("name").get<std::string>().find(" wait") != std::string::npos;
      if ((cat == "collective" || cat == "fsdp") && !wait) ok = ok && args.contains("bytes") && args["bytes"].get<int64_t>() > 0;
      if (ok) ++found[e.at("pid").get<int>()];
    }
    for (int r = 0; r < ranks; ++r) {
      if (found[r] > 0) continue;
      std::fprintf(stderr, "rank %d has no '%s' slice of category '%s' with its arguments\n", r, name.c_str(),
                   cat.c_str());
      ++bad;
    }
    std::printf("trace_check: %s:%s: %d slices on rank 0\n", cat.c_str(), name.c_str(), found[0]);
  }
  return bad;
}

// Parses `path` into `j`; false (with the reason on stderr) when it is not valid JSON.
bool load(const char* path, nlohmann::json& j) {
  try {
    j = nlohmann::json::parse(std::ifstream(path));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s is not valid JSON: %s\n", path, e.what());
    return false;
  }
  return true;
}

int main(int argc, char** argv) {
  if (argc >= 4 && std::string(argv[3]) == "--has") {
    nlohmann::json j;
    if (!load(argv[1], j)) return 1;
    const int bad = check_has(j, std::stoi(argv[2]), std::vector<std::string>(argv + 4, argv + argc));
    std::printf("trace_check: %s%s\n", argv[1], bad ? ": FAILED" : ": every rank has every kind of slice");
    return bad ? 1 : 0;
  }
  if (argc != 4) {
    std::fprintf(stderr, "usage: trace_check TRACE.json RANKS COMPUTE_SLICES_PER_RANK\n");
    return 2;
  }
  nlohmann::json j;
  if (!load(argv[1], j)) return 1;
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
