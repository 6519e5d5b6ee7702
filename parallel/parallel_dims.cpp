// ParallelDims: validation of the distributed: section and the mesh shapes it implies.
#include "parallel/parallel_dims.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "engine/error.h"

namespace quilt {

namespace {

// "a, b and c" for messages that list every offending key.
std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += i + 1 == items.size() ? " and " : ", ";
    out += items[i];
  }
  return out;
}

std::string factors(const DistributedConfig& c) {
  return detail::concat("tp_size=", c.tp_size, ", pp_size=", c.pp_size, ", cp_size=", c.cp_size);
}

void check_positive(const char* key, int64_t v) {
  QUILT_CHECK(v >= 1, "[distributed] ", key, " must be >= 1, got ", v);
}

const std::vector<std::string> kMainAxes = {"pp", "dp_replicate", "dp_shard", "cp", "tp"};
const std::vector<std::string> kMoeAxes = {"pp", "ep_shard", "ep"};
// The flattened views of the main mesh, by name.
const std::vector<std::pair<std::string, std::vector<std::string>>> kViews = {
    {"dp", {"dp_replicate", "dp_shard"}},
    {"dp_shard_cp", {"dp_shard", "cp"}},
    {"dp_cp", {"dp_replicate", "dp_shard", "cp"}}};

bool is_main_axis(const std::string& n) { return std::find(kMainAxes.begin(), kMainAxes.end(), n) != kMainAxes.end(); }

std::string known_names() {
  std::string s = "pp, dp_replicate, dp_shard, cp, tp";
  for (const auto& [v, axes] : kViews) s += ", " + v;
  return s + ", ep_shard, ep";
}

}  // namespace

struct Meshes::Views {
  std::mutex mu;
  std::map<std::string, DeviceMesh> subs;  // sub() results by joined names
};

std::vector<std::string> Meshes::axes_of(const std::string& name) {
  if (is_main_axis(name)) return {name};
  for (const auto& [v, axes] : kViews)
    if (v == name) return axes;
  fail("[meshes] '", name, "' is not a main-mesh axis or view (", known_names(), ")");
}

DeviceMesh Meshes::operator[](const std::string& name) const {
  QUILT_CHECK(main.defined(), "[meshes] no meshes built (use ParallelDims::build_meshes)");
  if (is_main_axis(name)) return main[name];
  if (name == "ep" || name == "ep_shard") return moe[name];
  for (const auto& [v, axes] : kViews)
    if (v == name) return main.flatten(axes, v);  // built by build_meshes: cached, no communication
  fail("[meshes] no mesh called '", name, "' (", known_names(), ")");
}

DeviceMesh Meshes::sub(const std::vector<std::string>& names) const {
  QUILT_CHECK(!names.empty(), "[meshes] sub() needs at least one name");
  if (names.size() == 1) return (*this)[names[0]];
  std::string key;
  for (const auto& n : names) key += n + ",";
  {
    std::lock_guard<std::mutex> lock(views->mu);
    if (auto it = views->subs.find(key); it != views->subs.end()) return it->second;
  }
  std::vector<std::string> axes;
  bool plain = true;
  Shape shape;
  for (const auto& n : names) {
    const std::vector<std::string> a = axes_of(n);
    plain = plain && a.size() == 1;
    int64_t size = 1;
    for (const auto& x : a) {
      QUILT_CHECK(axes.empty() || main.axis(x) > main.axis(axes.back()), "[meshes] sub(", key,
                  ") must name disjoint axes in main-mesh order (pp, dp_replicate, dp_shard, cp, tp)");
      axes.push_back(x);
      size *= main.size(main.axis(x));
    }
    shape.push_back(size);
  }
  DeviceMesh part = main.sub(axes);
  // A flattened view is a reshape of the row-major positions of its axes, so a mesh of the
  // views' sizes over the same ranks, in the same order, has the views as its axes.
  DeviceMesh m = plain ? part : DeviceMesh(part.comm().shared_from_this(), shape, names);
  std::lock_guard<std::mutex> lock(views->mu);
  return views->subs.emplace(key, m).first->second;
}

