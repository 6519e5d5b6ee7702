// ParallelDims: degrees inferred from the distributed: section, every rule's message, mesh layout.
#include <doctest/doctest.h>

#include <map>
#include <set>

#include "collectives/communicator.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "parallel/parallel_dims.h"

using namespace quilt;

namespace {

DistributedConfig dist(int64_t tp = 1, int64_t pp = 1, int64_t cp = 1, int64_t ep = 1) {
  DistributedConfig c;
  c.tp_size = tp;
  c.pp_size = pp;
  c.cp_size = cp;
  c.ep_size = ep;
  return c;
}

}  // namespace

TEST_CASE("parallel_dims: dp is inferred as world / (tp * pp * cp) and the mesh line names every degree") {
  ParallelDims d(dist(2, 2), 8);
  CHECK(d.dp() == 2);
  CHECK(d.dp_replicate() == 1);
  CHECK(d.dp_shard() == 2);
  CHECK(d.mesh_string() == "mesh: world=8 dp_replicate=1 dp_shard=2 cp=1 tp=2 pp=2 ep=1");
  CHECK(ParallelDims(dist(2), 8).mesh_string() == "mesh: world=8 dp_replicate=1 dp_shard=4 cp=1 tp=2 pp=1 ep=1");
  CHECK(ParallelDims(dist(), 1).mesh_string() == "mesh: world=1 dp_replicate=1 dp_shard=1 cp=1 tp=1 pp=1 ep=1");
}

TEST_CASE("parallel_dims: mesh axes come in torchtitan's order and multiply to the world") {
  DistributedConfig c = dist(2, 1, 2);
  c.dp_replicate_size = 2;
  ParallelDims d(c, 16);  // dp = 16 / 4 = 4 = 2 replicas x 2 shards
  std::vector<MeshAxis> axes = d.mesh_axes();
  CHECK(axes == std::vector<MeshAxis>{{"pp", 1}, {"dp_replicate", 2}, {"dp_shard", 2}, {"cp", 2}, {"tp", 2}});
  int64_t product = 1;
  for (const MeshAxis& a : axes) product *= a.size;
  CHECK(product == 16);
  CHECK(d.dp_shard_cp() == 4);
  CHECK(d.dp_cp() == 8);
}

TEST_CASE("parallel_dims: the moe mesh is (pp, ep_shard, ep) with ep_shard = dp * cp / ep") {
  ParallelDims d(dist(1, 2, 2, 4), 16);  // dp = 16 / 4 = 4, dp * cp = 8
  CHECK(d.moe_mesh_axes() == std::vector<MeshAxis>{{"pp", 2}, {"ep_shard", 2}, {"ep", 4}});
  ParallelDims full(dist(1, 1, 1, 8), 8);
  CHECK(full.ep_shard() == 1);
}

TEST_CASE("parallel_dims: ddp replicates over all of dp and HSDP splits dp into replicas of shards") {
  DistributedConfig ddp;
  ddp.strategy = Strategy::kDdp;
  ParallelDims d(ddp, 4);
  CHECK(d.dp_replicate() == 4);
  CHECK(d.dp_shard() == 1);
  DistributedConfig hsdp;
  hsdp.dp_replicate_size = 2;
  ParallelDims h(hsdp, 8);
  CHECK(h.dp_replicate() == 2);
  CHECK(h.dp_shard() == 4);
  DistributedConfig one;  // dp_replicate_size 1 is plain FSDP, even when dp is 1
  one.dp_replicate_size = 1;
  CHECK(ParallelDims(one, 1).dp_shard() == 1);
}

TEST_CASE("parallel_dims: a world not divisible by tp * pp * cp is rejected listing every factor") {
  CHECK_THROWS_WITH_AS(ParallelDims(dist(2, 2), 6),
                       "[distributed] world size 6 is not divisible by tp_size * pp_size * cp_size = 4 "
                       "(tp_size=2, pp_size=2, cp_size=1)",
                       Error);
  CHECK_THROWS_WITH_AS(ParallelDims(dist(1, 1, 3), 8), doctest::Contains("cp_size=3"), Error);
}

