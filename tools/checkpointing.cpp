// Trainer checkpoints: see checkpointing.h.
#include "tools/checkpointing.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "collectives/agree.h"
#include "collectives/launch.h"
#include "dtensor/checkpoint.h"
#include "engine/io/safetensors.h"

namespace quilt {
namespace fs = std::filesystem;

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

namespace {

// A step-counter field of the index metadata, parsed strictly (no "1x", no "").
int64_t metadata_int(const dtensor::CheckpointInfo& info, const std::string& dir, const std::string& key) {
  auto it = info.metadata.find(key);
  QUILT_CHECK(it != info.metadata.end(), "[checkpoint] ", dir, ": the index has no metadata '", key, "'");
  int64_t v = 0;
  const std::string& s = it->second;
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  QUILT_CHECK(res.ec == std::errc() && res.ptr == s.data() + s.size() && !s.empty(), "[checkpoint] ", dir,
              ": metadata '", key, "' must be an integer, got '", s, "'");
  return v;
}

double metadata_double(const std::string& dir, const std::string& key, const std::string& s) {
  double v = 0;
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  QUILT_CHECK(res.ec == std::errc() && res.ptr == s.data() + s.size() && !s.empty(), "[checkpoint] ", dir,
              ": metadata '", key, "' must be a number, got '", s, "'");
  return v;
}

// Whether every rank's parameter shards hold only finite values (collective over the world).
bool parameters_finite(Run& r) {
  bool finite = true;
  for (const Tensor& p : r.params) {
    const Tensor x = p.local().to(Device::cpu()).to(DType::f64).contiguous();
    const double* v = x.data<double>();
    for (int64_t i = 0; i < x.numel() && finite; ++i) finite = std::isfinite(v[i]);
    if (!finite) break;
  }
  Tensor flag = from_vector({finite ? 1.0 : 0.0}, {1});
  r.world->all_reduce(flag, ReduceOp::min);
  return flag.item<double>() > 0;
}

// A checkpoint saved right after a skipped (non-finite) step, or holding non-finite weights,
// is suspect: it never counts towards keep_last, so it cannot push a good one out.
bool suspect(const std::string& dir) {
  const auto meta = dtensor::read_checkpoint_info(dir).metadata;
  auto it = meta.find("trainer.suspect");
  return it != meta.end() && it->second != "no";
}

// The trainer's checkpoint directories under `root` (step_N, complete or not), oldest first.
std::vector<std::string> step_dirs(const std::string& root) {
  std::vector<std::string> all;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("step_", 0) == 0 && n.find(".tmp") == std::string::npos) all.push_back(e.path().string());
  }
  std::sort(all.begin(), all.end());
  return all;
}

// keep_last: the newest `keep` good checkpoints stay, with any suspect one newer than the
// oldest of them; everything older goes.
void prune(const std::string& root, int64_t keep) {
  const std::vector<std::string> all = step_dirs(root);
  int64_t good = 0;
  size_t oldest_kept = all.size();
  for (size_t i = all.size(); i-- > 0 && good < keep;)
    if (!suspect(all[i])) {
      ++good;
      oldest_kept = i;
    }
  if (good < keep) return;  // fewer good checkpoints than keep_last: delete nothing
  for (size_t i = 0; i < oldest_kept; ++i) fs::remove_all(all[i]);
}

}  // namespace

// A state on the GPU (train.device cuda) is written from, and read into, host copies.
Tensor on_host(const Tensor& t) { return t.device().is_cpu() ? t : t.to(Device::cpu()); }

void save_checkpoint(Run& r, const std::string& root) {
  const std::string dir = (fs::path(root) / step_dir_name(r.step_count)).string();
  agree(*r.world, "checkpoint save", [&] {
    if (r.world->rank() == 0) fs::create_directories(root);
  });
  dtensor::StateDict state;
  for (const auto& m : r.stages)  // pipeline stages: each rank its own layers, names global
    for (auto& [name, t] : m->state_dict()) state.emplace_back("model." + name, on_host(t));
  OptimizerState os = r.opt->state_dict();
  for (auto& [name, t] : os.tensors) state.emplace_back("optim." + name, on_host(t));
  std::map<std::string, std::string> meta;
  for (auto& [name, v] : os.scalars) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    meta["optim." + name] = buf;
  }
  meta["trainer.step"] = std::to_string(r.step_count);
  const bool finite = parameters_finite(r);
  const char* why = !finite ? "non-finite weights" : r.skipped_in_a_row > 0 ? "after a skipped step" : nullptr;
  meta["trainer.suspect"] = why ? why : "no";
  meta["trainer.loader"] = r.loader->state().to_json();
  meta["trainer.layout"] = r.dims.mesh_string();
  meta["trainer.recipe"] = recipe_to_yaml(r.cfg);
  // Throws on every rank when any rank fails (and leaves no step_N.tmp behind).
  agree(*r.world, "checkpoint save", [&] { dtensor::save_checkpoint(dir, state, *r.world, meta); });
  agree(*r.world, "checkpoint pruning (checkpoint.keep_last)", [&] {
    if (r.world->rank() == 0 && r.cfg.checkpoint.keep_last > 0) prune(root, r.cfg.checkpoint.keep_last);
  });
  log_line("checkpoint: saved ", dir, why ? detail::concat(" (", why, ": not counted by keep_last)") : "");
}

