// Launch: detects the launcher from its environment, initialises MPI (or one local rank), picks
// the GPU of the local rank, builds the world communicator; rank-prefixed logging.
#include "collectives/launch.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "collectives/agree.h"
#include "collectives/internal.h"

namespace quilt {
namespace {

struct LaunchState {
  std::mutex mu;
  bool initialized = false;
  bool finalized = false;
  bool mpi = false;
  bool atexit_registered = false;
  LaunchInfo info;
  std::shared_ptr<Communicator> cpu_world;
  std::shared_ptr<Communicator> world;
};

LaunchState& launch_state() {
  static LaunchState* s = new LaunchState();  // never destroyed: used from atexit
  return *s;
}

// The first of `names` that is set, as an int (-1 when none is).
int int_var(const std::function<const char*(const char*)>& get, std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (const char* v = get(name); v && *v) return std::atoi(v);
  return -1;
}

// Slurm's tasks per node, "2(x3),1" = 2, 2, 2, 1: the count of node `node`, or -1.
int slurm_tasks_on_node(const char* spec, int node) {
  if (!spec || !*spec || node < 0) return -1;
  std::stringstream ss(spec);
  std::string item;
  int at = 0;
  while (std::getline(ss, item, ',')) {
    const int count = std::atoi(item.c_str());
    int repeat = 1;
    if (const size_t x = item.find("(x"); x != std::string::npos) repeat = std::atoi(item.c_str() + x + 2);
    if (node < at + repeat) return count;
    at += repeat;
  }
  return -1;
}

// Which launcher started us, from the variables each one sets.
std::string detect_launcher(const std::function<const char*(const char*)>& get) {
  auto set = [&](const char* name) {
    const char* v = get(name);
    return v && *v;
  };
  if (const char* forced = get("QUILT_LAUNCHER"); forced && *forced) {
    const std::string f = forced;
    QUILT_CHECK(f == "mpi" || f == "none", "[launch] QUILT_LAUNCHER must be 'mpi' or 'none', got '", f, "'");
    if (f == "none") return "none";
  }
  const bool slurm_step = set("SLURM_STEP_ID") || set("SLURM_STEPID");
  if (set("OMPI_COMM_WORLD_SIZE")) return "mpirun";
  if (set("PMIX_RANK") || set("PMI_RANK") || set("PMI_FD")) return slurm_step ? "srun" : "pmi";
  if (slurm_step && set("SLURM_PROCID")) return "srun";
  if (const char* forced = get("QUILT_LAUNCHER"); forced && std::string(forced) == "mpi") return "singleton";
  return "none";
}

int env_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(name); v && *v) return std::atoi(v);
  return 0;
}

struct LogState {
  std::mutex mu;
  bool configured = false;
  bool all = false;
  std::vector<int> ranks{0};
  int rank = -1;
};

LogState& log_state() {
  static LogState* s = new LogState();
  return *s;
}

bool selected(LogState& s, int rank) {
  if (!s.configured) {
    s.configured = true;
    if (const char* v = std::getenv("QUILT_LOG_RANKS"); v && *v) {
      const std::string text = v;
      if (text == "all") {
        s.all = true;
      } else {
        s.ranks.clear();
        std::stringstream ss(text);
        std::string item;
        while (std::getline(ss, item, ','))
          if (!item.empty()) s.ranks.push_back(std::atoi(item.c_str()));
      }
    }
  }
  return s.all || std::find(s.ranks.begin(), s.ranks.end(), rank) != s.ranks.end();
}

