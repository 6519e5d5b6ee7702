// Distributed checkpoints in one process (threads backend): save at one world size, load at
// others and into other meshes and placements; odd shapes; errors that name the tensor and rank;
// an interrupted save never looks complete and leaves no .tmp; Hugging Face export and import.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "dtensor/checkpoint.h"
#include "tests/dtensor/util.h"

using namespace quilt;
namespace fs = std::filesystem;

namespace {

std::string fresh_dir(const std::string& tag) {
  const fs::path p = fs::temp_directory_path() / ("quilt_dt_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// The reference values of every tensor in these tests.
Tensor value(const std::string& name, const Shape& shape, DType dt = DType::f32) {
  return randn(shape, RngKey(42, name), {.dtype = dt});
}

struct Spec {
  std::string name;
  Shape shape;
  DType dtype;
};
const std::vector<Spec> kSpecs = {{"w", {5, 3}, DType::f32},   {"tiny", {2, 7}, DType::f32},  // 2 < world size
                                  {"big", {9, 4}, DType::bf16}, {"bias", {3}, DType::f64},
                                  {"empty", {0, 4}, DType::f32}, {"scalar", {}, DType::f32}};

// Saves kSpecs from a mesh of `mesh_shape` with the given placements per tensor.
void save_all(const std::string& dir, const Shape& mesh_shape, const std::vector<Placements>& pl) {
  run_threads_group(int(numel_of(mesh_shape)), [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, mesh_shape);
    dtensor::StateDict state;
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const Spec& s = kSpecs[i];
      Tensor v = value(s.name, s.shape, s.dtype);
      state.emplace_back(s.name, pl[i].empty() ? v : test::make_dist(v, mesh, pl[i], 5));
    }
    dtensor::save_checkpoint(dir, state, c, {{"step", "7"}});
  });
}

// Loads every tensor into zeros laid out by `pl` on a mesh of `mesh_shape` and checks the values.
void load_and_check(const std::string& dir, const Shape& mesh_shape, const std::vector<Placements>& pl) {
  run_threads_group(int(numel_of(mesh_shape)), [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, mesh_shape);
    dtensor::StateDict targets;
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const Spec& s = kSpecs[i];
      Tensor z = zeros(s.shape, {.dtype = s.dtype});
      targets.emplace_back(s.name, pl[i].empty() ? z : distribute_tensor(z, mesh, pl[i]));
    }
    dtensor::load_checkpoint(dir, targets);
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      INFO(kSpecs[i].name, " ", pl[i].empty() ? std::string("plain") : str(pl[i]), " on ", mesh_shape);
      // Exact, except the f64 "bias", which the saves hold as Partial with random pieces.
      const double tol = kSpecs[i].dtype == DType::f64 ? 1e-12 : 0.0;
      CHECK(test::max_abs_diff(full_tensor(targets[i].second), value(kSpecs[i].name, kSpecs[i].shape, kSpecs[i].dtype)) <=
            tol);
    }
  });
}