Meshes ParallelDims::build_meshes(std::shared_ptr<Communicator> world) const {
  QUILT_CHECK(world != nullptr, "[meshes] got a null communicator");
  QUILT_CHECK(world->size() == world_, "[meshes] the communicator has ", world->size(),
              " ranks but the layout was validated for a world of ", world_, " (", mesh_string(), ")");
  Meshes m;
  m.views = std::make_shared<Meshes::Views>();
  Shape shape;
  for (const MeshAxis& a : mesh_axes()) shape.push_back(a.size);
  m.main = DeviceMesh(world, shape, kMainAxes);
  // Every rank builds the views in this order, so later lookups need no communication.
  for (const auto& [v, axes] : kViews) m.main.flatten(axes, v);
  // The MoE mesh lies over the ranks of this rank's tp coordinate, in main-mesh order.
  DeviceMesh slice = m.main.sub({"pp", "dp_replicate", "dp_shard", "cp"});
  m.moe = DeviceMesh(slice.comm().shared_from_this(), {pp(), ep_shard(), ep()}, kMoeAxes);
  if (ep() > 1 && tp() > 1)
    m.moe_tp = DeviceMesh(world, {pp(), ep_shard(), ep(), tp()}, {"pp", "ep_shard", "ep", "tp"});
  // HSDP's two meshes (FSDP over dp_shard[_cp], replicas over dp_replicate), also built up front.
  m.sub({"dp_replicate", "dp_shard"});
  m.sub({"dp_replicate", "dp_shard_cp"});
  return m;
}

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::kFsdp2: return "fsdp2";
    case Strategy::kMegatronFsdp: return "megatron_fsdp";
    case Strategy::kDdp: return "ddp";
  }
  return "?";
}

Strategy parse_strategy(const std::string& s) {
  for (Strategy v : {Strategy::kFsdp2, Strategy::kMegatronFsdp, Strategy::kDdp})
    if (s == strategy_name(v)) return v;
  fail("[distributed] strategy '", s, "' is not one of fsdp2, megatron_fsdp, ddp");
}

const std::vector<std::string>& pipeline_schedule_names() {
  static const std::vector<std::string> names = {"gpipe", "1f1b",        "interleaved1f1b", "interleaved_1f1b",
                                                 "looped_bfs", "dfs", "zero_bubble", "v_schedule"};
  return names;
}

ParallelDims::ParallelDims(const DistributedConfig& config, int64_t world_size)
    : config_(config), world_(world_size) {
  const DistributedConfig& c = config_;
  QUILT_CHECK(world_size >= 1, "[distributed] world size must be >= 1, got ", world_size);
  check_positive("tp_size", c.tp_size);
  check_positive("pp_size", c.pp_size);
  check_positive("cp_size", c.cp_size);
  check_positive("ep_size", c.ep_size);
  if (c.dp_size) check_positive("dp_size", *c.dp_size);
  if (c.dp_replicate_size) check_positive("dp_replicate_size", *c.dp_replicate_size);
  check_positive("pipeline.pp_microbatch_size", c.pipeline.pp_microbatch_size);
  const bool hsdp = c.dp_replicate_size && *c.dp_replicate_size > 1;

  // Each strategy supports a subset of the other parallelisms; list every offending key at once.
  std::vector<std::string> bad;
  if (c.strategy == Strategy::kDdp) {
    if (c.tp_size > 1) bad.push_back(detail::concat("tp_size=", c.tp_size));
    if (c.pp_size > 1) bad.push_back(detail::concat("pp_size=", c.pp_size));
    if (c.cp_size > 1) bad.push_back(detail::concat("cp_size=", c.cp_size));
    if (c.ep_size > 1) bad.push_back(detail::concat("ep_size=", c.ep_size));
    if (hsdp) bad.push_back(detail::concat("dp_replicate_size=", *c.dp_replicate_size));
    QUILT_CHECK(bad.empty(), "[distributed] strategy ddp replicates the whole model on every rank and "
                "cannot combine with ", join(bad), " (set them to 1/none, or use strategy fsdp2)");
  } else if (c.strategy == Strategy::kMegatronFsdp) {
    if (c.pp_size > 1) bad.push_back(detail::concat("pp_size=", c.pp_size));
    if (c.ep_size > 1) bad.push_back(detail::concat("ep_size=", c.ep_size));
    if (c.sequence_parallel) bad.push_back("sequence_parallel=true");
    if (hsdp) bad.push_back(detail::concat("dp_replicate_size=", *c.dp_replicate_size, " (HSDP is fsdp2 only)"));
    QUILT_CHECK(bad.empty(), "[distributed] strategy megatron_fsdp does not support ", join(bad),
                " (use strategy fsdp2)");
  }

  const int64_t model_parallel = c.tp_size * c.pp_size * c.cp_size;
  QUILT_CHECK(world_size % model_parallel == 0, "[distributed] world size ", world_size,
              " is not divisible by tp_size * pp_size * cp_size = ", model_parallel, " (", factors(c), ")");
  const int64_t dp = world_size / model_parallel;
  QUILT_CHECK(!c.dp_size || *c.dp_size == dp, "[distributed] dp_size ", c.dp_size.value_or(0),
              " does not match world size ", world_size, " / (tp_size * pp_size * cp_size) = ", world_size, " / ",
              model_parallel, " = ", dp, " (", factors(c), "); set dp_size: none to infer it");

  if (hsdp) {
    const int64_t r = *c.dp_replicate_size;
    QUILT_CHECK(dp % r == 0, "[distributed] dp_replicate_size ", r, " does not divide dp_size ", dp,
                " (dp_size = world size ", world_size, " / (tp_size * pp_size * cp_size) = ", world_size, " / ",
                model_parallel, "; ", factors(c), ")");
    QUILT_CHECK(r < dp, "[distributed] dp_replicate_size ", r, " must be less than dp_size ", dp,
                " (HSDP shards each replica over dp_size / dp_replicate_size ranks; "
                "for pure replication use strategy ddp)");
  }
  if (c.strategy == Strategy::kDdp) {
    dp_replicate_ = dp;
    dp_shard_ = 1;
  } else {
    dp_replicate_ = hsdp ? *c.dp_replicate_size : 1;
    dp_shard_ = dp / dp_replicate_;
  }
  // FSDP2's int: parameters stay gathered over groups of N of the dp_shard * cp ranks.
  if (const int64_t* n = std::get_if<int64_t>(&c.reshard_after_forward))
    QUILT_CHECK(*n >= 1 && (dp_shard_ * c.cp_size) % *n == 0, "[distributed] reshard_after_forward ", *n,
                " must divide the ranks FSDP shards over, dp_shard * cp_size = ", dp_shard_, " * ", c.cp_size, " = ",
                dp_shard_ * c.cp_size, " (", factors(c), ")");

  QUILT_CHECK((dp * c.cp_size) % c.ep_size == 0, "[distributed] ep_size ", c.ep_size,
              " does not divide dp_size * cp_size = ", dp, " * ", c.cp_size, " = ", dp * c.cp_size,
              " (dp_size=", dp, ", cp_size=", c.cp_size, ")");

  bool known = false;
  for (const std::string& s : pipeline_schedule_names()) known = known || s == c.pipeline.pp_schedule;
  if (!known) {
    std::vector<std::string> names = pipeline_schedule_names();
    fail("[distributed] pipeline.pp_schedule '", c.pipeline.pp_schedule, "' is not one of ", join(names));
  }
}

