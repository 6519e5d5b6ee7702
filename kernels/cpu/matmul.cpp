// CPU GEMM. f32 and f64 go to the GEMM library chosen for the machine (gemm_libs.h), threaded by
// the library; batches of small matrices run in parallel across the batch instead, each GEMM on
// one thread. bf16/f16 are widened to f32 in row panels (in parallel), multiplied and rounded
// back, or multiplied natively where the CPU has bf16 instructions and oneDNN is present.
#include "kernels/cpu/matmul.h"

#include <omp.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/gemm_libs.h"
#include "kernels/cpu/parallel.h"

namespace quilt::kernels::cpu {
namespace {

using gemm_libs::Lib;

template <class T>
void gemm_one(const GemmArgs& g, const T* a, const T* b, T* c, Lib lib) {
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {
    for (int64_t i = 0; i < g.m; ++i)
      for (int64_t j = 0; j < g.n; ++j) c[i * g.ldc + j] = g.beta == 0.0f ? T(0) : T(g.beta) * c[i * g.ldc + j];
    return;
  }
  bool done;
  if constexpr (std::is_same_v<T, float>) done = gemm_libs::sgemm(lib, g, a, b, c);
  else done = gemm_libs::dgemm(lib, g, a, b, c);
  if (!done) {  // a library that cannot take these sizes: Eigen always can
    if constexpr (std::is_same_v<T, float>) gemm_libs::sgemm(Lib::eigen, g, a, b, c);
    else gemm_libs::dgemm(Lib::eigen, g, a, b, c);
  }
}

// Batches of small matrices: parallel over the batch, each GEMM single-threaded.
bool small_batches(const GemmArgs& g) { return g.batch > 1 && g.m * g.n * g.k < (int64_t(1) << 18); }

int64_t off(const int64_t* o, int64_t i) { return o ? o[i] : 0; }
// p + the i-th batch offset; an empty operand's null pointer stays null (k = 0: nothing is read).
template <class P>
P* at(P* p, const int64_t* o, int64_t i) { return p ? p + off(o, i) : p; }

template <class T>
void gemm_batched(const GemmArgs& g) {
  const T* a = static_cast<const T*>(g.a);
  const T* b = static_cast<const T*>(g.b);
  T* c = static_cast<T*>(g.c);
  if (small_batches(g)) {
    parallel_range(g.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        gemm_one<T>(g, at(a, g.a_offsets, i), at(b, g.b_offsets, i), at(c, g.c_offsets, i), Lib::eigen);
    });
    return;
  }
  Lib lib = gemm_libs::active(g.trans_a, g.trans_b);
  if constexpr (std::is_same_v<T, float>)
    if (g.k > 0) lib = gemm_libs::active_for(g, at(a, g.a_offsets, 0), at(b, g.b_offsets, 0));
  for (int64_t i = 0; i < g.batch; ++i)
    gemm_one<T>(g, at(a, g.a_offsets, i), at(b, g.b_offsets, i), at(c, g.c_offsets, i), lib);
}

// --- 16-bit floats ---------------------------------------------------------------------------

// dst (rows x cols, dense) = float(src) with row stride ld, rows in parallel.
template <class H>
void widen(float* dst, const H* src, int64_t rows, int64_t cols, int64_t ld) {
  if (rows == 0 || cols == 0) return;  // src may be null then
  parallel_range(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, cols)), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const H* s = src + i * ld;
      float* d = dst + i * cols;
      for (int64_t j = 0; j < cols; ++j) d[j] = float(s[j]);
    }
  });
}

template <class H>
void narrow(H* dst, const float* src, int64_t rows, int64_t cols, int64_t ld) {
  parallel_range(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, cols)), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* s = src + i * cols;
      H* d = dst + i * ld;
      for (int64_t j = 0; j < cols; ++j) d[j] = H(s[j]);
    }
  });
}

struct HalfBuffers {
  std::vector<float> a, b, c;
};

float* sized(std::vector<float>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(size_t(n));
  return v.data();
}