// Number of chunks the index lists (counted from the text: one "file" key per chunk).
size_t index_chunk_count(const std::string& dir) {
  std::ifstream f(dir + "/index.json");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  size_t n = 0;
  for (size_t at = text.find("\"file\""); at != std::string::npos; at = text.find("\"file\"", at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("checkpoint: saved at 4 ranks, loads at 2 and 8 ranks and into a 2-D mesh") {
  const std::string root = fresh_dir("reshard");
  const std::string dir = root + "/step-1";
  save_all(dir, {4}, {{Shard(0)}, {Shard(1)}, {Shard(0)}, {Partial()}, {Shard(0)}, {}});
  CHECK(fs::is_regular_file(dir + "/index.json"));
  CHECK_FALSE(fs::exists(dir + ".tmp"));
  const auto info = dtensor::read_checkpoint_info(dir);
  CHECK(info.world_size == 4);
  CHECK(info.metadata.at("step") == "7");
  CHECK(info.tensors[0].placements == "(S(0))");
  CHECK(info.tensors[3].placements == "(R)");  // Partial was reduced before saving
  load_and_check(dir, {2}, {{Shard(1)}, {Shard(0)}, {Replicate()}, {Shard(0)}, {Replicate()}, {}});
  load_and_check(dir, {8}, {{Shard(0)}, {Shard(0)}, {Shard(1)}, {Shard(0)}, {Shard(1)}, {Replicate()}});
  load_and_check(dir, {2, 4}, {{Shard(0), Shard(1)}, {Shard(1), Shard(0)}, {Partial(), Shard(0)}, {Replicate(), Shard(0)},
                               {Shard(0), Shard(0)}, {Partial(ReduceOp::max), Replicate()}});
  load_and_check(dir, {1}, {{}, {}, {}, {}, {}, {}});  // one process, plain tensors
  // And saved from a 2-D mesh with nested shards, loaded at 3 ranks.
  const std::string dir2 = root + "/step-2";
  save_all(dir2, {2, 2},
           {{Shard(0), Shard(0)}, {Replicate(), Shard(1)}, {Shard(1), Shard(0)}, {Partial(), Shard(0)}, {Shard(1), Replicate()}, {}});
  load_and_check(dir2, {3}, {{Shard(0)}, {Shard(1)}, {Shard(0)}, {Shard(0)}, {Replicate()}, {}});
  CHECK(dtensor::latest_checkpoint(root) == dir2);
  fs::remove_all(root);
}

TEST_CASE("checkpoint: a tensor on a sub-mesh is stored once although every replica holds it") {
  const std::string root = fresh_dir("submesh");
  run_threads_group(4, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2, 2});
    Tensor t = distribute_tensor(value("t", {5, 3}), mesh["a1"], {Shard(0)});  // replicated over a0
    dtensor::save_checkpoint(root + "/ckpt", {{"t", t}}, c);
  });
  const auto idx = index_chunk_count(root + "/ckpt");
  CHECK(idx == 2);
  run_threads_group(3, [&](Communicator& c) {
    Tensor t = distribute_tensor(zeros({5, 3}), test::mesh_of_shape(c, {3}), {Shard(1)});
    dtensor::load_checkpoint(root + "/ckpt", {{"t", t}});
    CHECK(test::max_abs_diff(full_tensor(t), value("t", {5, 3})) == 0);
  });
  fs::remove_all(root);
}

TEST_CASE("checkpoint: errors name the tensor and the rank") {
  const std::string root = fresh_dir("errors");
  const std::string dir = root + "/ckpt";
  save_all(dir, {2}, {{Shard(0)}, {Shard(1)}, {Shard(0)}, {Replicate()}, {Shard(0)}, {}});
  run_threads_group(2, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2});
    const std::string r = "(rank " + std::to_string(c.rank()) + ")";
    Tensor t = distribute_tensor(zeros({5, 3}), mesh, {Shard(0)});
    const std::string missing = "[load_checkpoint] tensor 'nope' is not in checkpoint " + dir + " " + r;
    CHECK_THROWS_WITH_AS(dtensor::load_checkpoint(dir, {{"nope", t}}), doctest::Contains(missing.c_str()), Error);
    Tensor u = distribute_tensor(zeros({4, 3}), mesh, {Shard(0)});
    const std::string mismatch =
        "tensor 'w' has shape (5, 3) in checkpoint " + dir + " but the target has shape (4, 3) " + r;
    CHECK_THROWS_WITH_AS(dtensor::load_checkpoint(dir, {{"w", u}}), doctest::Contains(mismatch.c_str()), Error);
  });
  // A truncated shard file: the rank that needs its bytes names the tensor and itself.
  const std::string f = dir + "/rank-00001.safetensors";
  fs::resize_file(f, fs::file_size(f) - 8);
  run_threads_group(2, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2});
    Tensor t = distribute_tensor(zeros({5, 3}), mesh, {Shard(0)});
    if (c.rank() == 1)
      CHECK_THROWS_WITH_AS(dtensor::load_checkpoint(dir, {{"w", t}}),
                           doctest::Contains(("[load_checkpoint] rank 1: " + f + ": tensor 'w' chunk at offset (3, 0): [safetensors]").c_str()),
                           Error);
    else
      dtensor::load_checkpoint(dir, {{"w", t}});  // rank 0's rows are all in rank 0's file
  });
  CHECK_THROWS_WITH_AS(dtensor::load_checkpoint(root + "/missing", {}), doctest::Contains("is not a complete checkpoint"),
                       Error);
  fs::remove_all(root);
}