TEST_CASE("parallel_dims: ddp with tp, pp, cp, ep or HSDP is rejected naming every offending key") {
  DistributedConfig c = dist(2, 2);
  c.strategy = Strategy::kDdp;
  CHECK_THROWS_WITH_AS(ParallelDims(c, 8), doctest::Contains("strategy ddp"), Error);
  CHECK_THROWS_WITH_AS(ParallelDims(c, 8), doctest::Contains("tp_size=2 and pp_size=2"), Error);
  for (auto [key, set] : std::vector<std::pair<std::string, void (*)(DistributedConfig&)>>{
           {"cp_size=2", [](DistributedConfig& d) { d.cp_size = 2; }},
           {"ep_size=2", [](DistributedConfig& d) { d.ep_size = 2; }},
           {"dp_replicate_size=2", [](DistributedConfig& d) { d.dp_replicate_size = 2; }}}) {
    DistributedConfig d;
    d.strategy = Strategy::kDdp;
    set(d);
    CHECK_THROWS_WITH_AS(ParallelDims(d, 8), doctest::Contains(key.c_str()), Error);
  }
}

TEST_CASE("parallel_dims: megatron_fsdp with pp, ep, sequence_parallel or HSDP is rejected naming the key") {
  DistributedConfig c;
  c.strategy = Strategy::kMegatronFsdp;
  c.pp_size = 2;
  CHECK_THROWS_WITH_AS(ParallelDims(c, 4), doctest::Contains("megatron_fsdp does not support pp_size=2"), Error);
  c.pp_size = 1;
  c.ep_size = 2;
  CHECK_THROWS_WITH_AS(ParallelDims(c, 4), doctest::Contains("ep_size=2"), Error);
  c.ep_size = 1;
  c.tp_size = 2;
  c.sequence_parallel = true;
  CHECK_THROWS_WITH_AS(ParallelDims(c, 4), doctest::Contains("sequence_parallel=true"), Error);
  c.sequence_parallel = false;
  c.tp_size = 1;
  c.dp_replicate_size = 2;
  CHECK_THROWS_WITH_AS(ParallelDims(c, 8), doctest::Contains("dp_replicate_size=2 (HSDP is fsdp2 only)"), Error);
  c.dp_replicate_size.reset();
  c.tp_size = 2;
  CHECK(ParallelDims(c, 4).dp_shard() == 2);  // megatron_fsdp with tp alone is fine
}

TEST_CASE("parallel_dims: ep must divide dp * cp") {
  CHECK_THROWS_WITH_AS(ParallelDims(dist(1, 1, 1, 3), 4),
                       "[distributed] ep_size 3 does not divide dp_size * cp_size = 4 * 1 = 4 (dp_size=4, cp_size=1)",
                       Error);
  CHECK(ParallelDims(dist(1, 1, 2, 4), 4).ep() == 4);  // dp 2 * cp 2 = 4
}

TEST_CASE("parallel_dims: HSDP replicas must divide dp and be fewer than dp") {
  DistributedConfig c;
  c.dp_replicate_size = 3;
  CHECK_THROWS_WITH_AS(ParallelDims(c, 4), doctest::Contains("dp_replicate_size 3 does not divide dp_size 4"), Error);
  c.dp_replicate_size = 4;
  CHECK_THROWS_WITH_AS(ParallelDims(c, 4), doctest::Contains("dp_replicate_size 4 must be less than dp_size 4"),
                       Error);
}

TEST_CASE("parallel_dims: an explicit dp_size must match the world") {
  DistributedConfig c = dist(2);
  c.dp_size = 3;
  CHECK_THROWS_WITH_AS(ParallelDims(c, 8), doctest::Contains("dp_size 3 does not match world size 8"), Error);
  c.dp_size = 4;
  CHECK(ParallelDims(c, 8).dp() == 4);
}

