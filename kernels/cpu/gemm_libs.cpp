// The GEMM libraries (see gemm_libs.h): loading, calling, measuring and choosing.
#include "kernels/cpu/gemm_libs.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <omp.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/eigen_map.h"

#ifndef QUILT_SYSTEM_LIBDIR
#define QUILT_SYSTEM_LIBDIR "/usr/lib/x86_64-linux-gnu"
#endif

namespace quilt::kernels::cpu::gemm_libs {
namespace {

namespace fs = std::filesystem;

// CBLAS (OpenBLAS and BLIS, 32-bit integers as Debian builds both).
using CblasS = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                        int);
using CblasD = void (*)(int, int, int, int, int, int, double, const double*, int, const double*, int, double,
                        double*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
// oneDNN's row-major GEMMs (dnnl_dim_t is int64_t; they return a dnnl_status_t, 0 = success).
using DnnlS = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                      float, float*, int64_t);
using DnnlBf16 = int (*)(char, char, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, const uint16_t*,
                         int64_t, float, float*, int64_t);

struct Loaded {
  void* handle = nullptr;
  CblasS cblas_s = nullptr;
  CblasD cblas_d = nullptr;
  DnnlS dnnl_s = nullptr;
  DnnlBf16 dnnl_bf16 = nullptr;
  void (*set_threads)(int) = nullptr;       // openblas_set_num_threads
  void (*set_threads64)(int64_t) = nullptr;  // bli_thread_set_num_threads
  int native_bf16 = -1;                     // probed on first use: 1 yes, 0 no
};

void* open_lib(const std::string& path) { return dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL); }

template <class F>
F sym(void* h, const char* name) {
  return reinterpret_cast<F>(dlsym(h, name));
}

Loaded load_openblas() {
  Loaded l;
  // Only the OpenMP build: the pthread one keeps its own pool, which competes with OpenMP's.
  l.handle = open_lib(std::string(QUILT_SYSTEM_LIBDIR) + "/openblas-openmp/libopenblas.so.0");
  if (!l.handle) return {};
  auto parallel = sym<int (*)()>(l.handle, "openblas_get_parallel");
  l.cblas_s = sym<CblasS>(l.handle, "cblas_sgemm");
  l.cblas_d = sym<CblasD>(l.handle, "cblas_dgemm");
  l.set_threads = sym<void (*)(int)>(l.handle, "openblas_set_num_threads");
  if (!parallel || parallel() != 2 || !l.cblas_s || !l.cblas_d) return {};  // 2: OpenMP threading
  return l;
}

Loaded load_blis() {
  Loaded l;
  l.handle = open_lib(std::string(QUILT_SYSTEM_LIBDIR) + "/blis-openmp/libblis.so.4");
  if (!l.handle) return {};
  l.cblas_s = sym<CblasS>(l.handle, "cblas_sgemm");
  l.cblas_d = sym<CblasD>(l.handle, "cblas_dgemm");
  l.set_threads64 = sym<void (*)(int64_t)>(l.handle, "bli_thread_set_num_threads");
  if (!l.cblas_s || !l.cblas_d || !l.set_threads64) return {};
  return l;
}

Loaded load_onednn() {
  Loaded l;
  l.handle = open_lib("libdnnl.so.2");
  if (!l.handle) l.handle = open_lib(std::string(QUILT_SYSTEM_LIBDIR) + "/libdnnl.so.2");
  if (!l.handle) return {};
  l.dnnl_s = sym<DnnlS>(l.handle, "dnnl_sgemm");
  l.dnnl_bf16 = sym<DnnlBf16>(l.handle, "dnnl_gemm_bf16bf16f32");
  if (!l.dnnl_s) return {};
  return l;
}

Loaded (&libs())[kNumLibs] {
  static Loaded table[kNumLibs] = {Loaded{}, load_openblas(), load_blis(), load_onednn()};
  return table;
}

const char* const kNames[kNumLibs] = {"eigen", "openblas", "blis", "onednn"};
const char* const kPackages[kNumLibs] = {"", "libopenblas-openmp-dev", "libblis-openmp-dev", "libdnnl-dev"};

