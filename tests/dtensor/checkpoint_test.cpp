// Distributed checkpoints in one process (threads backend): save at one world size, load at
// others and into other meshes and placements; odd shapes; errors that name the tensor and rank;
// an interrupted save never looks complete and leaves no .tmp; Hugging Face export and import;
// a damaged checkpoint (flipped bits, an index pointing at the wrong file, NaN, a malformed
// index field) never loads silently.
#include <doctest/doctest.h>

#define XXH_INLINE_ALL  // the tests fix up a chunk's checksum themselves
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <map>
#include <set>
#include <sstream>

#include "dtensor/checkpoint.h"
#include "engine/io/safetensors.h"
#include "tests/dtensor/util.h"

using namespace quilt;
namespace fs = std::filesystem;
using json = nlohmann::json;

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

// ---- a damaged checkpoint never loads silently ----

namespace {

// The kSpecs placements of a save at 2 ranks: "w" (5, 3) is rows 0..2 in rank 0's file (the chunk
// at (0, 0)) and rows 3..4 in rank 1's (the chunk at (3, 0)).
const std::vector<Placements> kTwoRanks = {{Shard(0)}, {Shard(1)}, {Shard(0)}, {Replicate()}, {Shard(0)}, {}};

// A checkpoint of kSpecs saved at 2 ranks (kTwoRanks) in a fresh directory, removed at the end.
struct SavedCheckpoint {
  std::string root, dir;
  explicit SavedCheckpoint(const std::string& tag) : root(fresh_dir(tag)), dir(root + "/ckpt") {
    save_all(dir, {2}, kTwoRanks);
  }
  ~SavedCheckpoint() { fs::remove_all(root); }
};

json read_index(const std::string& dir) { return json::parse(std::ifstream(dir + "/index.json")); }
void write_index(const std::string& dir, const json& j) { std::ofstream(dir + "/index.json") << j.dump(1); }

// The index entry of tensor `name`.
json& index_tensor(json& index, const std::string& name) {
  for (json& t : index.at("tensors"))
    if (t.at("name") == name) return t;
  FAIL("no tensor " << name << " in the index");
  throw;
}

// Flips one bit of byte `k` of tensor `name`'s data in a safetensors file (the header stays valid).
void flip_bit(const std::string& path, const std::string& name, uint64_t k) {
  const SafetensorsIndex idx = read_safetensors_index(path);
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(idx.data_start + idx.at(name).begin + k));
  const char c = char(f.get() ^ 0x10);
  f.seekp(std::streamoff(idx.data_start + idx.at(name).begin + k));
  f.put(c);
}

// Rewrites tensor `name` of shard `file` of checkpoint `dir` through `edit` and stores the new
// bytes' checksum in the file and the index, as a save would have: only a check of the values
// themselves can tell.
void rewrite_chunk(const std::string& dir, const std::string& file, const std::string& name,
                   const std::function<void(Tensor&)>& edit) {
  SafetensorsFile sf = load_safetensors(dir + "/" + file, {.mmap = false});
  Tensor& t = sf.tensors.at(name);
  edit(t);
  char sum[17];
  std::snprintf(sum, sizeof sum, "%016llx", static_cast<unsigned long long>(XXH3_64bits(t.data_ptr(), t.nbytes())));
  json sums = json::parse(sf.metadata.at("quilt.xxh3_64"));
  sums[name] = sum;
  sf.metadata["quilt.xxh3_64"] = sums.dump();
  std::vector<std::pair<std::string, Tensor>> ts;
  for (const std::string& n : sf.names) ts.emplace_back(n, sf.tensors.at(n));
  save_safetensors(dir + "/" + file, ts, sf.metadata);
  json index = read_index(dir);
  for (json& c : index_tensor(index, name).at("chunks"))
    if (c.at("file") == file) c["xxh3_64"] = sum;
  write_index(dir, index);
}