TEST_CASE("parallel_dims: sizes below one and unknown pipeline schedules are rejected naming the key") {
  CHECK_THROWS_WITH_AS(ParallelDims(dist(0), 4), "[distributed] tp_size must be >= 1, got 0", Error);
  CHECK_THROWS_WITH_AS(ParallelDims(dist(), 0), doctest::Contains("world size must be >= 1"), Error);
  DistributedConfig c;
  c.pipeline.pp_schedule = "zigzag";
  CHECK_THROWS_WITH_AS(ParallelDims(c, 1), doctest::Contains("pipeline.pp_schedule 'zigzag' is not one of gpipe"),
                       Error);
  c.pipeline.pp_schedule = "interleaved1f1b";
  CHECK(ParallelDims(c, 1).world() == 1);
}

TEST_CASE("parallel_dims: the sequence length must split into 2 * cp chunks and over tp under SP") {
  ParallelDims cp(dist(1, 1, 2), 2);
  CHECK_THROWS_WITH_AS(cp.check_seq_len(102), doctest::Contains("train.seq_len 102 is not divisible by 2 * cp_size = 4"),
                       Error);
  CHECK_NOTHROW(cp.check_seq_len(128));
  DistributedConfig sp = dist(4);
  sp.sequence_parallel = true;
  ParallelDims s(sp, 4);
  CHECK_THROWS_WITH_AS(s.check_seq_len(130), doctest::Contains("is not divisible by tp_size = 4"), Error);
  CHECK_NOTHROW(s.check_seq_len(128));
  CHECK_NOTHROW(ParallelDims(dist(4), 4).check_seq_len(130));  // no SP: the sequence is not split
}

TEST_CASE("parallel_dims: ranks lie row-major on (pp, dp_replicate, dp_shard, cp, tp) and share dp ranks across tp") {
  DistributedConfig c = dist(2, 2, 1);
  c.dp_replicate_size = 2;
  ParallelDims d(c, 16);  // pp 2, dp_replicate 2, dp_shard 2, cp 1, tp 2
  std::map<int64_t, int> per_dp_rank;
  for (int64_t r = 0; r < 16; ++r) {
    MeshCoords m = d.coords(r);
    int64_t back = (((m.pp * 2 + m.dp_replicate) * 2 + m.dp_shard) * 1 + m.cp) * 2 + m.tp;
    CHECK(back == r);
    ++per_dp_rank[d.dp_rank(r)];
  }
  CHECK(per_dp_rank.size() == 4);
  for (auto [rank, count] : per_dp_rank) CHECK(count == 4);  // 4 = tp 2 x pp 2 ranks read each slice
  CHECK(d.dp_rank(0) == d.dp_rank(1));                        // tp neighbours read the same batch
  CHECK(d.coords(1).tp == 1);
  CHECK_THROWS_WITH_AS(d.coords(16), doctest::Contains("rank 16 is outside the world of 16"), Error);
}

TEST_CASE("parallel_dims: strategy names parse and print back") {
  for (Strategy s : {Strategy::kFsdp2, Strategy::kMegatronFsdp, Strategy::kDdp})
    CHECK(parse_strategy(strategy_name(s)) == s);
  CHECK_THROWS_WITH_AS(parse_strategy("zero3"), doctest::Contains("strategy 'zero3' is not one of"), Error);
}

