// Distributed checkpoints. A sharded save writes, per rank, one safetensors file of the shards
// that rank owns (one copy of each block: replicas are written once) and then one index
// (index.json: every tensor's global shape, dtype, placements and chunks with their offsets).
// Everything goes to "<dir>.tmp" and becomes "<dir>" by one rename after every rank has
// finished, so a crash never leaves a directory that looks complete, and a failed save removes
// "<dir>.tmp". A load fills tensors of any mesh, world size or placements (resharding), reading
// from each file the byte runs of the blocks a rank needs. A damaged checkpoint never loads
// silently: every chunk carries an XXH3-64 checksum, verified whole the first time a load reads
// any block of it; the index is cross-checked against each shard file's own metadata, parsed
// strictly, and every floating value read must be finite. Consolidated export/import speak Hugging Face's safetensors
// layout (one file, or several plus model.safetensors.index.json); StackedName rules map a
// grouped tensor of ours, e.g. MoE experts (E, I, H), to Hugging Face's one tensor per expert.
//
//   dtensor::save_checkpoint(root + "/step-100", {{"w", w}, {"b", b}}, world());
//   dtensor::load_checkpoint(dtensor::latest_checkpoint(root), {{"w", w2}, {"b", b2}});
//   dtensor::export_consolidated(root + "/step-100", "out/model.safetensors");
//   dtensor::import_consolidated("hf/model.safetensors.index.json", {{"model.layers.0.mlp.experts.gate_proj", g}},
//       {{"model.layers.0.mlp.experts.gate_proj", "model.layers.0.mlp.experts.{}.gate_proj.weight", 64}});
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "collectives/communicator.h"
#include "engine/tensor.h"

namespace quilt::dtensor {

/// Named tensors, plain or distributed (model parameters, optimizer state, ...).
using StateDict = std::vector<std::pair<std::string, Tensor>>;

/// What read_checkpoint_info() returns: one entry per tensor, plus the saved metadata.
struct CheckpointTensorInfo {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  std::string placements;  // as saved, e.g. "(S(0), R)"; "plain" for plain tensors
};
struct CheckpointInfo {
  std::string dir;
  int world_size = 0;
  std::vector<CheckpointTensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

/// A grouped tensor that Hugging Face checkpoints (Qwen3-MoE, DeepSeek-V3, ...) store as `count`
/// separate tensors: our tensor `name` of shape (count, *rest) is the stack along dim 0 of the
/// file tensors named `pattern` with "{}" replaced by 0, 1, ..., count - 1, each of shape (*rest).
///
///   dtensor::StackedName{"model.layers.0.mlp.experts.gate_proj",           // (E, I, H), ours
///                        "model.layers.0.mlp.experts.{}.gate_proj.weight",  // (I, H) each, HF
///                        E};
struct StackedName {
  std::string name;     // the grouped tensor (count, *rest)
  std::string pattern;  // the per-expert names; "{}" (once) stands for the expert index
  int64_t count = 0;    // experts: the grouped tensor's dim 0
};

/// Saves `state` into directory `dir` (which must not exist yet, or is replaced). Collective
/// over `comm`, which must contain every rank of every tensor's mesh (usually the world). Ranks
/// may hold different tensors (pipeline stages: each its own layers), but the ranks of one
/// tensor's mesh pass it in the same order, and a plain tensor held by several ranks holds the
/// same values on each (the lowest such rank writes it). Partial tensors are reduced first.
/// `metadata` (step, config, ...) is stored in the index, every rank's keys merged (rank 0's
/// value wins where two ranks give one key). Throws on every rank when any rank fails, leaving
/// no "<dir>.tmp" and an earlier `dir` as it was.
void save_checkpoint(const std::string& dir, const StateDict& state, Communicator& comm,
                     const std::map<std::string, std::string>& metadata = {});

/// Loads the tensors named in `targets` from checkpoint `dir` into the targets' own storage
/// (their shards, for distributed targets), whatever mesh, world size or placements saved them.
/// Partial targets get the value on coordinate 0 and zeros elsewhere (sum) or the value
/// everywhere (avg, max, min). dtypes are converted. Not collective. Errors name the tensor
/// and the rank: a key missing from the checkpoint, a shape mismatch, a malformed index field,
/// and, naming the file and the chunk too, a truncated file, a checksum mismatch, an index that
/// disagrees with the shard file, a NaN or Inf. Checkpoints saved before checksums (format
/// quilt-dcp/1) load unverified.
void load_checkpoint(const std::string& dir, const StateDict& targets);

/// The index of checkpoint `dir`; throws when `dir` holds no complete checkpoint.
CheckpointInfo read_checkpoint_info(const std::string& dir);

/// The complete checkpoint under `root` with the highest trailing number in its name
/// ("step-100" beats "step-99"; names without a number sort before numbered ones), or "" when
/// there is none. Directories ending in .tmp (unfinished saves) are never chosen.
std::string latest_checkpoint(const std::string& root);

/// Writes the full tensors of checkpoint `dir` as one Hugging Face safetensors file `out_path`
/// (metadata {"format": "pt"}); when they exceed `max_shard_bytes`, as files
/// "<stem>-00001-of-0000N.safetensors" beside it plus "<stem>.safetensors.index.json" (the
/// weight_map of Hugging Face's sharded checkpoints). Single process; returns the files written.
/// A tensor named by one of `stacks` is written as its `count` per-expert tensors instead, in
/// expert order at the grouped tensor's place (and may span two files); each rule must name a
/// tensor of the checkpoint whose dim 0 is `count`.
std::vector<std::string> export_consolidated(const std::string& dir, const std::string& out_path,
                                             uint64_t max_shard_bytes = uint64_t(5) << 30,
                                             const std::vector<StackedName>& stacks = {});

/// Loads the tensors named in `targets` from a Hugging Face checkpoint: one .safetensors file or
/// a .safetensors.index.json with its shard files; each rank reads only its blocks. A target
/// named by one of `stacks` is read from the per-expert tensors of that rule, each expert being
/// the block (1, *rest) at (e, 0, ...) of the target, so a rank reads only the experts (and the
/// rows of them) its block covers; every expert must still be in the file, of shape
/// target.shape()[1:] and of one dtype. Rules naming no target are ignored.
void import_consolidated(const std::string& path, const StateDict& targets,
                         const std::vector<StackedName>& stacks = {});

namespace detail {
/// Test hook: runs on each rank just before it writes its shard file at `path` (a test can
/// write part of the file and kill the process, or throw). Empty to remove.
void set_checkpoint_fault_hook(std::function<void(const std::string& path, int rank)> hook);
/// Test hook: runs on each rank before every block a load or import reads, with the file entry
/// (the tensor's name in that safetensors file) and the block's start and sizes in the entry
/// (the whole chunk the first time a load reads a chunk that has a checksum, to verify it).
/// Called from every rank's thread at once under the threads backend. Empty to remove.
void set_checkpoint_read_hook(
    std::function<void(const std::string& entry, const Shape& start, const Shape& sizes, int rank)> hook);
}  // namespace detail

}  // namespace quilt::dtensor