// The libraries' own thread counts follow OpenMP's, set outside parallel regions only.
std::atomic<int> g_lib_threads{-1};

void sync_threads() {
  if (omp_in_parallel()) return;  // nested calls run on one thread in every library
  const int n = omp_get_max_threads();
  if (g_lib_threads.load(std::memory_order_relaxed) == n) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  for (auto& l : libs()) {
    if (l.set_threads) l.set_threads(n);
    if (l.set_threads64) l.set_threads64(n);
  }
  g_lib_threads.store(n);
}

bool fits_int(const GemmArgs& g) {
  for (int64_t v : {g.m, g.n, g.k, g.lda, g.ldb, g.ldc})
    if (v > INT_MAX) return false;
  return true;
}

template <class T>
void eigen_gemm_t(const GemmArgs& g, const T* a, const T* b, T* c) {
  CMap<T> A(a, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, Eigen::OuterStride<>(g.lda));
  CMap<T> B(b, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, Eigen::OuterStride<>(g.ldb));
  MMap<T> C(c, g.m, g.n, Eigen::OuterStride<>(g.ldc));
  const T alpha = T(g.alpha);
  if (g.beta == 0.0f) {
    if (!g.trans_a && !g.trans_b) C.noalias() = alpha * (A * B);
    else if (g.trans_a && !g.trans_b) C.noalias() = alpha * (A.transpose() * B);
    else if (!g.trans_a && g.trans_b) C.noalias() = alpha * (A * B.transpose());
    else C.noalias() = alpha * (A.transpose() * B.transpose());
  } else {
    C *= T(g.beta);
    if (!g.trans_a && !g.trans_b) C.noalias() += alpha * (A * B);
    else if (g.trans_a && !g.trans_b) C.noalias() += alpha * (A.transpose() * B);
    else if (!g.trans_a && g.trans_b) C.noalias() += alpha * (A * B.transpose());
    else C.noalias() += alpha * (A.transpose() * B.transpose());
  }
}

// --- the choice -----------------------------------------------------------------------------

std::string read_cpu_signature() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model, flags;
  while (std::getline(in, line) && (model.empty() || flags.empty())) {
    if (model.empty() && line.rfind("model name", 0) == 0) model = line;
    if (flags.empty() && line.rfind("flags", 0) == 0) flags = line;
  }
  return model + "\n" + flags;
}

// The CPU's model name and flags, read once (reading /proc/cpuinfo takes milliseconds).
const std::string& cpu_signature() {
  static const std::string signature = read_cpu_signature();
  return signature;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

fs::path cache_dir() {
  if (const char* d = std::getenv("QUILT_CACHE_DIR"); d && *d) return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) return fs::path(d) / "quilt";
  if (const char* d = std::getenv("HOME"); d && *d) return fs::path(d) / ".cache" / "quilt";
  return {};
}

// The cache files' path without extension: the directory and a hash of what the choice depends
// on (CPU model and flags, thread count, libraries present); empty without a cache directory.
fs::path cache_stem() {
  const fs::path dir = cache_dir();
  if (dir.empty()) return {};
  std::string key = cpu_signature() + "\nthreads " + std::to_string(omp_get_max_threads());
  for (int i = 0; i < kNumLibs; ++i)
    if (present(Lib(i))) key += std::string(" ") + kNames[i];
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fnv1a(key)));
  return dir / (std::string("gemm-") + hex);
}

