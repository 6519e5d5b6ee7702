// CPU GEMM. Batches run one after another with the GEMM itself threaded (BLAS or Eigen's
// OpenMP path) when the matrices are large, and in parallel across batches when small.
#include "kernels/cpu/matmul.h"

#include <Eigen/Core>

#include <dlfcn.h>
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cpu/parallel.h"

#ifdef QUILT_HAVE_CBLAS
#include <cblas.h>
#endif

namespace quilt::kernels::cpu {
namespace {

// Eigen by default: on the machines measured (docs/PERF.md) its OpenMP GEMM beats OpenBLAS and
// shares one thread pool with every other kernel, where OpenBLAS's own pool would compete with
// OpenMP's for the same cores. QUILT_GEMM=openblas selects BLAS.
std::atomic<bool> g_use_blas{[] {
  const char* v = std::getenv("QUILT_GEMM");
  return v != nullptr && std::string(v) == "openblas";
}()};

template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using CMap = Eigen::Map<const RowMat<T>, 0, Eigen::OuterStride<>>;
template <class T>
using MMap = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;

template <class T>
void gemm_eigen_one(const GemmArgs& g, const T* a, const T* b, T* c) {
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

template <class T>
void gemm_one(const GemmArgs& g, const T* a, const T* b, T* c) {
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {
    for (int64_t i = 0; i < g.m; ++i)
      for (int64_t j = 0; j < g.n; ++j) c[i * g.ldc + j] = g.beta == 0.0f ? T(0) : T(g.beta) * c[i * g.ldc + j];
    return;
  }
#ifdef QUILT_HAVE_CBLAS
  if (g_use_blas.load(std::memory_order_relaxed)) {
    const auto ta = g.trans_a ? CblasTrans : CblasNoTrans;
    const auto tb = g.trans_b ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<T, float>) {
      cblas_sgemm(CblasRowMajor, ta, tb, int(g.m), int(g.n), int(g.k), g.alpha, a, int(g.lda), b, int(g.ldb),
                  g.beta, c, int(g.ldc));
      return;
    } else if constexpr (std::is_same_v<T, double>) {
      cblas_dgemm(CblasRowMajor, ta, tb, int(g.m), int(g.n), int(g.k), g.alpha, a, int(g.lda), b, int(g.ldb),
                  g.beta, c, int(g.ldc));
      return;
    }
  }
#endif
  gemm_eigen_one<T>(g, a, b, c);
}

template <class T>
void gemm_batched(const GemmArgs& g) {
  auto off = [](const int64_t* o, int64_t i) { return o ? o[i] : 0; };
  const T* a = static_cast<const T*>(g.a);
  const T* b = static_cast<const T*>(g.b);
  T* c = static_cast<T*>(g.c);
  const int64_t work = g.m * g.n * g.k;
  if (g.batch > 1 && work < (int64_t(1) << 18)) {
    // Small matrices: parallel over the batch, each GEMM single-threaded.
    parallel_range(g.batch, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        gemm_eigen_one<T>(g, a + off(g.a_offsets, i), b + off(g.b_offsets, i), c + off(g.c_offsets, i));
    });
    return;
  }
  for (int64_t i = 0; i < g.batch; ++i)
    gemm_one<T>(g, a + off(g.a_offsets, i), b + off(g.b_offsets, i), c + off(g.c_offsets, i));
}

// 16-bit floats: widen each operand matrix to f32 (dense), multiply, round back.
template <class H>
void gemm_half(const GemmArgs& g) {
  auto off = [](const int64_t* o, int64_t i) { return o ? o[i] : 0; };
  const int64_t ar = g.trans_a ? g.k : g.m, ac = g.trans_a ? g.m : g.k;
  const int64_t br = g.trans_b ? g.n : g.k, bc = g.trans_b ? g.k : g.n;
  std::vector<float> A(size_t(ar * ac)), B(size_t(br * bc)), C(size_t(g.m * g.n));
  for (int64_t bi = 0; bi < g.batch; ++bi) {
    const H* a = static_cast<const H*>(g.a) + off(g.a_offsets, bi);
    const H* b = static_cast<const H*>(g.b) + off(g.b_offsets, bi);
    H* c = static_cast<H*>(g.c) + off(g.c_offsets, bi);
    for (int64_t i = 0; i < ar; ++i)
      for (int64_t j = 0; j < ac; ++j) A[size_t(i * ac + j)] = float(a[i * g.lda + j]);
    for (int64_t i = 0; i < br; ++i)
      for (int64_t j = 0; j < bc; ++j) B[size_t(i * bc + j)] = float(b[i * g.ldb + j]);
    if (g.beta != 0.0f)
      for (int64_t i = 0; i < g.m; ++i)
        for (int64_t j = 0; j < g.n; ++j) C[size_t(i * g.n + j)] = float(c[i * g.ldc + j]);
    GemmArgs f = g;
    f.a = A.data(); f.lda = ac; f.b = B.data(); f.ldb = bc; f.c = C.data(); f.ldc = g.n;
    f.batch = 1; f.a_offsets = f.b_offsets = f.c_offsets = nullptr;
    gemm_one<float>(f, A.data(), B.data(), C.data());
    for (int64_t i = 0; i < g.m; ++i)
      for (int64_t j = 0; j < g.n; ++j) c[i * g.ldc + j] = H(C[size_t(i * g.n + j)]);
  }
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

const char* gemm_backend() {
#ifdef QUILT_HAVE_CBLAS
  return g_use_blas.load() ? "openblas" : "eigen";
#else
  return "eigen";
#endif
}

void set_gemm_use_blas(bool use) { g_use_blas.store(use); }

void set_gemm_threads(int n) {
  omp_set_num_threads(n);
  // OpenBLAS keeps its own thread pool; found at run time so any BLAS links.
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(n);
}

}  // namespace quilt::kernels::cpu
