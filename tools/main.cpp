// The `quilt` executable: builds the command line from the registered subcommands (see
// tools/command.h), runs the chosen one, and turns errors into one line on stderr and exit 1
// (of every rank, when launched: collectives/launch.h exit_on_error).
// This is the only file that includes CLI11 (it is slow to compile).
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <map>

#include "collectives/launch.h"
#include "engine/error.h"
#include "tools/command.h"

namespace quilt {

std::vector<Command>& registered_commands() {
  static std::vector<Command> commands;
  return commands;
}

std::string option_long_name(const std::string& spec) {
  size_t comma = spec.rfind(',');
  return comma == std::string::npos ? spec : spec.substr(comma + 1);
}

std::string CommandArgs::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it != values_.end() && !it->second.empty()) return it->second.back();
  auto d = defaults_.find(name);
  return d == defaults_.end() ? std::string() : d->second;
}

int64_t CommandArgs::get_int(const std::string& name) const {
  const std::string s = get(name);
  int64_t v = 0;
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  QUILT_CHECK(res.ec == std::errc() && res.ptr == s.data() + s.size() && !s.empty(), "[cli] ", name,
              ": expected an integer, got '", s, "'");
  return v;
}

double CommandArgs::get_double(const std::string& name) const {
  const std::string s = get(name);
  double v = 0;
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  QUILT_CHECK(res.ec == std::errc() && res.ptr == s.data() + s.size() && !s.empty(), "[cli] ", name,
              ": expected a number, got '", s, "'");
  return v;
}

std::vector<std::string> CommandArgs::list(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

// OpenMP workers sleep as soon as a parallel region ends (OMP_WAIT_POLICY=passive) unless the
// user chose otherwise: libgomp's default spins ~300k polls first, which on a shared host burns
// a core per idle worker between ops (bench/parallel/omp_wait.sh measures the choice).
// libgomp reads the variable once, when it is loaded, before main; so the default is set by
// running this binary again with it in the environment (same pid, so mpiexec is unaffected).
void settle_omp_wait_policy(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only on failure: then run on under the runtime's default
}

}  // namespace quilt

int main(int argc, char** argv) {
  using namespace quilt;
  settle_omp_wait_policy(argv);
  CLI::App app{"quilt: distributed training on a quilt of tensor shards"};
  app.set_version_flag("--version", "quilt 0.1.0");
  app.require_subcommand(1);

  // One CLI11 app per command word; option values land in per-command string storage.
  struct Bound {
    const Command* command;
    CLI::App* app;
    std::map<std::string, std::string> one;
    std::map<std::string, std::vector<std::string>> many;
    std::map<std::string, bool> flags;
    std::map<std::string, CLI::Option*> options;
  };
  std::deque<Bound> bound;  // stable addresses for CLI11's pointers into the storage
  std::map<std::vector<std::string>, CLI::App*> groups;
  for (const Command& c : registered_commands()) {
    CLI::App* parent = &app;
    std::vector<std::string> prefix;
    for (size_t i = 0; i + 1 < c.path.size(); ++i) {
      prefix.push_back(c.path[i]);
      CLI::App*& g = groups[prefix];
      if (!g) {
        g = parent->add_subcommand(c.path[i], c.path[i] + " commands");
        g->require_subcommand(1);
      }
      parent = g;
    }
    Bound& b = bound.emplace_back();
    b.command = &c;
    b.app = parent->add_subcommand(c.path.back(), c.help);
    for (const CommandOption& o : c.options) {
      const std::string name = option_long_name(o.name);
      CLI::Option* opt = nullptr;
      switch (o.kind) {
        case OptionKind::kValue:
          b.one[name] = o.default_value;
          opt = b.app->add_option(o.name, b.one[name], o.help);
          if (!o.default_value.empty()) opt->default_str(o.default_value);
          break;
        case OptionKind::kList:
          opt = b.app->add_option(o.name, b.many[name], o.help);
          break;
        case OptionKind::kFlag:
          opt = b.app->add_flag(o.name, b.flags[name], o.help);
          break;
      }
      if (o.required) opt->required();
      b.options[name] = opt;
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  for (Bound& b : bound) {
    if (!b.app->parsed()) continue;
    CommandArgs args;
    for (const CommandOption& o : b.command->options) {
      const std::string name = option_long_name(o.name);
      args.set_default(name, o.default_value);
      if (b.options[name]->count() == 0) continue;
      switch (o.kind) {
        case OptionKind::kValue: args.set(name, {b.one[name]}); break;
        case OptionKind::kList: args.set(name, b.many[name]); break;
        case OptionKind::kFlag: args.set(name, {"true"}); break;
      }
    }
    try {
      return b.command->run(args);
    } catch (const std::exception& e) {
      exit_on_error(e);  // under a launcher, ends every rank of the job with this error
    }
  }
  std::fprintf(stderr, "quilt: no command ran\n");
  return 1;
}