void load_checkpoint(Run& r, const std::string& dir) {
  // Each rank reads its own blocks; a damaged or missing file on one rank stops every rank.
  dtensor::CheckpointInfo info;
  agree(*r.world, "checkpoint load", [&] {
    info = dtensor::read_checkpoint_info(dir);
    dtensor::StateDict targets;
    for (const auto& m : r.stages)
      for (auto& [name, t] : m->state_dict()) targets.emplace_back("model." + name, t);
    // Optimizer moments take their parameter's layout; their names are "optim.state.<param>.<buffer>".
    // Under a pipeline this rank holds some parameters; the others belong to other stages.
    std::map<std::string, Tensor> by_name;
    for (const Tensor& p : r.params) by_name[p.name()] = p;
    std::set<std::string> model_params;
    {
      DeferredInitGuard no_storage;
      for (const Tensor& p : LlamaForCausalLM(llama_config(r.cfg.model)).parameters()) model_params.insert(p.name());
    }
    // The parameter an "optim.<key>" entry belongs to ("" for param_groups and the like).
    auto param_of = [](const std::string& key) {
      if (key.rfind("state.", 0) != 0) return std::string();
      const std::string rest = key.substr(6);
      const auto dot = rest.rfind('.');
      return dot == std::string::npos ? rest : rest.substr(0, dot);
    };
    OptimizerState os;
    for (const auto& ti : info.tensors) {
      if (ti.name.rfind("optim.", 0) != 0) continue;
      const std::string key = ti.name.substr(6), param = param_of(key);
      QUILT_CHECK(model_params.count(param), "[checkpoint] ", dir, ": optimizer tensor '", ti.name,
                  "' belongs to no parameter of this model");
      auto it = by_name.find(param);
      if (it == by_name.end()) continue;  // another pipeline stage's
      const Tensor& p = it->second;
      Tensor local = zeros(p.local().shape(), {.dtype = ti.dtype, .device = p.device()});
      Tensor t = p.is_distributed() ? Tensor::make_distributed(local, p.dist_spec(), p.shape()) : local;
      targets.emplace_back(ti.name, t);
      os.tensors.insert(key, t);
    }
    std::vector<std::pair<Tensor, Tensor>> to_device;  // (device tensor, its host copy)
    for (auto& [name, t] : targets)
      if (!t.device().is_cpu()) {
        to_device.emplace_back(t, on_host(t));
        t = to_device.back().second;
      }
    dtensor::load_checkpoint(dir, targets);
    for (auto& [device_tensor, host] : to_device) device_tensor.copy_(host);
    for (auto& [k, v] : info.metadata) {
      if (k.rfind("optim.", 0) != 0) continue;
      const std::string key = k.substr(6), param = param_of(key);
      if (param.empty() || by_name.count(param)) os.scalars.insert(key, metadata_double(dir, k, v));
    }
    r.opt->load_state_dict(os);
    r.step_count = metadata_int(info, dir, "trainer.step");
    auto loader = info.metadata.find("trainer.loader");
    QUILT_CHECK(loader != info.metadata.end(), "[checkpoint] ", dir, ": the index has no metadata 'trainer.loader'");
    r.loader->load_state(LoaderState::from_json(loader->second));
  });
  auto layout = info.metadata.find("trainer.layout");
  log_line("checkpoint: resumed from ", dir, " at step ", r.step_count, " (saved as ",
           layout == info.metadata.end() ? "an unknown layout" : layout->second, ")");
}

void export_consolidated(Run& r, const std::string& root) {
  agree(*r.world, "HF export", [&] {
    if (r.world->rank() != 0) return;
    // HF layout: the model tensors with HF names (the trainer's "model." prefix dropped, the
    // optimizer state left out) and config.json.
    const std::string src = (fs::path(root) / step_dir_name(r.step_count)).string();
    const fs::path out = fs::path(root) / "hf";
    fs::create_directories(out);
    const std::string all_path = (out / "model.all.safetensors").string();
    // Grouped experts go out as HF's one tensor per expert: those of every layer, so of the
    // whole model (built without storage) when this rank holds only some pipeline stages.
    std::vector<dtensor::StackedName> stacks;
    std::shared_ptr<LlamaForCausalLM> whole = r.model;
    if (r.stages.size() != 1 || r.pp_comm) {
      DeferredInitGuard no_storage;
      whole = std::make_shared<LlamaForCausalLM>(llama_config(r.cfg.model));
    }
    for (const ExpertStack& e : expert_stacks(*whole)) stacks.push_back({"model." + e.name, "model." + e.pattern, e.count});
    dtensor::export_consolidated(src, all_path, uint64_t(5) << 30, stacks);
    SafetensorsFile all = load_safetensors(all_path, {.mmap = false});
    std::vector<std::pair<std::string, Tensor>> model;
    for (const std::string& name : all.names)
      if (name.rfind("model.", 0) == 0) model.emplace_back(name.substr(6), all.tensors.at(name));
    save_safetensors((out / "model.safetensors").string(), model, {{"format", "pt"}});
    fs::remove(all_path);
    std::ofstream((out / "config.json").string()) << llama_config(r.cfg.model).to_json();
    log_line("checkpoint: consolidated HF weights in ", out.string());
  });
}

std::string latest_checkpoint(const std::string& dir) {
  if (dir.empty() || !fs::exists(dir)) return "";
  // The newest complete checkpoint whose weights are finite (one saved with non-finite weights
  // would be refused by the load; an earlier one continues the run).
  const std::vector<std::string> all = step_dirs(dir);
  for (size_t i = all.size(); i-- > 0;) {
    if (!fs::exists(fs::path(all[i]) / "index.json")) continue;
    const auto meta = dtensor::read_checkpoint_info(all[i]).metadata;
    auto it = meta.find("trainer.suspect");
    if (it != meta.end() && it->second == "non-finite weights") {
      log_line("checkpoint: passing over ", all[i], " (saved with non-finite weights)");
      continue;
    }
    return all[i];
  }
  return dtensor::latest_checkpoint(dir);
}

}  // namespace quilt