namespace {

// World ranks of the group `c` (in c's rank order), gathered from each member's world rank.
std::vector<int64_t> members(Communicator& c, int world_rank) {
  Tensor mine = full({1}, double(world_rank), {.dtype = DType::i64});
  Tensor all = zeros({c.size()}, {.dtype = DType::i64});
  c.all_gather(all, mine);
  std::vector<int64_t> out;
  for (double v : all.to_vector()) out.push_back(int64_t(v));
  return out;
}

std::vector<int64_t> as_i64(const std::vector<int>& v) { return {v.begin(), v.end()}; }

// The world ranks that agree with `rank` on every main axis outside `axes`, in world order.
std::vector<int64_t> expected_group(const ParallelDims& d, int64_t rank, const std::set<std::string>& axes) {
  auto get = [](const MeshCoords& m, const std::string& a) {
    return a == "pp" ? m.pp : a == "dp_replicate" ? m.dp_replicate : a == "dp_shard" ? m.dp_shard : a == "cp" ? m.cp : m.tp;
  };
  const MeshCoords me = d.coords(rank);
  std::vector<int64_t> out;
  for (int64_t r = 0; r < d.world(); ++r) {
    const MeshCoords o = d.coords(r);
    bool same = true;
    for (const char* a : {"pp", "dp_replicate", "dp_shard", "cp", "tp"})
      if (!axes.count(a)) same = same && get(o, a) == get(me, a);
    if (same) out.push_back(r);
  }
  return out;
}

// Index of `rank` along (dp_replicate, dp_shard, cp), row-major.
int64_t dp_cp_index(const ParallelDims& d, int64_t rank) {
  const MeshCoords m = d.coords(rank);
  return (m.dp_replicate * d.dp_shard() + m.dp_shard) * d.cp() + m.cp;
}

// Checks every mesh of `meshes` on this rank against the layout's arithmetic.
void check_meshes(const ParallelDims& d, const Meshes& meshes, int rank) {
  const MeshCoords c = d.coords(rank);
  CHECK(meshes.main.axis_names() == std::vector<std::string>{"pp", "dp_replicate", "dp_shard", "cp", "tp"});
  CHECK(meshes.main.coordinate() == Shape{c.pp, c.dp_replicate, c.dp_shard, c.cp, c.tp});
  const std::vector<std::pair<std::string, std::set<std::string>>> views = {
      {"pp", {"pp"}}, {"dp_replicate", {"dp_replicate"}}, {"dp_shard", {"dp_shard"}}, {"cp", {"cp"}}, {"tp", {"tp"}},
      {"dp", {"dp_replicate", "dp_shard"}}, {"dp_shard_cp", {"dp_shard", "cp"}},
      {"dp_cp", {"dp_replicate", "dp_shard", "cp"}}};
  for (const auto& entry : views) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    const auto& axes = entry.second;
    CAPTURE(name);
    const DeviceMesh m = meshes[name];
    const std::vector<int64_t> want = expected_group(d, rank, axes);
    CHECK(m.ndim() == 1);
    CHECK(m.axis_names()[0] == name);
    CHECK(as_i64(m.ranks()) == want);
    CHECK(members(m.comm(0), rank) == want);
    CHECK(want[size_t(m.coordinate(0))] == rank);
    CHECK(meshes.size(name) == int64_t(want.size()));
  }
  CHECK(meshes.size("dp") == d.dp());
  CHECK(meshes.size("dp_shard_cp") == d.dp_shard_cp());
  CHECK(meshes.size("dp_cp") == d.dp_cp());

  // MoE: ep groups are ep consecutive ranks in (dp_replicate, dp_shard, cp) order with this
  // rank's pp and tp coordinates; ep_shard groups take every ep-th of them.
  CHECK(meshes.moe.shape() == Shape{d.pp(), d.ep_shard(), d.ep()});
  const std::vector<int64_t> slice = expected_group(d, rank, {"dp_replicate", "dp_shard", "cp"});
  std::vector<int64_t> ep_want, ep_shard_want;
  for (int64_t r : slice) {
    if (dp_cp_index(d, r) / d.ep() == dp_cp_index(d, rank) / d.ep()) ep_want.push_back(r);
    if (dp_cp_index(d, r) % d.ep() == dp_cp_index(d, rank) % d.ep()) ep_shard_want.push_back(r);
  }
  CHECK(members(meshes["ep"].comm(0), rank) == ep_want);
  CHECK(members(meshes["ep_shard"].comm(0), rank) == ep_shard_want);
  CHECK(members(meshes.moe.comm(0), rank) == expected_group(d, rank, {"pp"}));
  CHECK(meshes.moe.coordinate() == Shape{c.pp, dp_cp_index(d, rank) / d.ep(), dp_cp_index(d, rank) % d.ep()});

