// Hugging Face per-expert tensors <-> our grouped tensors (StackedName rules) in consolidated
// import and export: plain and distributed targets (threads backend), the bytes a rank reads,
// sharded exports with an index, the round trip, and errors that name the expert.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "dtensor/checkpoint.h"
#include "engine/io/safetensors.h"
#include "tests/dtensor/util.h"

using namespace quilt;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kExperts = 4, kInter = 6, kHidden = 5;  // kInter = 6 splits unevenly over 4 ranks

const std::string kGate = "model.layers.0.mlp.experts.gate_proj";  // (E, I, H), f32
const std::string kDown = "model.layers.0.mlp.experts.down_proj";  // (E, H, I), bf16
const std::string kNorm = "model.norm.weight";                     // (H), not stacked

const std::vector<dtensor::StackedName> kRules = {
    {kGate, "model.layers.0.mlp.experts.{}.gate_proj.weight", kExperts},
    {kDown, "model.layers.0.mlp.experts.{}.down_proj.weight", kExperts},
};

std::string fresh_dir(const std::string& tag) {
  const fs::path p = fs::temp_directory_path() / ("quilt_stk_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::string expert(const std::string& grouped, int64_t e) {
  const std::string proj = grouped.substr(grouped.rfind('.') + 1);
  return "model.layers.0.mlp.experts." + std::to_string(e) + "." + proj + ".weight";
}

Shape expert_shape(const std::string& grouped) {
  return grouped == kGate ? Shape{kInter, kHidden} : Shape{kHidden, kInter};
}
DType dtype_of_group(const std::string& grouped) { return grouped == kGate ? DType::f32 : DType::bf16; }
Shape grouped_shape(const std::string& grouped) {
  const Shape s = expert_shape(grouped);
  return {kExperts, s[0], s[1]};
}

// The reference value of one Hugging Face tensor.
Tensor value(const std::string& name, const Shape& shape, DType dt) { return randn(shape, RngKey(7, name), {.dtype = dt}); }
Tensor expert_value(const std::string& grouped, int64_t e) {
  return value(expert(grouped, e), expert_shape(grouped), dtype_of_group(grouped));
}
// The grouped tensor the experts stack to.
Tensor grouped_value(const std::string& grouped) {
  std::vector<Tensor> xs;
  for (int64_t e = 0; e < kExperts; ++e) xs.push_back(expert_value(grouped, e));
  return stack(xs, 0);
}

// Writes a Hugging Face checkpoint with one tensor per expert: `dir`/model.safetensors, or with
// `split` the experts over two files plus model.safetensors.index.json. Returns the path to load.
std::string write_hf(const std::string& dir, bool split) {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> a, b;
  a.emplace_back(kNorm, value(kNorm, {kHidden}, DType::f32));
  for (const std::string& g : {kGate, kDown})
    for (int64_t e = 0; e < kExperts; ++e)
      (split && e >= kExperts / 2 ? b : a).emplace_back(expert(g, e), expert_value(g, e));
  if (!split) {
    save_safetensors(dir + "/model.safetensors", a, {{"format", "pt"}});
    return dir + "/model.safetensors";
  }
  save_safetensors(dir + "/model-00001-of-00002.safetensors", a, {{"format", "pt"}});
  save_safetensors(dir + "/model-00002-of-00002.safetensors", b, {{"format", "pt"}});
  nlohmann::json map = nlohmann::json::object();
  for (const auto& [n, t] : a) map[n] = "model-00001-of-00002.safetensors";
  for (const auto& [n, t] : b) map[n] = "model-00002-of-00002.safetensors";
  const nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", map}};
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  return dir + "/model.safetensors.index.json";
}

// Every block read during `fn`, as (rank, entry, start, sizes).
struct Read {
  int rank;
  std::string entry;
  Shape start, sizes;
};
std::vector<Read> reads_during(const std::function<void()>& fn) {
  std::mutex mu;
  std::vector<Read> reads;
  dtensor::detail::set_checkpoint_read_hook([&](const std::string& entry, const Shape& start, const Shape& sizes, int rank) {
    std::lock_guard<std::mutex> lock(mu);
    reads.push_back({rank, entry, start, sizes});
  });
  try {
    fn();
  } catch (...) {
    dtensor::detail::set_checkpoint_read_hook({});
    throw;
  }
  dtensor::detail::set_checkpoint_read_hook({});
  return reads;
}

}  // namespace