TEST_CASE("checkpoint: a rank failing mid-save leaves the previous checkpoint as the latest complete one") {
  const std::string root = fresh_dir("crash");
  save_all(root + "/step-1", {4}, {{Shard(0)}, {Shard(1)}, {Shard(0)}, {Replicate()}, {Shard(0)}, {}});
  // Rank 2 writes half of its file and dies (an exception here; SIGKILL in the mpiexec suite).
  dtensor::detail::set_checkpoint_fault_hook([](const std::string& path, int rank) {
    if (rank != 2) return;
    std::ofstream(path) << "partial bytes of a shard";
    throw Error("rank 2 was killed");
  });
  CHECK_THROWS_WITH_AS(save_all(root + "/step-2", {4}, {{Shard(0)}, {Shard(1)}, {Shard(0)}, {Replicate()}, {Shard(0)}, {}}),
                       doctest::Contains("nothing was committed"), Error);
  dtensor::detail::set_checkpoint_fault_hook({});
  CHECK_FALSE(fs::exists(root + "/step-2.tmp"));  // removed once the ranks agreed the save failed
  CHECK_FALSE(fs::exists(root + "/step-2"));
  CHECK(dtensor::latest_checkpoint(root) == root + "/step-1");
  load_and_check(dtensor::latest_checkpoint(root), {2}, {{Shard(0)}, {}, {}, {}, {}, {}});
  // The next save to the same name clears the leftovers and commits.
  save_all(root + "/step-2", {2}, {{Shard(0)}, {Shard(1)}, {Shard(0)}, {Replicate()}, {Shard(0)}, {}});
  CHECK(dtensor::latest_checkpoint(root) == root + "/step-2");
  CHECK_FALSE(fs::exists(root + "/step-2.tmp"));
  fs::remove_all(root);
}

TEST_CASE("checkpoint: consolidated Hugging Face export and import, one file or sharded with an index") {
  const std::string root = fresh_dir("hf");
  const std::string dir = root + "/ckpt";
  save_all(dir, {4}, {{Shard(0)}, {Shard(1)}, {Shard(0)}, {Replicate()}, {Shard(0)}, {}});
  const auto one = dtensor::export_consolidated(dir, root + "/hf/model.safetensors");
  REQUIRE(one.size() == 1);
  SafetensorsFile f = load_safetensors(one[0]);
  CHECK(f.metadata.at("format") == "pt");
  for (const Spec& s : kSpecs) CHECK(test::max_abs_diff(f.at(s.name), value(s.name, s.shape, s.dtype)) == 0);
  // Small shards: several files and model.safetensors.index.json.
  const auto many = dtensor::export_consolidated(dir, root + "/hf2/model.safetensors", 64);
  CHECK(many.size() > 2);
  CHECK(many.back() == root + "/hf2/model.safetensors.index.json");
  for (const std::string& path : {one[0], many.back()}) {
    run_threads_group(4, [&](Communicator& c) {
      DeviceMesh mesh = test::mesh_of_shape(c, {2, 2});
      Tensor w = distribute_tensor(zeros({5, 3}), mesh, {Shard(1), Shard(0)});
      Tensor big = distribute_tensor(zeros({9, 4}, {.dtype = DType::bf16}), mesh, {Shard(0), Shard(0)});
      dtensor::import_consolidated(path, {{"w", w}, {"big", big}});
      CHECK(test::max_abs_diff(full_tensor(w), value("w", {5, 3})) == 0);
      CHECK(test::max_abs_diff(full_tensor(big), value("big", {9, 4}, DType::bf16)) == 0);
      CHECK_THROWS_WITH_AS(dtensor::import_consolidated(path, {{"missing", w}}),
                           doctest::Contains("[import_consolidated] tensor 'missing' is not in"), Error);
    });
  }
  fs::remove_all(root);
}