// Rank -> the error it must throw; "{rank}" stands for "rank R".
using RankErrors = std::map<int, std::string>;
RankErrors every(const std::set<int>& ranks, const std::string& error) {
  RankErrors out;
  for (int r : ranks) out[r] = error;
  return out;
}

// Loads tensor `name` of kSpecs laid out by `pl` at `n` ranks: the ranks in `errors` must throw
// their error, the others load the saved values.
void expect_load_failure(const std::string& dir, int n, const Placements& pl, const RankErrors& errors,
                         const std::string& name = "w") {
  const Spec& s = *std::find_if(kSpecs.begin(), kSpecs.end(), [&](const Spec& x) { return x.name == name; });
  run_threads_group(n, [&](Communicator& c) {
    const DeviceMesh mesh = test::mesh_of_shape(c, {n});
    Tensor t = distribute_tensor(zeros(s.shape, {.dtype = s.dtype}), mesh, pl);
    const Tensor want = distribute_tensor(value(s.name, s.shape, s.dtype), mesh, pl);
    const auto e = errors.find(c.rank());
    if (e == errors.end()) {
      dtensor::load_checkpoint(dir, {{name, t}});
      CHECK(test::max_abs_diff(t.local(), want.local()) == 0);  // no collective: the other ranks fail
      return;
    }
    std::string text = e->second;
    if (const size_t at = text.find("{rank}"); at != std::string::npos)
      text.replace(at, 6, "rank " + std::to_string(c.rank()));
    CHECK_THROWS_WITH_AS(dtensor::load_checkpoint(dir, {{name, t}}), doctest::Contains(text.c_str()), Error);
  });
}

}  // namespace

TEST_CASE("checkpoint: a bit flipped in a shard's data fails the load, naming the file, tensor, chunk and rank") {
  const SavedCheckpoint ck("flip");
  const std::string& dir = ck.dir;
  const std::string f = dir + "/rank-00001.safetensors";
  flip_bit(f, "w", 13);  // in row 4
  const std::string damaged = "[load_checkpoint] {rank}: " + f +
                              ": tensor 'w' chunk at offset (3, 0): checksum mismatch (the file is damaged or was "
                              "changed after saving)";
  // As saved, only rank 1 reads that chunk.
  expect_load_failure(dir, 2, {Shard(0)}, every({1}, damaged));
  // Resharded to columns every rank reads a part of it, and verifies all of it.
  expect_load_failure(dir, 3, {Shard(1)}, every({0, 1, 2}, damaged));
  // At 4 ranks, rows 0..1, 2..3, 4 and none: rank 1 reads only row 3 of that chunk, rank 3 nothing.
  expect_load_failure(dir, 4, {Shard(0)}, every({1, 2}, damaged));
}

TEST_CASE("checkpoint: an index that disagrees with a shard file fails, naming the index, the tensor and both values") {
  const SavedCheckpoint ck("swap");
  const std::string& dir = ck.dir;
  const json saved = read_index(dir);
  const std::string files = "[load_checkpoint] {rank}: " + dir + "/rank-0000";
  const std::string disagree = ": " + dir + "/index.json and this file disagree on the chunk's ";
  // The two `file` values of "w" swapped: each rank's chunk now names the other rank's file.
  json index = saved;
  json& chunks = index_tensor(index, "w").at("chunks");
  std::swap(chunks[0]["file"], chunks[1]["file"]);
  write_index(dir, index);
  expect_load_failure(dir, 2, {Shard(0)},
                      {{0, files + "1.safetensors: tensor 'w' chunk at offset (0, 0)" + disagree +
                               "offset: (0, 0) in the index, (3, 0) in the file"},
                       {1, files + "0.safetensors: tensor 'w' chunk at offset (3, 0)" + disagree +
                               "offset: (3, 0) in the index, (0, 0) in the file"}});
  // A dtype changed in the index; a chunk placed in a file that lacks the tensor.
  index = saved;
  index_tensor(index, "big")["dtype"] = "F16";
  write_index(dir, index);
  expect_load_failure(dir, 2, {Replicate()},
                      every({0, 1}, files + "0.safetensors: tensor 'big' chunk at offset (0, 0)" + disagree +
                                        "dtype: f16 in the index, bf16 in the file"),
                      "big");
  index = saved;
  index_tensor(index, "scalar").at("chunks")[0]["file"] = "rank-00001.safetensors";
  write_index(dir, index);
  expect_load_failure(dir, 2, {Replicate()},
                      every({0, 1}, files + "1.safetensors: tensor 'scalar' chunk at offset (): " + dir +
                                        "/index.json places the chunk in this file, which holds no tensor 'scalar'"),
                      "scalar");
}