TEST_CASE("stacked import: per-expert Hugging Face tensors fill a plain grouped tensor with their stack") {
  const std::string root = fresh_dir("plain");
  for (bool split : {false, true}) {
    INFO((split ? "two files and an index" : "one file"));
    const std::string path = write_hf(root + (split ? "/split" : "/one"), split);
    Tensor gate = zeros(grouped_shape(kGate));
    Tensor down = zeros(grouped_shape(kDown), {.dtype = DType::bf16});
    Tensor norm = zeros({kHidden});
    dtensor::import_consolidated(path, {{kGate, gate}, {kDown, down}, {kNorm, norm}}, kRules);
    CHECK(test::max_abs_diff(gate, grouped_value(kGate)) == 0);
    CHECK(test::max_abs_diff(down, grouped_value(kDown)) == 0);
    CHECK(test::max_abs_diff(norm, value(kNorm, {kHidden}, DType::f32)) == 0);
    // A rule whose tensor is not among the targets is ignored.
    Tensor norm2 = zeros({kHidden});
    dtensor::import_consolidated(path, {{kNorm, norm2}}, kRules);
    CHECK(test::max_abs_diff(norm2, value(kNorm, {kHidden}, DType::f32)) == 0);
  }
  fs::remove_all(root);
}

TEST_CASE("stacked import: Shard(0) and Shard(1) targets on 2 and 4 ranks get their blocks, and Shard(0) reads only its experts") {
  const std::string root = fresh_dir("dist");
  const std::string path = write_hf(root, true);
  for (int ranks : {2, 4}) {
    for (int dim : {0, 1}) {
      INFO(ranks, " ranks, Shard(", dim, ")");
      const auto reads = reads_during([&] {
        run_threads_group(ranks, [&](Communicator& c) {
          DeviceMesh mesh = test::mesh_of_shape(c, {ranks});
          Tensor gate = distribute_tensor(zeros(grouped_shape(kGate)), mesh, {Shard(dim)});
          Tensor down = distribute_tensor(zeros(grouped_shape(kDown), {.dtype = DType::bf16}), mesh, {Shard(dim)});
          dtensor::import_consolidated(path, {{kGate, gate}, {kDown, down}}, kRules);
          CHECK(test::max_abs_diff(full_tensor(gate), grouped_value(kGate)) == 0);
          CHECK(test::max_abs_diff(full_tensor(down), grouped_value(kDown)) == 0);
        });
      });
      const int64_t per_rank = kExperts / ranks;
      for (const std::string& g : {kGate, kDown}) {
        for (int r = 0; r < ranks; ++r) {
          std::set<int64_t> experts;
          int64_t rows = 0;
          for (const Read& rd : reads) {
            if (rd.rank != r || rd.entry.find(g.substr(g.rfind('.'))) == std::string::npos) continue;
            for (int64_t e = 0; e < kExperts; ++e)
              if (rd.entry == expert(g, e)) experts.insert(e);
            REQUIRE(rd.sizes.size() == 2);  // an expert's block, without the leading dim
            if (dim == 0) CHECK(rd.sizes == expert_shape(g));
            rows += rd.sizes[0];
          }
          if (dim == 0) {
            std::set<int64_t> mine;
            for (int64_t e = r * per_rank; e < (r + 1) * per_rank; ++e) mine.insert(e);
            CHECK(experts == mine);
          } else {
            // Every expert, each for this rank's row range only (none for a rank left without rows).
            const int64_t expect = local_block(grouped_shape(g), {ranks}, {Shard(1)}, {r}).shape[1];
            CHECK(int64_t(experts.size()) == (expect > 0 ? kExperts : 0));
            CHECK(rows == kExperts * expect);
          }
        }
      }
    }
  }
  // A 2-D mesh: experts over one axis, rows over the other.
  run_threads_group(4, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2, 2});
    Tensor gate = distribute_tensor(zeros(grouped_shape(kGate)), mesh, {Shard(0), Shard(1)});
    dtensor::import_consolidated(path, {{kGate, gate}}, kRules);
    CHECK(test::max_abs_diff(full_tensor(gate), grouped_value(kGate)) == 0);
  });
  fs::remove_all(root);
}