// One 16-bit GEMM (its f32 panels on `lib`, or on their shape class's library when `by_shape`).
// B is widened once; A and C go through in row panels of C so the f32 copies
// stay small next to the operands (the panels are still large enough for a full-speed GEMM).
template <class H>
void gemm_half_one(const GemmArgs& g, const H* a, const H* b, H* c, Lib lib, bool native, bool by_shape) {
  if (g.m == 0 || g.n == 0) return;
  thread_local HalfBuffers buf;
  const int64_t panel = std::max<int64_t>(256, (int64_t(8) << 20) / std::max<int64_t>(1, std::max(g.k, g.n)));
  const int64_t br = g.trans_b ? g.n : g.k, bc = g.trans_b ? g.k : g.n;
  float* B = nullptr;
  if (!native) {
    B = sized(buf.b, br * bc);
    widen(B, b, br, bc, g.ldb);
  }
  for (int64_t i0 = 0; i0 < g.m; i0 += panel) {
    const int64_t mp = std::min(panel, g.m - i0);
    float* C = sized(buf.c, mp * g.n);
    if (g.beta != 0.0f) widen(C, c + i0 * g.ldc, mp, g.n, g.ldc);
    GemmArgs f = g;
    f.m = mp;
    f.ldc = g.n;
    f.batch = 1;
    f.a_offsets = f.b_offsets = f.c_offsets = nullptr;
    const H* a_panel = a + (g.trans_a ? i0 : i0 * g.lda);
    bool done = false;
    if (native && g.k > 0) {
      if constexpr (std::is_same_v<H, BFloat16>)
        done = gemm_libs::gemm_bf16_f32(Lib::onednn, f, reinterpret_cast<const uint16_t*>(a_panel),
                                        reinterpret_cast<const uint16_t*>(b), C);
    }
    if (!done) {
      if (!B) {
        B = sized(buf.b, br * bc);
        widen(B, b, br, bc, g.ldb);
      }
      const int64_t ar = g.trans_a ? g.k : mp, ac = g.trans_a ? mp : g.k;
      float* A = sized(buf.a, ar * ac);
      widen(A, a_panel, ar, ac, g.lda);
      f.lda = ac;
      f.ldb = bc;
      gemm_one<float>(f, A, B, C, by_shape && f.k > 0 ? gemm_libs::active_for(f, A, B) : lib);
    }
    narrow(c + i0 * g.ldc, C, mp, g.n, g.ldc);
  }
}

template <class H>
void gemm_half(const GemmArgs& g) {
  const H* a = static_cast<const H*>(g.a);
  const H* b = static_cast<const H*>(g.b);
  H* c = static_cast<H*>(g.c);
  if (small_batches(g)) {
    parallel_range(g.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        gemm_half_one<H>(g, at(a, g.a_offsets, i), at(b, g.b_offsets, i), at(c, g.c_offsets, i), Lib::eigen,
                         false, false);
    });
    return;
  }
  const Lib lib = gemm_libs::active(g.trans_a, g.trans_b);
  const bool native = std::is_same_v<H, BFloat16> && gemm_libs::bf16_native();
  for (int64_t i = 0; i < g.batch; ++i)
    gemm_half_one<H>(g, at(a, g.a_offsets, i), at(b, g.b_offsets, i), at(c, g.c_offsets, i), lib, native, true);
}

}  // namespace

void gemm(DType dt, const GemmArgs& args) {
  switch (dt) {
    case DType::f32: return gemm_batched<float>(args);
    case DType::f64: return gemm_batched<double>(args);
    case DType::bf16: return gemm_half<BFloat16>(args);
    case DType::f16: return gemm_half<Half>(args);
    default: return;  // the engine rejects integer matmul before reaching here
  }
}

std::string gemm_backend() {
  const Lib nn = gemm_libs::active(false, false);
  std::string per_mode;
  bool same = true;
  for (int mode = 0; mode < 4; ++mode) {
    const Lib lib = gemm_libs::active(mode & 2, mode & 1);
    same = same && lib == nn;
    per_mode += std::string(mode ? " " : "") + (mode & 2 ? "T" : "N") + (mode & 1 ? "T" : "N") + "=" +
                gemm_libs::lib_name(lib);
  }
  return same ? gemm_libs::lib_name(nn) : per_mode;
}

std::string gemm_backend_reason() { return gemm_libs::reason(); }

std::vector<std::string> gemm_backends() {
  std::vector<std::string> names;
  for (int i = 0; i < gemm_libs::kNumLibs; ++i)
    if (gemm_libs::present(Lib(i))) names.emplace_back(gemm_libs::lib_name(Lib(i)));
  return names;
}

void set_gemm_backend(const std::string& name) {
  for (int i = 0; i < gemm_libs::kNumLibs; ++i)
    if (name == gemm_libs::lib_name(Lib(i))) return gemm_libs::set_active(Lib(i));
  throw std::runtime_error("set_gemm_backend: unknown GEMM library '" + name +
                           "' (one of: eigen, openblas, blis, onednn)");
}

void set_gemm_threads(int n) {
  omp_set_num_threads(n);
  gemm_libs::set_threads(n);
}

int gemm_threads() { return omp_get_max_threads(); }

}  // namespace quilt::kernels::cpu