  // HSDP's 2-D mesh: replicas over dp_replicate, shards over dp_shard x cp.
  const DeviceMesh hsdp = meshes.sub({"dp_replicate", "dp_shard_cp"});
  CHECK(hsdp.axis_names() == std::vector<std::string>{"dp_replicate", "dp_shard_cp"});
  CHECK(hsdp.shape() == Shape{d.dp_replicate(), d.dp_shard_cp()});
  CHECK(hsdp.coordinate() == Shape{c.dp_replicate, c.dp_shard * d.cp() + c.cp});
  CHECK(members(hsdp.comm(0), rank) == expected_group(d, rank, {"dp_replicate"}));
  CHECK(members(hsdp.comm(1), rank) == expected_group(d, rank, {"dp_shard", "cp"}));
  const DeviceMesh dp_tp = meshes.sub({"dp_shard", "tp"});  // plain axes: a sub-mesh of main
  CHECK(dp_tp.shape() == Shape{d.dp_shard(), d.tp()});
  CHECK(as_i64(dp_tp.ranks()) == expected_group(d, rank, {"dp_shard", "tp"}));
}

struct Layout {
  int world;
  int64_t tp = 1, pp = 1, cp = 1, ep = 1, dp_replicate = 1;
};

}  // namespace

TEST_CASE("parallel_dims: build_meshes gives every rank its coordinates, views and ep groups (world 1, 2, 4, 8)") {
  const std::vector<Layout> layouts = {
      {1},
      {2, 2},                    // tp 2
      {2},                       // dp_shard 2
      {2, 1, 2},                 // pp 2
      {2, 1, 1, 2, 2},           // cp 2, ep 2
      {4, 2},                    // dp_shard 2 x tp 2
      {4, 1, 1, 1, 2, 2},        // HSDP 2 x 2, ep 2
      {4, 2, 1, 2},              // cp 2 x tp 2
      {4, 1, 2, 1, 2},           // pp 2 x dp_shard 2, ep 2
      {8, 2, 2, 1, 2},           // pp 2 x dp_shard 2 x tp 2, ep 2
      {8, 2, 1, 1, 2, 2},        // HSDP 2 x 2 x tp 2, ep 2
      {8, 2, 1, 2, 4},           // dp_shard 2 x cp 2 x tp 2, ep 4 = dp * cp
      {8, 1, 1, 2, 2, 2},        // HSDP 2 x 2 x cp 2, ep 2
  };
  for (const Layout& l : layouts) {
    DistributedConfig c = dist(l.tp, l.pp, l.cp, l.ep);
    if (l.dp_replicate > 1) c.dp_replicate_size = l.dp_replicate;
    const ParallelDims d(c, l.world);
    CAPTURE(d.mesh_string());
    run_threads_group(l.world, [&](Communicator& comm) {
      const Meshes m = d.build_meshes(comm.shared_from_this());
      check_meshes(d, m, comm.rank());
    });
  }
}

TEST_CASE("parallel_dims: build_meshes refuses a world of another size, and unknown mesh names are named") {
  run_threads_group(2, [](Communicator& comm) {
    const ParallelDims d(dist(), 4);
    CHECK_THROWS_WITH_AS(d.build_meshes(comm.shared_from_this()),
                         doctest::Contains("the communicator has 2 ranks but the layout was validated for a world of 4"),
                         Error);
    const Meshes m = ParallelDims(dist(2), 2).build_meshes(comm.shared_from_this());
    CHECK_THROWS_WITH_AS(m["dq"], doctest::Contains("no mesh called 'dq'"), Error);
    CHECK_THROWS_WITH_AS(m.sub({"tp", "dp_shard"}), doctest::Contains("main-mesh order"), Error);
  });
}