TEST_CASE("stacked export: a sharded checkpoint of grouped DTensors is written as per-expert tensors and imports back equal") {
  const std::string root = fresh_dir("export");
  const std::string dir = root + "/ckpt";
  run_threads_group(4, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {4});
    dtensor::StateDict state = {{kNorm, value(kNorm, {kHidden}, DType::f32)},
                                {kGate, distribute_tensor(grouped_value(kGate), mesh, {Shard(0)})},
                                {kDown, distribute_tensor(grouped_value(kDown), mesh, {Shard(1)})}};
    dtensor::save_checkpoint(dir, state, c);
  });
  const auto one = dtensor::export_consolidated(dir, root + "/hf/model.safetensors", uint64_t(5) << 30, kRules);
  REQUIRE(one.size() == 1);
  const SafetensorsFile f = load_safetensors(one[0]);
  CHECK(f.metadata.at("format") == "pt");
  CHECK(f.names.size() == size_t(1 + 2 * kExperts));
  CHECK_FALSE(f.tensors.count(kGate));
  CHECK_FALSE(f.tensors.count(kDown));
  for (const std::string& g : {kGate, kDown})
    for (int64_t e = 0; e < kExperts; ++e) {
      INFO(expert(g, e));
      CHECK(test::max_abs_diff(f.at(expert(g, e)), expert_value(g, e)) == 0);
    }
  // The f32 experts in expert order after the norm (the bf16 ones are regrouped behind them by size).
  std::vector<std::string> f32_names;
  for (const std::string& n : f.names)
    if (f.at(n).dtype() == DType::f32) f32_names.push_back(n);
  std::vector<std::string> expect = {kNorm};
  for (int64_t e = 0; e < kExperts; ++e) expect.push_back(expert(kGate, e));
  CHECK(f32_names == expect);

  // Small shards: the experts of one grouped tensor spread over several files and the index.
  const auto many = dtensor::export_consolidated(dir, root + "/hf2/model.safetensors", 2 * kInter * kHidden * 4, kRules);
  REQUIRE(many.size() > 3);
  CHECK(many.back() == root + "/hf2/model.safetensors.index.json");
  std::ifstream idx(many.back());
  const nlohmann::json index = nlohmann::json::parse(idx);
  const nlohmann::json& wm = index.at("weight_map");
  CHECK(wm.size() == size_t(1 + 2 * kExperts));
  CHECK_FALSE(wm.contains(kGate));
  CHECK(wm.at(expert(kGate, 0)) != wm.at(expert(kGate, kExperts - 1)));
  const int64_t total = kHidden * 4 + kExperts * kInter * kHidden * (4 + 2);
  CHECK(index.at("metadata").at("total_size").get<int64_t>() == total);

  // Round trip: both exports import back into other layouts equal to what was saved.
  for (const std::string& path : {one[0], many.back()}) {
    INFO(path);
    run_threads_group(2, [&](Communicator& c) {
      DeviceMesh mesh = test::mesh_of_shape(c, {2});
      Tensor gate = distribute_tensor(zeros(grouped_shape(kGate)), mesh, {Shard(2)});
      Tensor down = distribute_tensor(zeros(grouped_shape(kDown), {.dtype = DType::bf16}), mesh, {Shard(0)});
      dtensor::import_consolidated(path, {{kGate, gate}, {kDown, down}}, kRules);
      CHECK(test::max_abs_diff(full_tensor(gate), grouped_value(kGate)) == 0);
      CHECK(test::max_abs_diff(full_tensor(down), grouped_value(kDown)) == 0);
    });
  }
  // Without rules the export still holds the grouped tensors (nothing changed for other callers).
  const auto plain = dtensor::export_consolidated(dir, root + "/hf3/model.safetensors");
  CHECK(load_safetensors(plain[0]).tensors.count(kGate) == 1);
  fs::remove_all(root);
}