void write_line(int rank, const std::string& message) {
  // One write per line so ranks sharing a terminal do not interleave mid-line.
  const std::string line = detail::concat("[rank ", rank, "] ", message, "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace

LauncherEnv launcher_env(const std::function<const char*(const char*)>& get) {
  LauncherEnv e;
  e.launcher = detect_launcher(get);
  if (e.launcher == "mpirun") {
    e.rank = int_var(get, {"OMPI_COMM_WORLD_RANK"});
    e.world_size = int_var(get, {"OMPI_COMM_WORLD_SIZE"});
    e.local_rank = int_var(get, {"OMPI_COMM_WORLD_LOCAL_RANK"});
    e.local_size = int_var(get, {"OMPI_COMM_WORLD_LOCAL_SIZE"});
  } else if (e.launcher == "srun") {
    e.rank = int_var(get, {"SLURM_PROCID"});
    e.world_size = int_var(get, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
    e.local_rank = int_var(get, {"SLURM_LOCALID"});
    const int node = int_var(get, {"SLURM_NODEID"});
    const char* per_node = get("SLURM_STEP_TASKS_PER_NODE");
    if (!per_node || !*per_node) per_node = get("SLURM_TASKS_PER_NODE");
    e.local_size = slurm_tasks_on_node(per_node, node);
  } else if (e.launcher == "pmi") {
    e.rank = int_var(get, {"PMIX_RANK", "PMI_RANK"});
    e.world_size = int_var(get, {"PMI_SIZE"});
  }
  return e;
}

int device_for_local_rank(int local_rank, int device_count) {
  QUILT_CHECK(device_count > 0, "[launch] no GPU for local rank ", local_rank);
  QUILT_CHECK(local_rank >= 0, "[launch] local rank ", local_rank, " is negative");
  return local_rank % device_count;
}

namespace detail {
void set_log_rank(int rank) {
  std::lock_guard lk(log_state().mu);
  log_state().rank = rank;
}
int log_rank() {
  std::lock_guard lk(log_state().mu);
  return log_state().rank >= 0 ? log_state().rank : env_rank();
}
}  // namespace detail

void set_log_ranks(std::vector<int> ranks) {
  LogState& s = log_state();
  std::lock_guard lk(s.mu);
  s.configured = true;
  s.all = false;
  s.ranks = std::move(ranks);
}

void set_log_all_ranks() {
  LogState& s = log_state();
  std::lock_guard lk(s.mu);
  s.configured = true;
  s.all = true;
}

void log_text(const std::string& message) {
  LogState& s = log_state();
  int rank = 0;
  {
    std::lock_guard lk(s.mu);
    rank = s.rank >= 0 ? s.rank : env_rank();
    if (!selected(s, rank)) return;
  }
  write_line(rank, message);
}

void log_text_every_rank(const std::string& message) { write_line(detail::log_rank(), message); }

std::string shared_gpu_error(const std::vector<GpuIdentity>& gpus) {
  for (size_t a = 0; a < gpus.size(); ++a)
    for (size_t b = a + 1; b < gpus.size(); ++b) {
      if (gpus[a].uuid != gpus[b].uuid) continue;
      return detail::concat("[launch] the nccl backend needs a GPU per rank, but ranks ", a, " and ", b,
                            " share the GPU ", gpus[a].bus_id, " on host ", gpus[a].host,
                            ": launch at most as many ranks per host as it has GPUs (each local rank takes GPU "
                            "local_rank % the GPUs it sees), or use the mpi backend (dist_env.backend: mpi), "
                            "whose ranks may share a GPU");
    }
  return "";
}

const LaunchInfo& init_from_launcher(const LaunchOptions& opts) {
  LaunchState& s = launch_state();
  std::lock_guard lk(s.mu);
  if (s.initialized) return s.info;
  QUILT_CHECK(!s.finalized, "[launch] init_from_launcher() after finalize(): MPI cannot be initialised twice");
  const LauncherEnv env = launcher_env([](const char* name) -> const char* { return std::getenv(name); });
  const std::string& launcher = env.launcher;
  if (launcher == "none") {
    s.cpu_world = detail::make_local_communicator(opts.comm);
    s.info = LaunchInfo{};
  } else {
    detail::MpiWorld w = detail::mpi_init_world(opts.comm, launcher);
    s.cpu_world = w.world;
    s.info = w.info;
    s.mpi = true;
    // The launcher's numbers (srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) are what users
    // and job scripts see; MPI must agree on rank and world, and the local rank (which picks
    // the GPU) is the launcher's when it gives one, else MPI's shared-memory split.
    const char* vars = launcher == "srun" ? " (SLURM_PROCID of SLURM_NTASKS)" : launcher == "mpirun"
                                              ? " (OMPI_COMM_WORLD_RANK of OMPI_COMM_WORLD_SIZE)" : "";
    QUILT_CHECK((env.rank < 0 || env.rank == s.info.rank) && (env.world_size < 0 || env.world_size == s.info.world_size),
                "[launch] the ", launcher, " environment says rank ", env.rank, " of ", env.world_size, vars,
                ", MPI says rank ", s.info.rank, " of ", s.info.world_size);
    if (env.local_rank >= 0) s.info.local_rank = env.local_rank;
    if (env.local_size > 0) s.info.local_size = env.local_size;
  }
  detail::set_log_rank(s.info.rank);
  if (cuda::is_available() && cuda::device_count() > 0) {
    s.info.device = Device::cuda(device_for_local_rank(s.info.local_rank, cuda::device_count()));
    cuda::set_device(s.info.device.index);
  }
  bool use_nccl = false;
  switch (opts.backend) {
    case WorldBackend::automatic: use_nccl = s.info.device.is_cuda() && nccl_available(); break;
    case WorldBackend::mpi: use_nccl = false; break;
    case WorldBackend::nccl:
      QUILT_CHECK(nccl_available() && s.info.device.is_cuda(), "[launch] the nccl backend was asked for, but ",
                  s.info.device.is_cuda() ? "this build has no NCCL" : "rank has no usable GPU: " + cuda::unavailable_reason());
      use_nccl = true;
      break;
  }
  if (use_nccl && s.cpu_world->size() > 1) {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    const int d = s.info.device.index;
    const std::vector<std::string> all =
        all_gather_text(*s.cpu_world, detail::concat(cuda::uuid(d), "\t", host, "\t", cuda::pci_bus_id(d)));
    std::vector<GpuIdentity> gpus;
    for (const std::string& line : all) {
      const size_t t1 = line.find('\t'), t2 = line.find('\t', t1 + 1);
      gpus.push_back({line.substr(0, t1), line.substr(t1 + 1, t2 - t1 - 1), line.substr(t2 + 1)});
    }
    const std::string err = shared_gpu_error(gpus);
    QUILT_CHECK(err.empty(), err);
  }
  s.world = use_nccl ? make_nccl_communicator(*s.cpu_world, s.info.device, opts.comm) : s.cpu_world;
  s.initialized = true;
  if (!s.atexit_registered) {
    s.atexit_registered = true;
    std::atexit([] {
      try {
        finalize();
      } catch (const std::exception& e) {
        log_text_every_rank(detail::concat("[launch] finalize at exit failed: ", e.what()));
      }
    });
  }
  return s.info;
}

bool is_initialized() {
  std::lock_guard lk(launch_state().mu);
  return launch_state().initialized;
}

const LaunchInfo& launch_info() {
  LaunchState& s = launch_state();
  std::lock_guard lk(s.mu);
  QUILT_CHECK(s.initialized, "[launch] launch_info() before init_from_launcher()");
  return s.info;
}

std::shared_ptr<Communicator> world_ptr() {
  if (!is_initialized()) init_from_launcher();
  LaunchState& s = launch_state();
  std::lock_guard lk(s.mu);
  QUILT_CHECK(s.world, "[launch] the world communicator is gone: finalize() has run");
  return s.world;
}

Communicator& world() { return *world_ptr(); }

Communicator& cpu_world() {
  if (!is_initialized()) init_from_launcher();
  LaunchState& s = launch_state();
  std::lock_guard lk(s.mu);
  QUILT_CHECK(s.cpu_world, "[launch] the world communicator is gone: finalize() has run");
  return *s.cpu_world;
}

void exit_on_error(const std::exception& error) {
  const std::string text = detail::concat("quilt: error: ", error.what());
  bool mpi = false;
  {
    LaunchState& s = launch_state();
    std::lock_guard lk(s.mu);
    mpi = s.initialized && s.mpi && s.info.world_size > 1;
  }
  if (!mpi) {
    std::fprintf(stderr, "%s\n", text.c_str());
    std::exit(1);
  }
  // An agreed error is printed by its reporter, whose notice then ends this rank (in the
  // watchdog); if none comes, the reporter is gone and this rank speaks instead.
  const auto* agreed = dynamic_cast<const AgreedError*>(&error);
  if (agreed && !agreed->reporter()) std::this_thread::sleep_for(std::chrono::seconds(2));
  log_text_every_rank(text);
  if (!detail::mpi_announce_failure(error.what(), /*printed=*/agreed != nullptr)) detail::mpi_abort_world(1);
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(1);
}

void finalize() {
  LaunchState& s = launch_state();
  std::lock_guard lk(s.mu);
  if (!s.initialized || s.finalized) return;
  s.world.reset();
  if (s.mpi) detail::mpi_finalize_world();
  s.cpu_world.reset();
  s.finalized = true;
  s.initialized = false;
}

}  // namespace quilt