std::string ParallelDims::mesh_string() const {
  return detail::concat("mesh: world=", world_, " dp_replicate=", dp_replicate_, " dp_shard=", dp_shard_,
                        " cp=", cp(), " tp=", tp(), " pp=", pp(), " ep=", ep());
}

std::vector<MeshAxis> ParallelDims::mesh_axes() const {
  return {{"pp", pp()}, {"dp_replicate", dp_replicate_}, {"dp_shard", dp_shard_}, {"cp", cp()}, {"tp", tp()}};
}

std::vector<MeshAxis> ParallelDims::moe_mesh_axes() const {
  return {{"pp", pp()}, {"ep_shard", ep_shard()}, {"ep", ep()}};
}

MeshCoords ParallelDims::coords(int64_t rank) const {
  QUILT_CHECK(rank >= 0 && rank < world_, "[distributed] rank ", rank, " is outside the world of ", world_);
  MeshCoords m;
  // Row-major over (pp, dp_replicate, dp_shard, cp, tp): peel the fastest axis first.
  int64_t r = rank;
  m.tp = r % tp();
  r /= tp();
  m.cp = r % cp();
  r /= cp();
  m.dp_shard = r % dp_shard_;
  r /= dp_shard_;
  m.dp_replicate = r % dp_replicate_;
  r /= dp_replicate_;
  m.pp = r;
  return m;
}

int64_t ParallelDims::dp_rank(int64_t rank) const {
  MeshCoords m = coords(rank);
  return m.dp_replicate * dp_shard_ + m.dp_shard;
}

void ParallelDims::check_seq_len(int64_t seq_len) const {
  QUILT_CHECK(seq_len >= 1, "[distributed] train.seq_len must be >= 1, got ", seq_len);
  if (cp() > 1) {
    QUILT_CHECK(seq_len % (2 * cp()) == 0, "[distributed] train.seq_len ", seq_len,
                " is not divisible by 2 * cp_size = ", 2 * cp(), " (cp_size=", cp(),
                "; context parallelism splits each packed sequence into 2 * cp_size load-balanced chunks)");
  }
  if (config_.sequence_parallel && tp() > 1) {
    const int64_t local = seq_len / cp();
    QUILT_CHECK(local % tp() == 0, "[distributed] train.seq_len ", seq_len, " / cp_size ", cp(), " = ", local,
                " is not divisible by tp_size = ", tp(), " (sequence_parallel shards each rank's sequence over tp)");
  }
}

}  // namespace quilt