TEST_CASE("stacked import: a missing expert, an expert of the wrong shape or dtype and a bad rule are named") {
  const std::string root = fresh_dir("errors");
  std::vector<std::pair<std::string, Tensor>> ts;
  for (int64_t e = 0; e < kExperts; ++e)
    if (e != 3) ts.emplace_back(expert(kGate, e), expert_value(kGate, e));
  ts.emplace_back(expert(kDown, 0), expert_value(kDown, 0));
  ts.emplace_back(expert(kDown, 1), value("odd", {kHidden, kInter + 1}, DType::bf16));  // wrong shape
  ts.emplace_back(expert(kDown, 2), value("f32", {kHidden, kInter}, DType::f32));       // wrong dtype
  ts.emplace_back(expert(kDown, 3), expert_value(kDown, 3));
  const std::string path = root + "/model.safetensors";
  save_safetensors(path, ts);

  // Expert 3 is rank 1's to read, and rank 0 reports it missing too: the file is damaged.
  run_threads_group(2, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2});
    Tensor gate = distribute_tensor(zeros(grouped_shape(kGate)), mesh, {Shard(0)});
    const std::string missing = "[import_consolidated] tensor 'model.layers.0.mlp.experts.3.gate_proj.weight' (expert 3 of '" +
                                kGate + "') is not in " + path + " (rank " + std::to_string(c.rank()) + ")";
    CHECK_THROWS_WITH_AS(dtensor::import_consolidated(path, {{kGate, gate}}, kRules), doctest::Contains(missing.c_str()),
                         Error);
  });
  Tensor down = zeros(grouped_shape(kDown), {.dtype = DType::bf16});
  const std::string shape = "tensor 'model.layers.0.mlp.experts.1.down_proj.weight' (expert 1 of '" + kDown +
                            "') has shape (5, 7) in " + path + " but the target's shape (4, 5, 6) needs (5, 6) per expert";
  CHECK_THROWS_WITH_AS(dtensor::import_consolidated(path, {{kDown, down}}, kRules), doctest::Contains(shape.c_str()), Error);

  // Expert 1 fixed: expert 2 is f32 among bf16 experts.
  for (auto& [n, t] : ts)
    if (n == expert(kDown, 1)) t = expert_value(kDown, 1);
  save_safetensors(path, ts);
  CHECK_THROWS_WITH_AS(dtensor::import_consolidated(path, {{kDown, down}}, kRules),
                       doctest::Contains(("(expert 2 of '" + kDown + "') has dtype f32 in " + path +
                                         " but expert 0 ('model.layers.0.mlp.experts.0.down_proj.weight') has dtype bf16")
                                            .c_str()),
                       Error);

  // The target's dim 0 must be the rule's count; a pattern needs one "{}".
  Tensor three = zeros({3, kHidden, kInter}, {.dtype = DType::bf16});
  CHECK_THROWS_WITH_AS(dtensor::import_consolidated(path, {{kDown, three}}, kRules),
                       doctest::Contains(("target '" + kDown + "' has shape (3, 5, 6) but its rule stacks 4 experts").c_str()),
                       Error);
  CHECK_THROWS_WITH_AS(dtensor::import_consolidated(path, {{kDown, down}}, {{kDown, "experts.down_proj", 4}}),
                       doctest::Contains("which must hold \"{}\" exactly once"), Error);
  fs::remove_all(root);
}

TEST_CASE("stacked export: a rule must name a tensor of the checkpoint with its count along dim 0") {
  const std::string root = fresh_dir("export_errors");
  const std::string dir = root + "/ckpt";
  run_threads_group(2, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2});
    dtensor::save_checkpoint(dir, {{kGate, distribute_tensor(grouped_value(kGate), mesh, {Shard(0)})}}, c);
  });
  const std::string out = root + "/hf/model.safetensors";
  CHECK_THROWS_WITH_AS(dtensor::export_consolidated(dir, out, uint64_t(5) << 30, {{"nope", "nope.{}", 4}}),
                       doctest::Contains("[export_consolidated] the rule for 'nope' names no tensor of checkpoint"), Error);
  CHECK_THROWS_WITH_AS(dtensor::export_consolidated(dir, out, uint64_t(5) << 30, {{kGate, "x.{}", 8}}),
                       doctest::Contains(("tensor '" + kGate + "' has shape (4, 6, 5) in checkpoint " + dir +
                                          " but its rule stacks 8 experts along dim 0")
                                             .c_str()),
                       Error);
  CHECK_FALSE(fs::exists(out));
  fs::remove_all(root);
}