// An exclusive lock on `stem`.lock for as long as it lives (processes measuring at once take
// turns, and each measures undisturbed by the others).
struct FileLock {
  int fd = -1;
  explicit FileLock(const fs::path& stem) {
    std::error_code ec;
    fs::create_directories(stem.parent_path(), ec);
    fd = ::open((stem.string() + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (fd >= 0) ::flock(fd, LOCK_EX);
  }
  ~FileLock() {
    if (fd < 0) return;
    ::flock(fd, LOCK_UN);
    ::close(fd);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
};

// The GEMMs of a linear layer in training, at 1024 tokens, hidden 512 and intermediate 1376,
// one per transpose mode: forward x·Wᵀ (NT), dX = dY·W (NN), dW = dYᵀ·X (TN), and TT alike.
struct Probe {
  static constexpr int64_t t = 1024, h = 512, f = 1376;
  // Sized for the largest operand of any mode: B of TT is (f, t).
  std::vector<float> a = filled(t * f, 7), b = filled(f * t, 5), c = filled(t * f, 3);
  static std::vector<float> filled(int64_t n, int mod) {
    std::vector<float> v(static_cast<size_t>(n));
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(int(i % size_t(mod)) - mod / 2) * 0.25f;
    return v;
  }
  double flops() const { return 2.0 * double(t * h * f); }
  // mode = 2·trans_a + trans_b
  double seconds(Lib lib, int mode) {
    GemmArgs g;
    switch (mode) {
      case 0: g = {.m = t, .n = h, .k = f, .lda = f, .ldb = h, .ldc = h}; break;                     // dX
      case 1: g = {.m = t, .n = f, .k = h, .trans_b = true, .lda = h, .ldb = h, .ldc = f}; break;    // forward
      case 2: g = {.m = f, .n = h, .k = t, .trans_a = true, .lda = f, .ldb = h, .ldc = h}; break;    // dW
      default: g = {.m = h, .n = f, .k = t, .trans_a = true, .trans_b = true, .lda = h, .ldb = t, .ldc = f};
    }
    const auto t0 = std::chrono::steady_clock::now();
    sgemm(lib, g, a.data(), b.data(), c.data());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

const char* const kModes[4] = {"NN", "NT", "TN", "TT"};

// Tiles of a grouped GEMM (kernels/cpu/moe.cpp) as its region runs them: every thread one
// single-threaded GEMM at once, 256 rows of an expert's tokens (hidden 2048) against 512 columns
// of its weight, in each transpose mode.
struct TileProbe {
  static constexpr int64_t m = 256, n = 512, k = 2048;
  const int threads = std::max(1, omp_get_max_threads());
  std::vector<float> a = Probe::filled(m * k, 7), b = Probe::filled(k * n, 5),
                     c = Probe::filled(m * n * threads, 3);
  double flops() const { return 2.0 * double(m * n * k) * threads; }
  double seconds(Lib lib, int mode) {
    const bool ta = mode & 2, tb = mode & 1;
    const GemmArgs g{.m = m, .n = n, .k = k, .trans_a = ta, .trans_b = tb, .lda = ta ? m : k, .ldb = tb ? k : n,
                     .ldc = n};
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      omp_set_num_threads(1);  // as inside the grouped GEMM's region
      sgemm(lib, g, a.data(), b.data(), c.data() + m * n * omp_get_thread_num());
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

// Per mode, the present library with the best of `rounds` interleaved timings of `probe`.
template <class P>
void pick(const std::vector<Lib>& present_libs, P& probe, Lib* by_mode, std::ostringstream& why) {
  std::vector<std::array<double, 4>> rate(present_libs.size(), std::array<double, 4>{});
  for (Lib lib : present_libs)
    for (int mode = 0; mode < 4; ++mode) probe.seconds(lib, mode);  // warm: threads started, code paged in
  for (int round = 0; round < 3; ++round)
    for (int mode = 0; mode < 4; ++mode)
      for (size_t i = 0; i < present_libs.size(); ++i)
        rate[i][size_t(mode)] =
            std::max(rate[i][size_t(mode)], probe.flops() / probe.seconds(present_libs[i], mode) * 1e-9);
  for (int mode = 0; mode < 4; ++mode) {
    std::vector<size_t> order(present_libs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t x, size_t y) { return rate[x][size_t(mode)] > rate[y][size_t(mode)]; });
    by_mode[mode] = present_libs[order.front()];
    why << (mode ? "; " : "") << kModes[mode];
    for (size_t i : order) {
      char buf[64];
      std::snprintf(buf, sizeof buf, " %s %.0f", kNames[int(present_libs[i])], rate[i][size_t(mode)]);
      why << buf;
    }
  }
  why << " GFLOP/s";
}

// Every present library in every transpose mode, in interleaved rounds (a burst of load from
// elsewhere then slows all of them alike), each scored by its best round; per mode the fastest,
// over every thread (Probe) and, for grouped GEMM tiles, on one (TileProbe).
Choice measure_all() {
  std::vector<Lib> present_libs;
  for (int i = 0; i < kNumLibs; ++i)
    if (present(Lib(i))) present_libs.push_back(Lib(i));
  Choice c;
  std::ostringstream why, tile_why;
  Probe probe;
  pick(present_libs, probe, c.by_mode, why);
  TileProbe tile;
  pick(present_libs, tile, c.tile_by_mode, tile_why);
  c.reason = why.str() + "; grouped GEMM tiles, a thread each: " + tile_why.str();
  return c;
}

Lib parse(const std::string& name, const char* what) {
  for (int i = 0; i < kNumLibs; ++i) {
    if (name != kNames[i]) continue;
    if (!present(Lib(i)))
      throw std::runtime_error(std::string(what) + "=" + name + ": " + name + " is not installed (Debian package " +
                               kPackages[i] + "); present: " + [] {
                                 std::string p;
                                 for (int j = 0; j < kNumLibs; ++j)
                                   if (present(Lib(j))) p += std::string(p.empty() ? "" : ", ") + kNames[j];
                                 return p;
                               }());
    return Lib(i);
  }
  throw std::runtime_error(std::string(what) + "=" + name +
                           ": unknown GEMM library (one of: eigen, openblas, blis, onednn)");
}

Choice choose_impl(bool remeasure) {
  if (const char* v = std::getenv("QUILT_GEMM"); v && *v) return Choice::all(parse(v, "QUILT_GEMM"), std::string("QUILT_GEMM=") + v);
  int n_present = 0;
  for (int i = 0; i < kNumLibs; ++i) n_present += present(Lib(i));
  if (n_present == 1) return Choice::all(Lib::eigen, "the only GEMM library present");

  const fs::path dir = cache_dir();
  if (dir.empty()) {
    Choice c = measure_all();
    c.reason = "fastest measured now: " + c.reason + " (no cache directory: HOME unset)";
    return c;
  }
  const fs::path file = cache_stem().string() + ".txt";
  auto read_cached = [&](Choice& out) {
    std::ifstream in(file);
    std::string names, rates;
    if (!std::getline(in, names) || !std::getline(in, rates)) return false;
    std::string tiles;
    if (!std::getline(in, tiles)) return false;  // a cache from before the tile choice: measure again
    Choice read;
    for (auto [line, into] : {std::pair{&names, read.by_mode}, std::pair{&tiles, read.tile_by_mode}}) {
      std::istringstream words(*line);
      for (int mode = 0; mode < 4; ++mode) {
        std::string name;
        if (!(words >> name)) return false;
        int found = -1;
        for (int i = 0; i < kNumLibs; ++i)
          if (name == kNames[i] && present(Lib(i))) found = i;
        if (found < 0) return false;
        into[mode] = Lib(found);
      }
    }
    read.reason = "fastest measured on this CPU: " + rates + " (cached in " + file.string() + ")";
    out = read;
    return true;
  };
  Choice c;
  if (!remeasure && read_cached(c)) return c;
  std::error_code ec;
  // Ranks that start together: one measures, the others wait for its file.
  FileLock lock(cache_stem());
  if (remeasure || !read_cached(c)) {
    c = measure_all();
    const std::string rates = c.reason;
    const fs::path tmp = file.string() + ".tmp" + std::to_string(::getpid());
    bool saved = false;
    {
      std::ofstream out(tmp);
      for (int mode = 0; mode < 4; ++mode) out << kNames[int(c.by_mode[mode])] << (mode < 3 ? " " : "\n");
      out << rates << "\n";
      for (int mode = 0; mode < 4; ++mode) out << kNames[int(c.tile_by_mode[mode])] << (mode < 3 ? " " : "\n");
      saved = bool(out.flush());
    }
    if (saved) fs::rename(tmp, file, ec);
    saved = saved && !ec;
    if (!saved) fs::remove(tmp, ec);
    c.reason = "fastest measured on this CPU: " + rates +
               (saved ? " (cached in " + file.string() + ")" : " (cache not writable: " + dir.string() + ")");
  }
  return c;
}

std::once_flag g_chosen;
std::atomic<int> g_active[4] = {0, 0, 0, 0};  // per transpose mode
std::atomic<int> g_active_tile[4] = {0, 0, 0, 0};  // per transpose mode, grouped GEMM tiles
std::atomic<bool> g_forced{false};  // one library everywhere: no shape classes
Choice g_choice;       // as made on first use, for set_auto
std::string g_reason;  // written once under g_chosen, or by set_active / set_auto
std::mutex g_reason_mu;

void apply(const Choice& c) {  // under g_reason_mu
  g_reason = c.reason + (bf16_native() ? "; bf16: native (oneDNN)" : "; bf16: widened to f32") +
             (c.forced ? "" : "; GEMMs of 2^24 multiply-adds or more: per shape class, measured on first use");
  for (int mode = 0; mode < 4; ++mode) {
    g_active[mode].store(int(c.by_mode[mode]));
    g_active_tile[mode].store(int(c.tile_by_mode[mode]));
  }
  g_forced.store(c.forced);
}

void ensure_chosen() {
  std::call_once(g_chosen, [] {
    Choice c = choose_impl(false);
    std::lock_guard<std::mutex> lock(g_reason_mu);
    g_choice = c;
    apply(c);
  });
}

// --- shape classes ---------------------------------------------------------------------------

constexpr double kClassMin = double(int64_t(1) << 24);     // m·n·k from which a GEMM has a class
constexpr double kMeasureMax = double(int64_t(1) << 31);   // m·n·k of one timed run at most

int log2_round(int64_t x) { return int(std::lround(std::log2(double(std::max<int64_t>(x, 1))))); }

struct ShapeChoice {
  Lib lib;
  std::string rates;  // every library's GFLOP/s, fastest first
};

std::mutex g_shapes_mu;
std::map<std::string, ShapeChoice> g_shapes;  // class -> choice, this process's and the file's
bool g_shapes_read = false;

fs::path shapes_file() {
  const fs::path stem = cache_stem();
  return stem.empty() ? fs::path() : fs::path(stem.string() + "-shapes.tsv");
}

// Adds the file's classes (lines "class<TAB>library<TAB>rates") not known yet; a line naming an
// absent or unknown library is skipped (its class is measured again).
void read_shapes(const fs::path& file) {
  if (file.empty()) return;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    const size_t t1 = line.find('\t'), t2 = t1 == std::string::npos ? t1 : line.find('\t', t1 + 1);
    if (t2 == std::string::npos) continue;
    const std::string name = line.substr(t1 + 1, t2 - t1 - 1);
    for (int i = 0; i < kNumLibs; ++i)
      if (name == kNames[i] && present(Lib(i))) g_shapes.emplace(line.substr(0, t1), ShapeChoice{Lib(i), line.substr(t2 + 1)});
  }
}

// Every present library timed on the call's own operands into a scratch output (beta 0), in
// interleaved rounds, each scored by its best. A GEMM larger than kMeasureMax is timed on a
// corner of itself: its largest dimension halved until it fits, so one class costs well under a
// second to measure however large its GEMMs are.
ShapeChoice measure_shape(const GemmArgs& call, const float* a, const float* b) {
  GemmArgs g = call;
  g.beta = 0.0f;
  g.batch = 1;
  g.a_offsets = g.b_offsets = g.c_offsets = nullptr;
  while (double(g.m) * double(g.n) * double(g.k) > kMeasureMax) {
    int64_t* largest = g.m >= g.n && g.m >= g.k ? &g.m : (g.n >= g.k ? &g.n : &g.k);
    if (*largest <= 64) break;
    *largest /= 2;
  }
  g.ldc = g.n;
  std::vector<float> c(size_t(g.m * g.n));
  std::vector<Lib> libs_here;
  for (int i = 0; i < kNumLibs; ++i)
    if (present(Lib(i))) libs_here.push_back(Lib(i));
  std::vector<double> rate(libs_here.size(), 0.0);
  std::vector<bool> works(libs_here.size());
  for (size_t i = 0; i < libs_here.size(); ++i) works[i] = sgemm(libs_here[i], g, a, b, c.data());  // warm
  const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k);
  for (int round = 0; round < 2; ++round)
    for (size_t i = 0; i < libs_here.size(); ++i) {
      if (!works[i]) continue;
      const auto t0 = std::chrono::steady_clock::now();
      sgemm(libs_here[i], g, a, b, c.data());
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rate[i] = std::max(rate[i], flops / std::max(s, 1e-9) * 1e-9);
    }
  std::vector<size_t> order(libs_here.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return rate[x] > rate[y]; });
  std::string rates;
  for (size_t i : order) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s%s %.0f", rates.empty() ? "" : " ", kNames[int(libs_here[i])], rate[i]);
    rates += buf;
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, " GFLOP/s at %lldx%lldx%lld", static_cast<long long>(g.m),
                static_cast<long long>(g.n), static_cast<long long>(g.k));
  return {libs_here[order.front()], rates + buf};
}

}  // namespace

Choice choose(bool remeasure) { return choose_impl(remeasure); }

const char* lib_name(Lib lib) { return kNames[int(lib)]; }

bool present(Lib lib) {
  if (lib == Lib::eigen) return true;
  const Loaded& l = libs()[int(lib)];
  return l.handle != nullptr;
}

Lib active(bool trans_a, bool trans_b) {
  ensure_chosen();
  return Lib(g_active[2 * int(trans_a) + int(trans_b)].load(std::memory_order_relaxed));
}

Lib active_tile(bool trans_a, bool trans_b) {
  ensure_chosen();
  return Lib(g_active_tile[2 * int(trans_a) + int(trans_b)].load(std::memory_order_relaxed));
}

void set_active(Lib lib) {
  ensure_chosen();
  if (!present(lib)) (void)parse(lib_name(lib), "set_gemm_backend");  // throws naming the package
  std::lock_guard<std::mutex> lock(g_reason_mu);
  for (auto& m : g_active) m.store(int(lib));
  for (auto& m : g_active_tile) m.store(int(lib));
  g_forced.store(true);
  g_reason = "set by the program";
}

void set_active(Lib lib, int mode) {
  ensure_chosen();
  if (!present(lib)) (void)parse(lib_name(lib), "set_gemm_backend");
  std::lock_guard<std::mutex> lock(g_reason_mu);
  g_active[mode & 3].store(int(lib));
  g_active_tile[mode & 3].store(int(lib));
  g_forced.store(true);
  g_reason = "set by the program";
}

void set_auto() {
  ensure_chosen();
  std::lock_guard<std::mutex> lock(g_reason_mu);
  apply(g_choice);
}

std::string shape_class(const GemmArgs& g) {
  if (double(g.m) * double(g.n) * double(g.k) < kClassMin) return "";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s m 2^%d n 2^%d k 2^%d", kModes[2 * int(g.trans_a) + int(g.trans_b)],
                log2_round(g.m), log2_round(g.n), log2_round(g.k));
  return buf;
}