TEST_CASE("checkpoint: a NaN written into a shard with its checksum fixed up fails the finite check") {
  const SavedCheckpoint ck("nanfile");
  const std::string& dir = ck.dir;
  rewrite_chunk(dir, "rank-00000.safetensors", "w", [](Tensor& t) { t.data<float>()[4] = NAN; });  // (1, 1)
  const std::string nan = "[load_checkpoint] {rank}: " + dir +
                          "/rank-00000.safetensors: tensor 'w' chunk at offset (0, 0): element (1, 1) is NaN (a "
                          "floating tensor must load finite values)";
  expect_load_failure(dir, 2, {Shard(0)}, every({0}, nan));
  expect_load_failure(dir, 5, {Shard(0)}, every({0, 1, 2}, nan));  // rows 0, 1, 2 are in that chunk
}

TEST_CASE("checkpoint: a tensor saved with a NaN or an Inf fails the load, naming the element") {
  const std::string root = fresh_dir("nansave");
  const std::string dir = root + "/ckpt";
  run_threads_group(2, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2});
    Tensor w = value("w", {5, 3}), big = value("big", {9, 4}, DType::bf16);
    w.narrow(0, 4, 1).narrow(1, 1, 1).fill_(NAN);
    big.narrow(0, 7, 1).narrow(1, 2, 1).fill_(-INFINITY);
    dtensor::save_checkpoint(dir, {{"w", distribute_tensor(w, mesh, {Shard(0)})}, {"big", distribute_tensor(big, mesh, {Shard(0)})}},
                             c);
  });
  const std::string file = "[load_checkpoint] {rank}: " + dir + "/rank-00001.safetensors: tensor ";
  expect_load_failure(dir, 2, {Shard(0)}, every({1}, file + "'w' chunk at offset (3, 0): element (4, 1) is NaN"));
  expect_load_failure(dir, 2, {Replicate()}, every({0, 1}, file + "'big' chunk at offset (5, 0): element (7, 2) is -Inf"),
                      "big");
  fs::remove_all(root);
}

