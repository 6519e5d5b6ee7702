// Trainer checkpoints: see checkpointing.h.
#include "tools/checkpointing.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

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

void save_checkpoint(Run& r, const std::string& root) {
  const std::string dir = (fs::path(root) / step_dir_name(r.step_count)).string();
  if (r.world->rank() == 0) fs::create_directories(root);
  r.world->barrier();
  dtensor::StateDict state;
  for (auto& [name, t] : r.model->state_dict()) state.emplace_back("model." + name, t);
  OptimizerState os = r.opt->state_dict();
  for (auto& [name, t] : os.tensors) state.emplace_back("optim." + name, t);
  std::map<std::string, std::string> meta;
  for (auto& [name, v] : os.scalars) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    meta["optim." + name] = buf;
  }
  meta["trainer.step"] = std::to_string(r.step_count);
  meta["trainer.loader"] = r.loader->state().to_json();
  meta["trainer.layout"] = r.dims.mesh_string();
  meta["trainer.recipe"] = recipe_to_yaml(r.cfg);
  dtensor::save_checkpoint(dir, state, *r.world, meta);
  if (r.world->rank() == 0 && r.cfg.checkpoint.keep_last > 0) {
    std::vector<std::string> all;
    for (const auto& e : fs::directory_iterator(root)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("step_", 0) == 0 && n.find(".tmp") == std::string::npos) all.push_back(e.path().string());
    }
    std::sort(all.begin(), all.end());
    for (size_t i = 0; i + size_t(r.cfg.checkpoint.keep_last) < all.size(); ++i) fs::remove_all(all[i]);
  }
  r.world->barrier();
  log_line("checkpoint: saved ", dir);
}

void load_checkpoint(Run& r, const std::string& dir) {
  const dtensor::CheckpointInfo info = dtensor::read_checkpoint_info(dir);
  dtensor::StateDict targets;
  for (auto& [name, t] : r.model->state_dict()) targets.emplace_back("model." + name, t);
  // Optimizer moments take their parameter's layout; their names are "optim.state.<param>.<buffer>".
  std::map<std::string, Tensor> by_name;
  for (const Tensor& p : r.params) by_name[p.name()] = p;
  OptimizerState os;
  for (const auto& ti : info.tensors) {
    if (ti.name.rfind("optim.", 0) != 0) continue;
    const std::string key = ti.name.substr(6);
    const std::string rest = key.rfind("state.", 0) == 0 ? key.substr(6) : key;
    const auto dot = rest.rfind('.');
    auto it = by_name.find(dot == std::string::npos ? rest : rest.substr(0, dot));
    QUILT_CHECK(it != by_name.end(), "[checkpoint] ", dir, ": optimizer tensor '", ti.name,
                "' belongs to no parameter of this model");
    const Tensor& p = it->second;
    Tensor local = zeros(p.local().shape(), {.dtype = ti.dtype, .device = p.device()});
    Tensor t = p.is_distributed() ? Tensor::make_distributed(local, p.dist_spec(), p.shape()) : local;
    targets.emplace_back(ti.name, t);
    os.tensors.insert(key, t);
  }
  dtensor::load_checkpoint(dir, targets);
  for (auto& [k, v] : info.metadata)
    if (k.rfind("optim.", 0) == 0) os.scalars.insert(k.substr(6), std::stod(v));
  r.opt->load_state_dict(os);
  r.step_count = std::stoll(info.metadata.at("trainer.step"));
  r.loader->load_state(LoaderState::from_json(info.metadata.at("trainer.loader")));
  log_line("checkpoint: resumed from ", dir, " at step ", r.step_count, " (saved as ", info.metadata.at("trainer.layout"),
           ")");
}

void export_consolidated(Run& r, const std::string& root) {
  if (r.world->rank() == 0) {
    // HF layout: the model tensors with HF names (the trainer's "model." prefix dropped, the
    // optimizer state left out) and config.json.
    const std::string src = (fs::path(root) / step_dir_name(r.step_count)).string();
    const fs::path out = fs::path(root) / "hf";
    fs::create_directories(out);
    const std::string all_path = (out / "model.all.safetensors").string();
    // Grouped experts go out as HF's one tensor per expert.
    std::vector<dtensor::StackedName> stacks;
    for (const ExpertStack& e : expert_stacks(*r.model)) stacks.push_back({"model." + e.name, "model." + e.pattern, e.count});
    dtensor::export_consolidated(src, all_path, uint64_t(5) << 30, stacks);
    SafetensorsFile all = load_safetensors(all_path, {.mmap = false});
    std::vector<std::pair<std::string, Tensor>> model;
    for (const std::string& name : all.names)
      if (name.rfind("model.", 0) == 0) model.emplace_back(name.substr(6), all.tensors.at(name));
    save_safetensors((out / "model.safetensors").string(), model, {{"format", "pt"}});
    fs::remove(all_path);
    std::ofstream((out / "config.json").string()) << llama_config(r.cfg.model).to_json();
    log_line("checkpoint: consolidated HF weights in ", out.string());
  }
  r.world->barrier();
}

std::string latest_checkpoint(const std::string& dir) {
  if (dir.empty() || !fs::exists(dir)) return "";
  return dtensor::latest_checkpoint(dir);
}

}  // namespace quilt
