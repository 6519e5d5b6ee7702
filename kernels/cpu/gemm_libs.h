// Internal to kernels/cpu: the GEMM libraries a process can use and the choice among them.
//
// Eigen is compiled in. OpenBLAS (its OpenMP build), BLIS (its OpenMP build) and oneDNN are
// opened at run time from the Debian packages' own paths (libopenblas-openmp-dev,
// libblis-openmp-dev, libdnnl-dev), each with RTLD_LOCAL, so the three coexist in one process
// (OpenBLAS and BLIS both define cblas_sgemm) and all of them share libgomp's one thread pool
// with the engine's own kernels. A library that is not installed is simply absent.
//
// The active library is chosen once, on the first GEMM: QUILT_GEMM=name forces it; otherwise
// a short measurement of every present library at the shapes a training step runs (tokens x
// hidden, with the transposes of the forward and of both backward GEMMs) picks the fastest in
// each transpose mode (no library wins every mode on every CPU), and, apart, the fastest for the
// grouped GEMM's tiles, which run a single-threaded GEMM on every thread at once.
// The result is kept in a cache file keyed by the CPU model, its flags, the thread count and the
// libraries present, so later processes on the machine (every rank of a job, every test) make
// the same choice without measuring; ranks that start together measure once, under a lock.
//
// One choice per transpose mode is not enough: on one CPU the library fastest for tokens x hidden
// in a mode can be 1.4x slower than another at tokens x intermediate in the same mode. So a large
// f32 GEMM (m·n·k ≥ 2^24) is matched to its shape class (the transpose mode and m, n, k each
// rounded to the nearest power of two): the first GEMM of a class times every present library
// on the call's own operands (into a scratch output) and the fastest serves the class from then
// on, in this process and, through a second cache file beside the first, in every later one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/loop.h"

namespace quilt::kernels::cpu::gemm_libs {

enum class Lib : int { eigen = 0, openblas = 1, blis = 2, onednn = 3 };
inline constexpr int kNumLibs = 4;

/// "eigen", "openblas", "blis", "onednn".
const char* lib_name(Lib lib);
/// Whether the library was found and loaded (Eigen always is).
bool present(Lib lib);
/// The library for f32/f64 GEMMs in one transpose mode (chosen on first call).
Lib active(bool trans_a, bool trans_b);
/// The library for one f32 GEMM: its shape class's (measured on first use, see above) when the
/// GEMM is large, no library is forced and no parallel region is active; else `active`.
/// `a` and `b` are the call's operands, read (never written) if the class must be measured.
Lib active_for(const GemmArgs& g, const float* a, const float* b);
/// The shape classes chosen so far (this process's and the cache file's), one line each:
/// "NT m 2^13 n 2^9 k 2^10: openblas (openblas 224 onednn 159 ... GFLOP/s)".
std::vector<std::string> shape_choices();
/// The shape class of a GEMM, as `shape_choices` names it ("NT m 2^13 n 2^9 k 2^10"), or "" when
/// it is too small to have one.
std::string shape_class(const GemmArgs& g);
/// The library for the single-threaded tiles of a grouped GEMM (kernels/cpu/moe.cpp) in one
/// transpose mode: measured apart, on one thread at a tile's shape, since the library that is
/// fastest on a whole GEMM over every thread need not be the fastest on one.
Lib active_tile(bool trans_a, bool trans_b);
/// Forces `lib` in every mode, tiles too (tests and benchmarks compare them; QUILT_GEMM does the
/// same at start).
void set_active(Lib lib);
/// Forces `lib` in one transpose mode (2·trans_a + trans_b).
void set_active(Lib lib, int mode);
/// Undoes set_active: the measured (or QUILT_GEMM's) choice again, per shape class included.
void set_auto();
/// How the active library was chosen, for the startup log.
std::string reason();

struct Choice {
  Lib by_mode[4] = {Lib::eigen, Lib::eigen, Lib::eigen, Lib::eigen};  // index 2·trans_a + trans_b
  std::string reason;
  Lib tile_by_mode[4] = {Lib::eigen, Lib::eigen, Lib::eigen, Lib::eigen};  // single-threaded tiles
  bool forced = false;  // one library for everything (QUILT_GEMM, or the only one present): no shape classes
  static Choice all(Lib lib, std::string why) {
    return {{lib, lib, lib, lib}, std::move(why), {lib, lib, lib, lib}, true};
  }
};
/// The choice as the first GEMM makes it, without applying it: QUILT_GEMM, else the cache
/// file, else a measurement that is then cached. `remeasure` ignores (and rewrites) the cache.
/// Throws naming the variable and the package when QUILT_GEMM names an absent library.
Choice choose(bool remeasure = false);

/// One row-major f32 GEMM through `lib`: C = alpha op(A) op(B) + beta C, C never read when
/// beta is 0. Returns false when the library cannot take it (then the caller uses Eigen).
bool sgemm(Lib lib, const GemmArgs& g, const float* a, const float* b, float* c);
/// The same in f64 (OpenBLAS and BLIS; oneDNN has none).
bool dgemm(Lib lib, const GemmArgs& g, const double* a, const double* b, double* c);
/// bf16 operands, f32 accumulate and f32 output, natively (oneDNN on CPUs with AVX512-BF16/AMX;
/// false elsewhere).
bool gemm_bf16_f32(Lib lib, const GemmArgs& g, const uint16_t* a, const uint16_t* b, float* c);
/// Whether `lib` multiplies bf16 natively on this CPU (probed once).
bool native_bf16(Lib lib);
/// Whether bf16 GEMMs go to oneDNN's native kernel: the CPU has avx512_bf16 or amx_bf16,
/// oneDNN is present and answers, and QUILT_GEMM does not force another library.
bool bf16_native();

/// Makes the libraries' own thread counts follow the engine's (OpenMP's) setting.
void set_threads(int n);

}  // namespace quilt::kernels::cpu::gemm_libs
