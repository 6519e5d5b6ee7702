// ParallelDims: the degrees of every parallelism of a run (data, tensor, pipeline, context,
// expert), taken from a recipe's `distributed:` section and the world size, validated once
// at start-up so that a bad layout fails with a message naming the key and every factor.
//
//   DistributedConfig dc;  dc.tp_size = 2;
//   ParallelDims dims(dc, /*world_size=*/8);        // dp inferred: 8 / (tp 2 * pp 1 * cp 1) = 4
//   dims.mesh_string();   // "mesh: world=8 dp_replicate=1 dp_shard=4 cp=1 tp=2 pp=1 ep=1"
//   dims.mesh_axes();     // {pp 1, dp_replicate 1, dp_shard 4, cp 1, tp 2}
//   Meshes m = dims.build_meshes(world_ptr());      // collective over the world, once at start-up
//   m["tp"];  m["dp_shard_cp"];  m.sub({"dp_replicate", "dp_shard_cp"});  m["ep"];
//
// "axis" always means a mesh axis here, never a tensor dim.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "dtensor/mesh.h"

namespace quilt {

/// How the data-parallel axes hold the model: sharded (FSDP2 / Megatron-FSDP) or replicated (DDP).
enum class Strategy { kFsdp2, kMegatronFsdp, kDdp };

/// "fsdp2", "megatron_fsdp" or "ddp".
const char* strategy_name(Strategy s);
/// Parses a strategy name; throws naming `distributed.strategy` and the valid values.
Strategy parse_strategy(const std::string& s);

/// Pipeline schedules a recipe may name (the pipeline layer implements them).
const std::vector<std::string>& pipeline_schedule_names();

/// distributed.pipeline: how a pipeline-parallel step is scheduled.
struct PipelineConfig {
  std::string pp_schedule = "1f1b";
  int64_t pp_microbatch_size = 1;  // sequences per pipeline micro-batch; divides train.micro_batch_size
  bool scale_grads_in_schedule = false;
};

/// distributed.moe: how mixture-of-experts blocks are wrapped.
struct MoeConfig {
  bool reshard_after_forward = false;
  bool ignore_router_for_ac = true;
  bool wrap_outer_model = true;
};

/// The `distributed:` section of a recipe, as plain values (tools/config parses the YAML).
struct DistributedConfig {
  Strategy strategy = Strategy::kFsdp2;
  std::optional<int64_t> dp_size;            // none: inferred as world / (tp * pp * cp)
  std::optional<int64_t> dp_replicate_size;  // none or 1: no HSDP
  int64_t tp_size = 1;
  int64_t pp_size = 1;
  int64_t cp_size = 1;
  std::string cp_comm_type = "ring";  // ring | all_gather | a2a: how context-parallel attention meets the keys
  int64_t ep_size = 1;
  bool sequence_parallel = false;
  bool activation_checkpointing = false;
  std::string activation_checkpointing_mode = "full";  // full | selective (keeps matmul outputs)
  // fsdp2: false gathers each block once and keeps it for backward; N reshards to groups of N
  std::variant<bool, int64_t> reshard_after_forward = true;
  bool defer_fsdp_grad_sync = true;
  PipelineConfig pipeline;
  MoeConfig moe;
};

/// One axis of a device mesh: its name and size.
struct MeshAxis {
  std::string name;
  int64_t size = 1;
  friend bool operator==(const MeshAxis&, const MeshAxis&) = default;
};

/// A rank's index along each axis of the main mesh (pp, dp_replicate, dp_shard, cp, tp).
struct MeshCoords {
  int64_t pp = 0, dp_replicate = 0, dp_shard = 0, cp = 0, tp = 0;
  friend bool operator==(const MeshCoords&, const MeshCoords&) = default;
};

/// Every device mesh of a run, built once by ParallelDims::build_meshes (the only place meshes
/// are made). Names a caller may ask for:
///   main axes       pp, dp_replicate, dp_shard, cp, tp   (1-D sub-meshes of `main`)
///   flattened views dp = dp_replicate x dp_shard, dp_shard_cp = dp_shard x cp,
///                   dp_cp = dp_replicate x dp_shard x cp  (1-D, ranks in row-major order)
///   MoE axes        ep_shard, ep                         (1-D sub-meshes of `moe`)
/// All size-1 axes exist, so a caller never branches on whether a parallelism is on.
/// A cheap handle: copies share the meshes (and the cache of sub()).
struct Meshes {
  /// (pp, dp_replicate, dp_shard, cp, tp) over the world, row-major (tp fastest).
  DeviceMesh main;
  /// (pp, ep_shard, ep) over the world / tp ranks that share this rank's tp coordinate (one
  /// MoE mesh per tp coordinate), row-major over them in main-mesh order: an ep group is
  /// ep ranks consecutive in (dp_replicate, dp_shard, cp) order with one pp and tp coordinate.
  /// Its ranks() are ranks of that tp slice's communicator, not of the world.
  DeviceMesh moe;
  /// (pp, ep_shard, ep, tp) over the world, built only when ep and tp are both > 1: the MoE
  /// mesh with the tp axis beside it, so that experts can be cut over ep and tp at once (their
  /// mesh is sub({"ep", "tp"}) of it) and FSDP-sharded over its ep_shard axis. The ranks of a
  /// main-mesh (dp_replicate, dp_shard, cp) position run in (ep_shard, ep) order, as in `moe`.
  DeviceMesh moe_tp;