Lib active_for(const GemmArgs& g, const float* a, const float* b) {
  const Lib by_mode = active(g.trans_a, g.trans_b);
  if (g_forced.load(std::memory_order_relaxed) || omp_in_parallel()) return by_mode;
  const std::string cls = shape_class(g);
  if (cls.empty()) return by_mode;
  std::lock_guard<std::mutex> lock(g_shapes_mu);
  if (auto it = g_shapes.find(cls); it != g_shapes.end()) return it->second.lib;
  const fs::path file = shapes_file();
  if (!g_shapes_read) {
    read_shapes(file);
    g_shapes_read = true;
    if (auto it = g_shapes.find(cls); it != g_shapes.end()) return it->second.lib;
  }
  std::optional<FileLock> file_lock;
  if (!file.empty()) {
    file_lock.emplace(cache_stem());
    read_shapes(file);  // another process may have measured it meanwhile
    if (auto it = g_shapes.find(cls); it != g_shapes.end()) return it->second.lib;
  }
  ShapeChoice c = measure_shape(g, a, b);
  g_shapes.emplace(cls, c);
  if (!file.empty()) std::ofstream(file, std::ios::app) << cls << '\t' << kNames[int(c.lib)] << '\t' << c.rates << '\n';
  return c.lib;
}

std::vector<std::string> shape_choices() {
  std::lock_guard<std::mutex> lock(g_shapes_mu);
  read_shapes(shapes_file());
  g_shapes_read = true;
  std::vector<std::string> out;
  for (const auto& [cls, c] : g_shapes) out.push_back(cls + ": " + kNames[int(c.lib)] + " (" + c.rates + ")");
  return out;
}

