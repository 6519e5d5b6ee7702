// `quilt plot RUN/metrics.jsonl [MORE.jsonl ...] -o loss.png [--metrics loss,lr,grad_norm,tps]`:
// one panel per metric against step, one line per run, drawn by gnuplot into a PNG, so runs
// under different layouts compare at a glance. Every line of every file must be a JSON object
// with a "step"; a file that is missing or is not JSON lines is refused, naming file and line.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/error.h"
#include "tools/command.h"

namespace quilt {
namespace {
namespace fs = std::filesystem;

struct Series {
  std::string label;                                            // the run: its directory's name
  std::map<std::string, std::vector<std::pair<int64_t, double>>> points;  // metric -> (step, value)
};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

Series read_metrics(const std::string& path, const std::vector<std::string>& metrics) {
  QUILT_CHECK(fs::exists(path), "[plot] ", path, " does not exist");
  QUILT_CHECK(!fs::is_directory(path), "[plot] ", path, " is a directory (give its metrics.jsonl)");
  std::ifstream f(path);
  QUILT_CHECK(f.is_open(), "[plot] cannot read ", path);
  Series s;
  const fs::path p(path);
  s.label = p.has_parent_path() && p.parent_path().filename() != "" ? p.parent_path().filename().string() : p.stem().string();
  std::string line;
  int64_t n = 0, records = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      fail("[plot] ", path, ":", n, " is not JSON (each line of a metrics file is one JSON object): ", e.what());
    }
    QUILT_CHECK(j.is_object(), "[plot] ", path, ":", n, " is not a JSON object");
    QUILT_CHECK(j.contains("step") && j["step"].is_number_integer(), "[plot] ", path, ":", n,
                " has no integer \"step\"");
    ++records;
    for (const std::string& m : metrics) {
      if (!j.contains(m)) continue;  // e.g. gather_wait_s exists only under FSDP
      QUILT_CHECK(j[m].is_number(), "[plot] ", path, ":", n, ": \"", m, "\" is not a number");
      s.points[m].push_back({j["step"].get<int64_t>(), j[m].get<double>()});
    }
  }
  QUILT_CHECK(records > 0, "[plot] ", path, " has no steps");
  for (const std::string& m : metrics)
    QUILT_CHECK(!s.points[m].empty(), "[plot] --metrics: no line of ", path, " has \"", m, "\"");
  return s;
}

// gnuplot's double-quoted strings: backslashes and quotes escaped.
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

int plot_main(const CommandArgs& a) {
  const std::vector<std::string> files = a.list("files");
  const std::string output = a.get("--output");
  const std::vector<std::string> metrics = split_list(a.get("--metrics"));
  QUILT_CHECK(!metrics.empty(), "[plot] --metrics is empty (give e.g. loss,lr,grad_norm,tps)");
  std::vector<Series> runs;
  for (const std::string& f : files) runs.push_back(read_metrics(f, metrics));
  // Runs from directories of the same name are told apart by their whole path.
  std::map<std::string, int> seen;
  for (const Series& s : runs) ++seen[s.label];
  for (size_t i = 0; i < runs.size(); ++i)
    if (seen[runs[i].label] > 1) runs[i].label = files[i];

  char tmpl[] = "/tmp/quilt-plot-XXXXXX";
  QUILT_CHECK(mkdtemp(tmpl) != nullptr, "[plot] cannot create a temporary directory under /tmp");
  const fs::path tmp(tmpl);
  std::ostringstream script;
  const int height = 260 * int(metrics.size()) + 40;
  script << "set terminal pngcairo size 900," << height << " font 'sans,10'\n"
         << "set output " << quoted(output) << "\n"
         << "set multiplot layout " << metrics.size() << ",1\n"
         << "set termoption noenhanced\nset grid\nset key top right\nset xlabel 'step'\n";
  for (size_t m = 0; m < metrics.size(); ++m) {
    script << "set ylabel " << quoted(metrics[m]) << "\nset title " << quoted(metrics[m] + " against step") << "\n";
    script << "plot ";
    for (size_t r = 0; r < runs.size(); ++r) {
      const fs::path data = tmp / ("run" + std::to_string(r) + "_" + std::to_string(m) + ".dat");
      std::ofstream d(data);
      for (const auto& [step, v] : runs[r].points[metrics[m]]) d << step << ' ' << v << '\n';
      script << (r ? ", " : "") << quoted(data.string()) << " using 1:2 with lines lw 2 title "
             << quoted(runs[r].label);
    }
    script << "\n";
  }
  script << "unset multiplot\n";
  const fs::path script_path = tmp / "plot.gp";
  std::ofstream(script_path) << script.str();
  const fs::path log = tmp / "gnuplot.log";
  const std::string cmd = "gnuplot " + quoted(script_path.string()) + " > " + quoted(log.string()) + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::string err;
  if (rc != 0) {
    std::ifstream l(log);
    err.assign(std::istreambuf_iterator<char>(l), {});
  }
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (rc != 0 && err.find("not found") != std::string::npos && err.find("gnuplot") != std::string::npos)
    fail("[plot] gnuplot is not installed (Debian: apt-get install gnuplot-nox)");
  QUILT_CHECK(rc == 0, "[plot] gnuplot failed writing ", output, ": ", err);
  QUILT_CHECK(fs::exists(output) && fs::file_size(output) > 0, "[plot] gnuplot wrote no ", output);
  std::printf("plot: %s (%zu run%s; %s against step)\n", output.c_str(), runs.size(), runs.size() == 1 ? "" : "s",
              a.get("--metrics").c_str());
  return 0;
}

CommandRegistrar reg({
    .path = {"plot"},
    .help = "Plot metrics.jsonl files (loss, lr, grad_norm, tps, ...) against step into a PNG, one line per run",
    .options = {{.name = "files", .help = "metrics.jsonl files (logging.dir of each run)", .kind = OptionKind::kList,
                 .required = true},
                {.name = "-o,--output", .help = "PNG file to write", .required = true},
                {.name = "--metrics", .help = "comma-separated metrics, one panel each", .default_value = "loss"}},
    .run = plot_main,
});

}  // namespace
}  // namespace quilt