  /// The 1-D mesh called `name` (a main or MoE axis, or a flattened view; see above); throws
  /// listing the names when unknown. No communication.
  DeviceMesh operator[](const std::string& name) const;
  /// An n-D mesh of the axes or views `names`, in main-mesh order and disjoint — e.g. HSDP's
  /// sub({"dp_replicate", "dp_shard_cp"}) or sub({"dp_shard", "tp"}). Plain main axes give
  /// main.sub(names); with a flattened view a new mesh is built over those ranks (collective
  /// over them the first time: every rank asks in the same order; cached afterwards).
  DeviceMesh sub(const std::vector<std::string>& names) const;
  /// The size of the axis or view `name`.
  int64_t size(const std::string& name) const { return (*this)[name].size(); }

  /// The main axes a view stands for ({"dp_shard", "cp"} for "dp_shard_cp"; {name} for an axis).
  static std::vector<std::string> axes_of(const std::string& name);

  struct Views;
  std::shared_ptr<Views> views;  // flattened views and sub() results
};

/// Validated parallel degrees of a run. The main mesh is (pp, dp_replicate, dp_shard, cp, tp),
/// row-major over ranks (tp varies fastest), as torchtitan lays it out; the MoE mesh is
/// (pp, ep_shard, ep) with ep_shard = dp * cp / ep.
class ParallelDims {
 public:
  /// Validates `config` against `world_size`; throws quilt::Error naming the key and every factor.
  ParallelDims(const DistributedConfig& config, int64_t world_size);

  int64_t world() const { return world_; }
  int64_t dp_replicate() const { return dp_replicate_; }
  int64_t dp_shard() const { return dp_shard_; }
  /// Data-parallel degree: dp_replicate * dp_shard (how many different batches a step sees).
  int64_t dp() const { return dp_replicate_ * dp_shard_; }
  int64_t cp() const { return config_.cp_size; }
  int64_t tp() const { return config_.tp_size; }
  int64_t pp() const { return config_.pp_size; }
  int64_t ep() const { return config_.ep_size; }
  /// Size of the axis that FSDP-shards experts: dp * cp / ep.
  int64_t ep_shard() const { return dp() * cp() / ep(); }
  /// Ranks that shard one non-expert parameter under FSDP: dp_shard * cp.
  int64_t dp_shard_cp() const { return dp_shard_ * cp(); }
  /// Ranks that see different tokens of a step (the loss is averaged over them): dp * cp.
  int64_t dp_cp() const { return dp() * cp(); }
  Strategy strategy() const { return config_.strategy; }
  const DistributedConfig& config() const { return config_; }

  /// "mesh: world=8 dp_replicate=1 dp_shard=2 cp=1 tp=2 pp=1 ep=1" (rank 0 logs it at start).
  std::string mesh_string() const;
  /// The main mesh axes in torchtitan's order: pp, dp_replicate, dp_shard, cp, tp (size-1 axes included).
  std::vector<MeshAxis> mesh_axes() const;
  /// The MoE mesh axes: pp, ep_shard, ep.
  std::vector<MeshAxis> moe_mesh_axes() const;
  /// Where `rank` sits on the main mesh; throws if rank is outside [0, world).
  MeshCoords coords(int64_t rank) const;
  /// The data-parallel rank of `rank` in [0, dp()): which slice of each global batch it reads.
  int64_t dp_rank(int64_t rank) const;

  /// Builds the main mesh, its flattened views and the MoE mesh over `world` (whose size must be
  /// world()). Collective over `world`: every rank calls it once, at start-up.
  Meshes build_meshes(std::shared_ptr<Communicator> world) const;

  /// Rejects a sequence length the context/sequence-parallel split cannot divide (names train.seq_len).
  void check_seq_len(int64_t seq_len) const;

 private:
  DistributedConfig config_;
  int64_t world_ = 1;
  int64_t dp_replicate_ = 1;
  int64_t dp_shard_ = 1;
};

}  // namespace quilt