std::string reason() {
  ensure_chosen();
  std::lock_guard<std::mutex> lock(g_reason_mu);
  return g_reason;
}

bool sgemm(Lib lib, const GemmArgs& g, const float* a, const float* b, float* c) {
  const Loaded& l = libs()[int(lib)];
  switch (lib) {
    case Lib::eigen:
      eigen_gemm_t<float>(g, a, b, c);
      return true;
    case Lib::openblas:
    case Lib::blis:
      if (!l.cblas_s || !fits_int(g)) return false;
      sync_threads();
      l.cblas_s(kRowMajor, g.trans_a ? kTrans : kNoTrans, g.trans_b ? kTrans : kNoTrans, int(g.m), int(g.n),
                int(g.k), g.alpha, a, int(g.lda), b, int(g.ldb), g.beta, c, int(g.ldc));
      return true;
    case Lib::onednn:
      if (!l.dnnl_s) return false;
      return l.dnnl_s(g.trans_a ? 'T' : 'N', g.trans_b ? 'T' : 'N', g.m, g.n, g.k, g.alpha, a, g.lda, b, g.ldb,
                      g.beta, c, g.ldc) == 0;
  }
  return false;
}

bool dgemm(Lib lib, const GemmArgs& g, const double* a, const double* b, double* c) {
  const Loaded& l = libs()[int(lib)];
  if (lib == Lib::eigen) {
    eigen_gemm_t<double>(g, a, b, c);
    return true;
  }
  if (!l.cblas_d || !fits_int(g)) return false;
  sync_threads();
  l.cblas_d(kRowMajor, g.trans_a ? kTrans : kNoTrans, g.trans_b ? kTrans : kNoTrans, int(g.m), int(g.n), int(g.k),
            double(g.alpha), a, int(g.lda), b, int(g.ldb), double(g.beta), c, int(g.ldc));
  return true;
}

