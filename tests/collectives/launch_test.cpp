// What each launcher's environment gives (rank, world, local rank, local size) and the GPU a
// local rank takes, from environments set up as srun and mpirun set them (no launcher runs).
#include <doctest/doctest.h>

#include <map>
#include <string>

#include "collectives/launch.h"

using namespace quilt;

namespace {

// A getenv over a fixed set of variables.
LauncherEnv env_of(const std::map<std::string, std::string>& vars) {
  return launcher_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

}  // namespace

TEST_CASE("launch env: srun with pmix gives rank, world and local rank from SLURM_* on the second of two nodes") {
  // Task 6 of 8 with 4 tasks per node: node 1, local id 2.
  const LauncherEnv e = env_of({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"},
                                {"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_LOCALID", "2"}, {"SLURM_NODEID", "1"},
                                {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}, {"PMIX_RANK", "6"}});
  CHECK(e.launcher == "srun");
  CHECK(e.rank == 6);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 2);
  CHECK(e.local_size == 4);
}

TEST_CASE("launch env: uneven Slurm task counts per node give each node its own local size") {
  std::map<std::string, std::string> vars = {{"SLURM_STEPID", "3"}, {"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"},
                                             {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x3),1"}};
  vars["SLURM_NODEID"] = "2";
  CHECK(env_of(vars).local_size == 2);
  vars["SLURM_NODEID"] = "3";
  CHECK(env_of(vars).local_size == 1);
  CHECK(env_of(vars).launcher == "srun");  // no PMI variables: srun --mpi=none still counts as srun
}

TEST_CASE("launch env: mpirun's OMPI_COMM_WORLD_* win over Slurm variables of the enclosing job") {
  const LauncherEnv e = env_of({{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "3"},
                                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                {"SLURM_JOB_ID", "17"}, {"SLURM_LOCALID", "0"}, {"SLURM_PROCID", "0"}});
  CHECK(e.launcher == "mpirun");
  CHECK(e.rank == 3);
  CHECK(e.world_size == 4);
  CHECK(e.local_rank == 1);
  CHECK(e.local_size == 2);
}

TEST_CASE("launch env: no launcher variables, or QUILT_LAUNCHER=none, is one rank without MPI") {
  CHECK(env_of({}).launcher == "none");
  CHECK(env_of({}).rank == -1);
  CHECK(env_of({{"QUILT_LAUNCHER", "none"}, {"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "1"}}).launcher == "none");
  CHECK(env_of({{"QUILT_LAUNCHER", "mpi"}}).launcher == "singleton");
  CHECK_THROWS_WITH(env_of({{"QUILT_LAUNCHER", "slurm"}}), doctest::Contains("QUILT_LAUNCHER must be 'mpi' or 'none'"));
}

TEST_CASE("launch env: SLURM_LOCALID picks the GPU, one per local rank, or GPU 0 when Slurm binds one per task") {
  // A 2-socket node with 8 GPUs and 8 tasks: local ids 0..7 take GPUs 0..7.
  for (int id = 0; id < 8; ++id) {
    const LauncherEnv e = env_of({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", std::to_string(8 + id)},
                                  {"SLURM_LOCALID", std::to_string(id)}, {"SLURM_NODEID", "1"}});
    CHECK(device_for_local_rank(e.local_rank, 8) == id);
    // --gpus-per-task=1: CUDA_VISIBLE_DEVICES holds one GPU, which every task sees as device 0.
    CHECK(device_for_local_rank(e.local_rank, 1) == 0);
  }
  // More tasks than GPUs share them round-robin.
  CHECK(device_for_local_rank(5, 4) == 1);
  CHECK_THROWS_WITH(device_for_local_rank(0, 0), doctest::Contains("no GPU for local rank 0"));
}

TEST_CASE("launch: the nccl backend refuses two ranks on one GPU, naming both ranks, the GPU and the host") {
  // Two hosts of two GPUs each, the same bus ids (and host names, as containers may have) on
  // both: distinct GPUs pass.
  const GpuIdentity a{"aa01", "node", "0000:41:00.0"}, b{"bb02", "node", "0000:c1:00.0"},
      c{"cc03", "node", "0000:41:00.0"}, d{"dd04", "node", "0000:c1:00.0"};
  CHECK(shared_gpu_error({a, b, c, d}).empty());
  CHECK(shared_gpu_error({}).empty());
  CHECK(shared_gpu_error({a}).empty());
  // Three ranks on a host of two GPUs: local rank 2 takes GPU 2 % 2 = 0, as rank 0 did.
  const std::string err = shared_gpu_error({a, b, a});
  CHECK(err.find("ranks 0 and 2 share the GPU 0000:41:00.0 on host node") != std::string::npos);
  CHECK(err.find("dist_env.backend: mpi") != std::string::npos);
}
