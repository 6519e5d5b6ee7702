// Fuzzes the checkpoint index: the input replaces index.json of a small checkpoint saved at
// start-up by two ranks (its own index.json is the seed, corpus/checkpoint/), then the index is
// read and every tensor it lists (up to 4096 elements) is loaded into a plain target of its
// shape and dtype from the shard files beside it. quilt::Error is the expected answer to a bad
// index; anything else (another exception, a sanitizer report) is a bug.
#include <cstdio>
#include <filesystem>

#include "dtensor/checkpoint.h"
#include "dtensor/dtensor.h"
#include "engine/engine.h"
#include "tests/fuzz/fuzz_util.h"

using namespace quilt;

namespace {

std::string saved_checkpoint() {
  const std::string dir = fuzz::scratch_dir("checkpoint") + "/step-1";
  run_threads_group(2, [&](Communicator& c) {
    DeviceMesh mesh(c.shared_from_this(), {2}, {"dp"});
    dtensor::StateDict state = {
        {"w", distribute_tensor(randn({5, 3}, RngKey(1, "w")), mesh, {Shard(0)})},
        {"b", distribute_tensor(randn({3}, RngKey(1, "b"), {.dtype = DType::bf16}), mesh, {Replicate()})},
        {"m", distribute_tensor(randn({2, 6}, RngKey(1, "m")), mesh, {Shard(1)})},
        {"step", full({}, 7.0, {.dtype = DType::i64})}};
    dtensor::save_checkpoint(dir, state, c, {{"step", "1"}});
  });
  // The seed corpus is this index.json (regenerate it from the copy when the format changes).
  std::filesystem::copy_file(dir + "/index.json", dir + "/../saved-index.json");
  std::fprintf(stderr, "checkpoint_fuzz: the inputs replace %s/index.json (saved: %s/../saved-index.json)\n",
               dir.c_str(), dir.c_str());
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = saved_checkpoint();
  fuzz::write_file(dir + "/index.json", data, size);
  try {
    const dtensor::CheckpointInfo info = dtensor::read_checkpoint_info(dir);
    dtensor::StateDict targets;
    for (const dtensor::CheckpointTensorInfo& t : info.tensors) {
      bool small = true;
      for (int64_t n : t.shape) small = small && n >= 0 && n <= 4096;
      if (small && numel_of(t.shape) <= 4096) targets.emplace_back(t.name, zeros(t.shape, {.dtype = t.dtype}));
    }
    dtensor::load_checkpoint(dir, targets);
  } catch (const Error&) {
  }
  return 0;
}
