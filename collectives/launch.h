// Process start-up for multi-rank runs: MPI bootstraps every launch (mpirun/mpiexec, srun with
// PMIx or PMI2); a program started without a launcher runs as one rank without MPI. It finds the
// rank, world size, local rank (ranks sharing this host), picks the GPU of the local rank, and
// builds the world communicator (NCCL on GPUs, MPI otherwise). Log lines carry "[rank N]".
//
//   int main() {
//     quilt::init_from_launcher();
//     quilt::log_line("world of ", quilt::world().size());   // "[rank 0] world of 4", rank 0 only
//     ...
//     quilt::finalize();                                     // also runs at exit
//   }
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "engine/error.h"

namespace quilt {

/// Which backend the world communicator uses.
enum class WorldBackend : uint8_t {
  automatic,  // nccl when this build has NCCL and the local rank has a GPU, else mpi
  mpi,
  nccl,
};

/// Options of init_from_launcher.
struct LaunchOptions {
  WorldBackend backend = WorldBackend::automatic;
  CommOptions comm;
};

/// What the launcher told this process.
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;   // rank among the processes on this host (SLURM_LOCALID under srun)
  int local_size = 1;   // processes on this host
  std::string launcher = "none";  // "mpirun", "srun", "pmi" (another PMI launcher) or "none"
  std::string mpi_thread_level;   // "multiple", "serialized", ... ("" without MPI)
  Device device = Device::cpu();  // cuda:(local_rank % device count) when a GPU is usable
};

/// What a launcher's environment says about this process, before MPI starts: which launcher,
/// and the rank, world size, local rank and local size it sets (-1 where it sets none). srun
/// sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_STEP_NUM_TASKS/SLURM_TASKS_PER_NODE;
/// mpirun sets OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK and _LOCAL_SIZE.
struct LauncherEnv {
  std::string launcher = "none";  // as LaunchInfo::launcher, or "singleton" (QUILT_LAUNCHER=mpi alone)
  int rank = -1;
  int world_size = -1;
  int local_rank = -1;
  int local_size = -1;
};

/// Reads the launcher's variables through `get` (a getenv; tests pass their own).
LauncherEnv launcher_env(const std::function<const char*(const char*)>& get);

/// The GPU index of a local rank among the `device_count` GPUs this process sees: local rank i
/// takes GPU i mod count. With one GPU per task bound by the launcher (srun --gpus-per-task,
/// CUDA_VISIBLE_DEVICES narrowed to one) every rank sees one GPU and takes index 0; with all of a
/// node's GPUs visible, SLURM_LOCALID (or Open MPI's local rank) picks one, so ranks 0..3 of a
/// 4-GPU node take GPUs 0..3 whatever the node's socket layout (Slurm's default block order
/// numbers the tasks of a node socket by socket).
int device_for_local_rank(int local_rank, int device_count);

/// A rank's GPU: its UUID (what identifies it) and, for messages, its host and PCI bus id.
struct GpuIdentity {
  std::string uuid, host, bus_id;
};
/// The nccl backend needs a GPU per rank (NCCL refuses two ranks of one communicator on one
/// device). `gpus[r]` is rank r's GPU; returns the error naming the first two ranks that share
/// one, or "" when none do.
std::string shared_gpu_error(const std::vector<GpuIdentity>& gpus);

/// Initialises MPI (when launched by a launcher), the watchdog and the world communicator.
/// Calling it again returns the existing state. QUILT_LAUNCHER=mpi forces MPI without a
/// launcher (an MPI singleton), QUILT_LAUNCHER=none forces one rank without MPI.
const LaunchInfo& init_from_launcher(const LaunchOptions& opts = {});
/// True after init_from_launcher() and before finalize().
bool is_initialized();
/// The launch facts (init_from_launcher() must have run).
const LaunchInfo& launch_info();
/// The world communicator (initialises with defaults on first use).
Communicator& world();
/// Shared handle to the world communicator.
std::shared_ptr<Communicator> world_ptr();
/// The host-memory world (MPI, or one local rank): for CPU-side coordination on GPU runs.
Communicator& cpu_world();
/// Waits for outstanding work, shuts the watchdog down and finalizes MPI. Registered to run at
/// exit too; safe to call twice. Communicators must not be used afterwards.
void finalize();

/// Ends this process because of `error`, so that the whole job ends within about a second with
/// the error as the last line it prints. One process (no launcher, or a world of one): prints
/// "quilt: error: <what>" and exits with status 1. Several ranks: prints
/// "[rank R] quilt: error: <what>" (an AgreedError, which every rank holds, only on the rank
/// that reports it), tells every other rank, whose watchdogs end them at once (the ranks that
/// log print "rank R failed: <what>" first), and exits with status 1 without waiting for
/// anyone. Without MPI_THREAD_MULTIPLE the notice cannot be heard and the job is aborted with
/// MPI_Abort instead.
[[noreturn]] void exit_on_error(const std::exception& error);

/// Ranks whose log_line output is printed: {0} by default; QUILT_LOG_RANKS=all or "0,3" at start.
void set_log_ranks(std::vector<int> ranks);
/// Prints every rank's lines from now on.
void set_log_all_ranks();
/// Prints "[rank N] <message>" to stderr when this rank is selected for logging.
void log_text(const std::string& message);
/// Prints "[rank N] <message>" to stderr on every rank (errors and warnings).
void log_text_every_rank(const std::string& message);

/// log_text of the pieces concatenated (vectors print as shapes).
template <class... Args>
void log_line(const Args&... args) {
  log_text(detail::concat(args...));
}
/// log_text_every_rank of the pieces concatenated.
template <class... Args>
void log_line_every_rank(const Args&... args) {
  log_text_every_rank(detail::concat(args...));
}

}  // namespace quilt