bool gemm_bf16_f32(Lib lib, const GemmArgs& g, const uint16_t* a, const uint16_t* b, float* c) {
  if (!native_bf16(lib)) return false;
  return libs()[int(lib)].dnnl_bf16(g.trans_a ? 'T' : 'N', g.trans_b ? 'T' : 'N', g.m, g.n, g.k, g.alpha, a,
                                    g.lda, b, g.ldb, g.beta, c, g.ldc) == 0;
}

bool native_bf16(Lib lib) {
  Loaded& l = libs()[int(lib)];
  if (!l.dnnl_bf16) return false;
  static std::once_flag probed;
  std::call_once(probed, [&] {
    // oneDNN answers "unimplemented" on CPUs without AVX-512 (bf16 would be emulated at best).
    const uint16_t one = 0x3f80;
    float out = 0.0f;
    const int st = l.dnnl_bf16('N', 'N', 1, 1, 1, 1.0f, &one, 1, &one, 1, 0.0f, &out, 1);
    l.native_bf16 = (st == 0 && out == 1.0f) ? 1 : 0;
  });
  return l.native_bf16 == 1;
}

bool bf16_native() {
  static const bool native = [] {
    const std::string cpu = cpu_signature();
    const bool isa = cpu.find(" avx512_bf16") != std::string::npos || cpu.find(" amx_bf16") != std::string::npos;
    const char* forced = std::getenv("QUILT_GEMM");
    const bool allowed = !forced || !*forced || std::string(forced) == "onednn";
    return isa && allowed && native_bf16(Lib::onednn);
  }();
  return native;
}

void set_threads(int n) {
  (void)n;
  g_lib_threads.store(-1);  // the next call re-reads OpenMP's count
  sync_threads();
}

}  // namespace quilt::kernels::cpu::gemm_libs
