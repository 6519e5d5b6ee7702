// Compares the per-step losses of two metrics.jsonl files (the trainer's equivalence and
// determinism tests): `metrics_compare A B TOL [first_step]` exits 0 when every step of B is in A
// with |loss_A - loss_B| <= TOL (TOL 0: bit-identical), and prints the largest deviation.
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

static std::map<long long, double> read_losses(const char* path) {
  std::map<long long, double> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    out[j.at("step").get<long long>()] = j.at("loss").get<double>();
  }
  return out;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: metrics_compare A.jsonl B.jsonl TOL [first_step]\n");
    return 2;
  }
  const auto a = read_losses(argv[1]), b = read_losses(argv[2]);
  const double tol = std::atof(argv[3]);
  const long long first = argc > 4 ? std::atoll(argv[4]) : 1;
  double worst = 0;
  long long worst_step = -1, compared = 0;
  for (const auto& [step, lb] : b) {
    if (step < first) continue;
    auto it = a.find(step);
    if (it == a.end()) {
      std::printf("step %lld of %s is missing from %s\n", step, argv[2], argv[1]);
      return 1;
    }
    const double d = std::abs(it->second - lb);
    if (d > worst || worst_step < 0) { worst = d; worst_step = step; }
    ++compared;
    const bool ok = tol == 0 ? it->second == lb : d <= tol;
    if (!ok) {
      std::printf("step %lld: loss %.17g vs %.17g differs by %.3g (tolerance %.3g)\n", step, it->second, lb, d, tol);
      return 1;
    }
  }
  if (compared == 0) {
    std::printf("no steps compared\n");
    return 1;
  }
  std::printf("%lld steps agree; largest deviation %.3g at step %lld (tolerance %.3g)\n", compared, worst, worst_step, tol);
  return 0;
}