TEST_CASE("checkpoint: every index field is type-checked, and the error names the field") {
  const SavedCheckpoint ck("fields");
  const std::string& dir = ck.dir;
  const json saved = read_index(dir);
  struct Case {
    std::function<void(json&)> edit;
    std::string error;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["tensors"][0]["chunks"][0]["offset"] = json::array({0.5, 0}); },
       "tensors[0].chunks[0].offset must be an array of non-negative integers"},
      {[](json& j) { j["tensors"][0]["chunks"][1]["shape"] = "(2, 3)"; },
       "tensors[0].chunks[1].shape must be an array of non-negative integers"},
      {[](json& j) { j["format"] = "quilt-dcp/9"; },
       "format 'quilt-dcp/9' is not one this build reads (quilt-dcp/2, or quilt-dcp/1 without checksums)"},
      {[](json& j) { j["tensors"][1].erase("dtype"); }, "tensors[1].dtype is missing"},
      {[](json& j) { j["tensors"][1]["dtype"] = "F8"; }, "tensors[1].dtype"},
      {[](json& j) { j["world_size"] = "2"; }, "world_size must be a positive integer"},
      {[](json& j) { j["metadata"]["step"] = 7; }, "metadata.step must be a string"},
      {[](json& j) { j["tensors"] = json::object(); }, "tensors must be an array"},
      {[](json& j) { j["tensors"][2]["name"] = "w"; }, "tensors[2].name 'w' appears twice"},
      {[](json& j) { j["tensors"][0]["chunks"][1].erase("xxh3_64"); }, "tensors[0].chunks[1].xxh3_64 is missing"},
      {[](json& j) { j["tensors"][0]["chunks"][1]["xxh3_64"] = "xyz"; },
       "tensors[0].chunks[1].xxh3_64 must be 16 lowercase hex digits, not 'xyz'"},
      {[](json& j) { j["tensors"][0]["chunks"][1]["offset"] = json::array({4, 0}); },
       "tensors[0].chunks[1] (rank-00001.safetensors, offset (4, 0), shape (2, 3)) is not inside the tensor's shape (5, 3)"},
      {[](json& j) { j["tensors"][0]["chunks"].erase(1); }, "tensors[0].chunks hold 9 of the tensor's 15 elements"},
      {[&](json& j) { j["tensors"][0]["chunks"][0]["file"] = "../x.safetensors"; },
       "tensors[0].chunks[0].file must name a file in " + dir + ", not '../x.safetensors'"},
  };
  for (const Case& c : cases) {
    json j = saved;
    c.edit(j);
    write_index(dir, j);
    const std::string error = "[read_checkpoint_info] " + dir + "/index.json: " + c.error;
    CHECK_THROWS_WITH_AS(dtensor::read_checkpoint_info(dir), doctest::Contains(error.c_str()), Error);
  }
  write_index(dir, saved);
  load_and_check(dir, {1}, {{}, {}, {}, {}, {}, {}});
}

TEST_CASE("checkpoint: an index of format quilt-dcp/1, from before checksums, still loads") {
  const SavedCheckpoint ck("v1");
  const std::string& dir = ck.dir;
  json index = read_index(dir);
  index["format"] = "quilt-dcp/1";
  for (json& t : index.at("tensors"))
    for (json& c : t.at("chunks")) c.erase("xxh3_64");
  write_index(dir, index);
  load_and_check(dir, {3}, {{Shard(1)}, {Shard(0)}, {Replicate()}, {Shard(0)}, {Replicate()}, {}});
}

TEST_CASE("checkpoint: a failed save leaves no .tmp, and the checkpoint it would have replaced loads as before") {
  const std::string root = fresh_dir("failsave");
  const std::string dir = root + "/step-1";
  save_all(dir, {2}, kTwoRanks);
  // Rank 0's disk is full: every rank throws; rank 0 removes the temporary directory.
  dtensor::detail::set_checkpoint_fault_hook([](const std::string&, int rank) {
    if (rank == 0) throw Error("no space left on device");
  });
  CHECK_THROWS_WITH_AS(save_all(dir, {2}, {{Shard(1)}, {}, {}, {}, {}, {}}),
                       doctest::Contains("failed while writing its shards"), Error);
  dtensor::detail::set_checkpoint_fault_hook({});
  CHECK_FALSE(fs::exists(dir + ".tmp"));
  CHECK_FALSE(fs::exists(dir + ".old"));
  load_and_check(dir, {2}, {{Shard(0)}, {}, {}, {}, {}, {}});
  // One rank's undefined tensor fails every rank, before any collective.
  run_threads_group(2, [&](Communicator& c) {
    Tensor t = c.rank() == 1 ? Tensor() : zeros({2});
    const std::string mine = "[save_checkpoint] " + root + "/step-2: rank 1 failed while checking its tensors: "
                             "[save_checkpoint] tensor 't' is undefined (nothing was committed)";
    const std::string other = "[save_checkpoint] " + root + "/step-2: another rank failed while checking its tensors";
    CHECK_THROWS_WITH_AS(dtensor::save_checkpoint(root + "/step-2", {{"t", t}}, c),
                         doctest::Contains((c.rank() == 1 ? mine : other).c_str()), Error);
  });
  CHECK_FALSE(fs::exists(root + "/step-2.tmp"));
  CHECK(dtensor::latest_checkpoint(root) == dir);
  fs::remove_all(root);
}
