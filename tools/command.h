// Subcommands of the `quilt` executable. Each lives in its own tools/cmd_<name>.cpp and
// registers itself with a static CommandRegistrar; main.cpp (the only file that sees CLI11)
// turns the declared options into the command line. Adding `quilt train` is one new file:
//
//   static CommandRegistrar reg({
//       .path = {"train"},
//       .help = "Train a model from a recipe",
//       .options = {{.name = "--config", .help = "recipe YAML", .required = true},
//                   {.name = "--set", .help = "override key=value", .kind = OptionKind::kList}},
//       .run = [](const CommandArgs& a) { return train_main(a.get("--config"), a.list("--set")); }});
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace quilt {

/// What an option takes: one value, any number of values, or nothing (a flag).
enum class OptionKind { kValue, kList, kFlag };

/// One command-line option ("--config") of a subcommand.
struct CommandOption {
  std::string name = {};  // "--config"; "-c,--config" gives a short alias as well
  std::string help = {};
  OptionKind kind = OptionKind::kValue;
  bool required = false;
  std::string default_value = {};  // shown in --help and returned by get() when absent
};

/// Parsed option values, keyed by the option's long name ("--config").
class CommandArgs {
 public:
  /// True when the option was given on the command line.
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  /// The value of a kValue option (its default_value when absent).
  std::string get(const std::string& name) const;
  /// A kValue option as an integer; throws naming the option if it is not one.
  int64_t get_int(const std::string& name) const;
  /// A kValue option as a number; throws naming the option if it is not one.
  double get_double(const std::string& name) const;
  /// All values of a kList option (empty when absent).
  std::vector<std::string> list(const std::string& name) const;
  /// A kFlag option.
  bool flag(const std::string& name) const { return has(name); }

  /// Used by main.cpp while parsing.
  void set(const std::string& name, std::vector<std::string> v) { values_[name] = std::move(v); }
  void set_default(const std::string& name, std::string v) { defaults_[name] = std::move(v); }

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::map<std::string, std::string> defaults_;
};

/// A subcommand: its words ("data", "prepare"), help, options and entry point (returns the exit code).
struct Command {
  std::vector<std::string> path = {};
  std::string help = {};
  std::vector<CommandOption> options = {};
  std::function<int(const CommandArgs&)> run = {};
};

/// Every registered subcommand, in registration order.
std::vector<Command>& registered_commands();

/// Registers a subcommand from a static object's constructor.
struct CommandRegistrar {
  explicit CommandRegistrar(Command c) { registered_commands().push_back(std::move(c)); }
};

/// The long name of an option spec: "-c,--config" -> "--config".
std::string option_long_name(const std::string& spec);

}  // namespace quilt
