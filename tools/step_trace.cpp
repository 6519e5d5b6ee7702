// Step traces as Chrome/Perfetto JSON: see step_trace.h.
#include "tools/step_trace.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "collectives/agree.h"
#include "collectives/launch.h"

namespace quilt {
namespace fs = std::filesystem;
namespace {

// Pipeline actions go on their own track, above the thread tracks of the ops they contain.
constexpr int kPipelineTid = 1000;

nlohmann::json args_of(const trace::Event& e) {
  nlohmann::json a = nlohmann::json::object();
  for (const auto& [k, v] : e.args) std::visit([&, &key = k](const auto& x) { a[key] = x; }, v);
  return a;
}

}  // namespace

void write_step_trace(Run& r, int64_t step, const std::vector<trace::Event>& events,
                      const std::vector<pipeline::Span>* pipeline) {
  const int rank = r.world->rank();
  nlohmann::json out = nlohmann::json::array();
  int max_tid = 0;
  for (const trace::Event& e : events) {
    max_tid = std::max(max_tid, e.tid);
    nlohmann::json j = {{"name", e.name}, {"cat", e.cat}, {"ph", "X"}, {"pid", rank}, {"tid", e.tid},
                        {"ts", e.ts_us}, {"dur", e.dur_us}};
    if (!e.args.empty()) j["args"] = args_of(e);
    out.push_back(std::move(j));
  }
  double busy = 0, end = 0;
  if (pipeline) {
    // The runner times its actions from the end of the barrier that opens its walk: the first
    // barrier of the step on this rank.
    double offset = 0;
    for (const trace::Event& e : events)
      if (e.cat == "collective" && e.name == "barrier") {
        offset = e.ts_us + e.dur_us;
        break;
      }
    for (const pipeline::Span& s : *pipeline) {
      const bool wait = s.action.microbatch < 0;
      const pipeline::Op op = s.action.op;
      const bool compute = !wait && (op == pipeline::Op::kF || op == pipeline::Op::kB || op == pipeline::Op::kI ||
                                     op == pipeline::Op::kW);
      if (compute) busy += s.end_us - s.start_us;
      end = std::max(end, s.end_us);
      out.push_back({{"name", wait ? "wait" : pipeline::to_string(s.action)},
                     {"cat", wait ? "wait" : compute ? "compute" : "transfer"}, {"ph", "X"}, {"pid", rank},
                     {"tid", kPipelineTid}, {"ts", offset + s.start_us}, {"dur", s.end_us - s.start_us}});
    }
    out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", kPipelineTid},
                   {"args", {{"name", "pipeline actions"}}}});
  }
  for (int t = 0; t <= max_tid; ++t)
    out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", t},
                   {"args", {{"name", t == 0 ? std::string("main") : "thread " + std::to_string(t)}}}});
  out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  const fs::path dir(*r.cfg.logging.dir);
  const std::string stem = "trace_step" + std::to_string(step);
  {
    const fs::path mine = dir / (stem + "_rank" + std::to_string(rank) + ".json");
    std::ofstream f(mine);
    f << nlohmann::json{{"traceEvents", out}, {"displayTimeUnit", "ms"}}.dump();
    QUILT_CHECK(f.good(), "[logging.trace] writing ", mine.string(), " failed");
  }
  const nlohmann::json mine = {{"events", out}, {"busy", busy}, {"end", end}};
  const std::vector<std::string> all = all_gather_text(*r.world, mine.dump());
  if (rank != 0) return;
  nlohmann::json merged = nlohmann::json::array();
  double busy_all = 0, makespan = 0;
  std::vector<double> busy_of;
  for (const std::string& text : all) {
    const nlohmann::json j = nlohmann::json::parse(text);
    for (const auto& e : j.at("events")) merged.push_back(e);
    busy_of.push_back(j.at("busy").get<double>());
    busy_all += busy_of.back();
    makespan = std::max(makespan, j.at("end").get<double>());
  }
  const fs::path path = dir / (stem + ".json");
  {
    std::ofstream f(path);
    f << nlohmann::json{{"traceEvents", merged}, {"displayTimeUnit", "ms"}}.dump();
    QUILT_CHECK(f.good(), "[logging.trace] writing ", path.string(), " failed");
  }
  if (!pipeline) {
    log_line("trace: step ", step, " in ", path.string(), " (", merged.size(), " events from ", all.size(),
             all.size() == 1 ? " rank)" : " ranks)");
    return;
  }
  std::string per_rank;
  for (size_t i = 0; i < busy_of.size(); ++i) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%s%zu %.1f%%", i ? ", " : "", i, 100 * (1 - busy_of[i] / makespan));
    per_rank += buf;
  }
  char line[64];
  std::snprintf(line, sizeof line, "%.1f%%", 100 * (1 - busy_all / (double(all.size()) * makespan)));
  log_line("pipeline trace: step ", step, " in ", path.string(), "; the ranks were idle ", line,
           " of the step (rank ", per_rank, ")");
}

}  // namespace quilt
