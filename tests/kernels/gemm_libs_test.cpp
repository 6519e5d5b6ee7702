// Every GEMM library present, through the engine's GEMM kernel: each transpose mode, strided
// operands, alpha and beta, empty sizes, batches, bf16/f16 (widened in row panels, several
// panels deep) against a float64 reference; and the choice: QUILT_GEMM, its errors, the cache.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <unistd.h>
#include <string>
#include <vector>

#include "kernels/cpu/gemm_libs.h"
#include "kernels/cpu/matmul.h"

using namespace quilt;
using namespace quilt::kernels;
namespace gl = quilt::kernels::cpu::gemm_libs;

namespace {

struct Case {
  int64_t m, n, k;
  bool ta, tb;
  int64_t pad;  // extra columns in every leading dimension
  float alpha, beta;
};

std::vector<double> random_values(int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = u(g);
  return v;
}

// C = alpha op(A) op(B) + beta C in float64, from the values the kernel saw.
std::vector<double> reference(const Case& c, const std::vector<double>& a, int64_t lda, const std::vector<double>& b,
                              int64_t ldb, const std::vector<double>& c0, int64_t ldc) {
  std::vector<double> out(c0);
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < c.k; ++p)
        s += (c.ta ? a[p * lda + i] : a[i * lda + p]) * (c.tb ? b[j * ldb + p] : b[p * ldb + j]);
      out[i * ldc + j] = c.alpha * s + (c.beta == 0.0f ? 0.0 : c.beta * c0[i * ldc + j]);
    }
  return out;
}

template <class T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, double>) return x;
  else return double(float(x));
}

// One case's operands in dtype T (float, double, BFloat16, Half), and the float64 reference of
// exactly those values: made once, then run on every library (the reference of the largest
// 16-bit cases costs more than their GEMMs, and far more under the sanitizers).
template <class T>
struct Prepared {
  Case c;
  int64_t ac = 0, bc = 0, ldc = 0;
  std::vector<T> A = {}, B = {}, C0 = {};
  std::vector<double> cv = {}, want = {};
};

template <class T>
Prepared<T> prepare(const Case& c) {
  Prepared<T> p{.c = c};
  const int64_t ar = c.ta ? c.k : c.m, br = c.tb ? c.n : c.k;
  p.ac = (c.ta ? c.m : c.k) + c.pad, p.bc = (c.tb ? c.k : c.n) + c.pad, p.ldc = c.n + c.pad;
  auto av = random_values(ar * p.ac, 1), bv = random_values(br * p.bc, 2);
  p.cv = random_values(c.m * p.ldc, 3);
  // Round the inputs to T first, so the reference sees exactly what the kernel sees.
  p.A.resize(av.size()), p.B.resize(bv.size()), p.C0.resize(p.cv.size());
  for (size_t i = 0; i < av.size(); ++i) av[i] = as_double(p.A[i] = T(float(av[i])));
  for (size_t i = 0; i < bv.size(); ++i) bv[i] = as_double(p.B[i] = T(float(bv[i])));
  for (size_t i = 0; i < p.cv.size(); ++i) p.cv[i] = as_double(p.C0[i] = T(float(p.cv[i])));
  p.want = reference(c, av, p.ac, bv, p.bc, p.cv, p.ldc);
  return p;
}

// Runs a prepared case on the library in use and returns the largest error relative to the
// reference's scale (sqrt(k) for sums of k unit-size products).
template <class T>
double error_of(const Prepared<T>& p, DType dt) {
  const Case& c = p.c;
  std::vector<T> A = p.A, B = p.B, C = p.C0;
  GemmArgs g{.m = c.m, .n = c.n, .k = c.k, .trans_a = c.ta, .trans_b = c.tb, .a = A.data(), .lda = p.ac,
             .b = B.data(), .ldb = p.bc, .c = C.data(), .ldc = p.ldc, .alpha = c.alpha, .beta = c.beta};
  cpu::gemm(dt, g);
  double err = 0;
  const double scale = std::sqrt(double(std::max<int64_t>(c.k, 1))) + 1.0;
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < p.ldc; ++j) {
      const double got = as_double(C[size_t(i * p.ldc + j)]);
      if (j >= c.n) {  // the padding columns of C are never written
        if (got != p.cv[size_t(i * p.ldc + j)]) return 1e30;
        continue;
      }
      err = std::max(err, std::abs(got - p.want[size_t(i * p.ldc + j)]) / scale);
    }
  return err;
}

template <class T>
double max_error(const Case& c, DType dt) {
  return error_of(prepare<T>(c), dt);
}

const std::vector<Case> kCases = {
    {37, 29, 53, false, false, 0, 1.0f, 0.0f},  {37, 29, 53, true, false, 3, 1.0f, 0.0f},
    {37, 29, 53, false, true, 5, 0.5f, 0.0f},   {37, 29, 53, true, true, 2, 1.0f, 1.0f},
    {64, 300, 128, false, true, 0, 2.0f, 0.5f}, {300, 64, 200, true, false, 1, 1.0f, -1.0f},
    {1, 1, 1, false, false, 0, 1.0f, 0.0f},     {5, 7, 0, false, false, 1, 1.0f, 0.5f},  // k = 0: C = beta C
    {0, 7, 9, false, false, 0, 1.0f, 0.0f},
};

struct ScopedLib {
  explicit ScopedLib(const std::string& lib) { cpu::set_gemm_backend(lib); }
  ~ScopedLib() { gl::set_auto(); }
};

struct ScopedEnv {
  std::string name;
  std::string old;
  bool had;
  ScopedEnv(const char* n, const std::string& value) : name(n) {
    const char* v = std::getenv(n);
    had = v != nullptr;
    if (had) old = v;
    if (value.empty()) unsetenv(n);
    else setenv(n, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had) setenv(name.c_str(), old.c_str(), 1);
    else unsetenv(name.c_str());
  }
};

}  // namespace

TEST_CASE("gemm libraries: every one present matches float64 in f32, f64, bf16 and f16") {
  const auto libs = cpu::gemm_backends();
  REQUIRE(!libs.empty());
  CHECK(libs.front() == "eigen");
  for (const std::string& lib : libs) {
    ScopedLib use(lib);
    CHECK(std::string(cpu::gemm_backend()) == lib);
    for (const Case& c : kCases) {
      CAPTURE(lib);
      CAPTURE(c.m);
      CAPTURE(c.n);
      CAPTURE(c.k);
      CAPTURE(c.ta);
      CAPTURE(c.tb);
      CHECK(max_error<float>(c, DType::f32) < 1e-5);
      CHECK(max_error<double>(c, DType::f64) < 1e-13);
      CHECK(max_error<BFloat16>(c, DType::bf16) < 2e-2);
      CHECK(max_error<Half>(c, DType::f16) < 3e-3);
    }
  }
}

TEST_CASE("gemm libraries: 16-bit GEMMs larger than one row panel, and batches") {
  // n = 40000 makes the panel 256 rows, so m = 600 runs three panels (the last one partial).
  const auto bf16_nn = prepare<BFloat16>({600, 40000, 3, false, false, 0, 1.0f, 0.0f});
  const auto bf16_tt = prepare<BFloat16>({600, 40000, 3, true, true, 1, 1.0f, 1.0f});
  const auto f16_tn = prepare<Half>({520, 40000, 2, true, false, 0, 1.0f, 0.25f});
  for (const std::string& lib : cpu::gemm_backends()) {
    ScopedLib use(lib);
    CAPTURE(lib);
    CHECK(error_of(bf16_nn, DType::bf16) < 2e-2);
    CHECK(error_of(bf16_tt, DType::bf16) < 2e-2);
    CHECK(error_of(f16_tn, DType::f16) < 3e-3);
  }
  // Batches (small ones run in parallel over the batch, large ones one after another).
  for (int64_t m : {8, 300}) {
    const int64_t batch = 5, n = m + 3, k = 2 * m;
    auto a = random_values(batch * m * k, 4), b = random_values(batch * k * n, 5);
    std::vector<float> A(a.begin(), a.end()), B(b.begin(), b.end()), C(size_t(batch * m * n));
    std::vector<int64_t> ao, bo, co;
    for (int64_t i = 0; i < batch; ++i) ao.push_back(i * m * k), bo.push_back(i * k * n), co.push_back(i * m * n);
    GemmArgs g{.m = m, .n = n, .k = k, .a = A.data(), .lda = k, .b = B.data(), .ldb = n, .c = C.data(), .ldc = n,
               .batch = batch, .a_offsets = ao.data(), .b_offsets = bo.data(), .c_offsets = co.data()};
    cpu::gemm(DType::f32, g);
    double err = 0;
    for (int64_t bi = 0; bi < batch; ++bi)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t p = 0; p < k; ++p) s += double(A[size_t(ao[bi] + i * k + p)]) * double(B[size_t(bo[bi] + p * n + j)]);
          err = std::max(err, std::abs(s - double(C[size_t(co[bi] + i * n + j)])));
        }
    CHECK(err < 1e-4);
  }
}

TEST_CASE("gemm libraries: the choice honours QUILT_GEMM and names what is wrong") {
  {
    ScopedEnv env("QUILT_GEMM", "eigen");
    const auto c = gl::choose();
    for (gl::Lib l : c.by_mode) CHECK(l == gl::Lib::eigen);
    CHECK(c.reason == "QUILT_GEMM=eigen");
  }
  {
    ScopedEnv env("QUILT_GEMM", "cublas");
    CHECK_THROWS_WITH(gl::choose(),
                      doctest::Contains("QUILT_GEMM=cublas: unknown GEMM library (one of: eigen, openblas, blis, onednn)"));
  }
  for (int i = 1; i < gl::kNumLibs; ++i) {
    if (gl::present(gl::Lib(i))) continue;  // an absent library must be refused naming its package
    ScopedEnv env("QUILT_GEMM", gl::lib_name(gl::Lib(i)));
    CHECK_THROWS_WITH(gl::choose(), doctest::Contains("is not installed (Debian package"));
  }
  CHECK_THROWS_WITH(cpu::set_gemm_backend("mkl"), doctest::Contains("unknown GEMM library 'mkl'"));
}

TEST_CASE("gemm libraries: a measured choice is cached per CPU and read back") {
  namespace fs = std::filesystem;
  if (cpu::gemm_backends().size() < 2) {
    MESSAGE("only Eigen is present: nothing to choose between");
    CHECK(gl::choose().reason == "the only GEMM library present");
    return;
  }
  const fs::path dir = fs::temp_directory_path() / ("quilt-gemm-cache-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ScopedEnv gemm("QUILT_GEMM", "");
  ScopedEnv cache("QUILT_CACHE_DIR", dir.string());
  const auto first = gl::choose();
  CHECK(first.reason.find("fastest measured on this CPU: ") == 0);
  CHECK(first.reason.find("GFLOP/s") != std::string::npos);
  for (const char* mode : {"NN ", "; NT ", "; TN ", "; TT "}) CHECK(first.reason.find(mode) != std::string::npos);
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".txt") files.push_back(e.path());
  REQUIRE(files.size() == 1);
  std::string name;
  std::ifstream(files[0]) >> name;
  CHECK(name == gl::lib_name(first.by_mode[0]));
  // The grouped GEMM's tiles are measured apart (a thread each) and cached beside the rest.
  CHECK(first.reason.find("; grouped GEMM tiles, a thread each: NN ") != std::string::npos);
  const auto second = gl::choose();
  for (int mode = 0; mode < 4; ++mode) CHECK(second.by_mode[mode] == first.by_mode[mode]);
  for (int mode = 0; mode < 4; ++mode) CHECK(second.tile_by_mode[mode] == first.tile_by_mode[mode]);
  CHECK(second.reason.find("(cached in " + files[0].string() + ")") != std::string::npos);
  // A cache file without the tile line (as written before tiles were measured) is measured over.
  {
    std::ifstream in(files[0]);
    std::string names, rates;
    std::getline(in, names), std::getline(in, rates);
    in.close();
    std::ofstream(files[0]) << names << "\n" << rates << "\n";
  }
  const auto old_format = gl::choose();
  CHECK(old_format.reason.find("; grouped GEMM tiles, a thread each: ") != std::string::npos);
  {
    std::ifstream in(files[0]);
    std::string line;
    int lines = 0;
    while (std::getline(in, line)) ++lines;
    CHECK(lines == 3);
  }
  // A cache file naming something unknown is measured over and rewritten.
  std::ofstream(files[0]) << "nonsense\nnothing\n";
  const auto third = gl::choose();
  CHECK(third.reason.find("cached in") != std::string::npos);
  std::ifstream(files[0]) >> name;
  CHECK(name != "nonsense");
  fs::remove_all(dir);
}

TEST_CASE("gemm libraries: a large GEMM's shape class is measured once, cached, and read by later processes") {
  namespace fs = std::filesystem;
  if (cpu::gemm_backends().size() < 2 || std::getenv("QUILT_GEMM")) {
    MESSAGE("one library forced or present: no shape classes");
    CHECK(gl::shape_class({.m = 1024, .n = 1024, .k = 1024}) == "NN m 2^10 n 2^10 k 2^10");
    return;
  }
  const fs::path dir = fs::temp_directory_path() / ("quilt-gemm-shapes-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ScopedEnv cache("QUILT_CACHE_DIR", dir.string());
  gl::set_auto();
  CHECK(gl::reason().find("per shape class, measured on first use") != std::string::npos);
  // Classes: the mode and m, n, k rounded to the nearest power of two; small GEMMs have none.
  CHECK(gl::shape_class({.m = 384, .n = 640, .k = 200, .trans_a = true}) == "TN m 2^9 n 2^9 k 2^8");
  CHECK(gl::shape_class({.m = 8192, .n = 512, .k = 1376, .trans_b = true}) == "NT m 2^13 n 2^9 k 2^10");
  CHECK(gl::shape_class({.m = 255, .n = 256, .k = 256}) == "");
  auto lines = [&] {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().string().ends_with("-shapes.tsv")) {
        std::ifstream in(e.path());
        for (std::string l; std::getline(in, l);) out.push_back(l);
      }
    return out;
  };
  // The first GEMM of a class measures it (the result is still right) and writes one line.
  const Case large{384, 640, 200, true, false, 1, 1.0f, 0.5f};
  CHECK(max_error<float>(large, DType::f32) < 1e-5);
  auto after = lines();
  REQUIRE(after.size() == 1);
  CHECK(after[0].starts_with("TN m 2^9 n 2^9 k 2^8\t"));
  CHECK(after[0].find(" GFLOP/s at 384x640x200") != std::string::npos);
  bool listed = false;
  for (const auto& l : gl::shape_choices()) listed = listed || l.starts_with("TN m 2^9 n 2^9 k 2^8: ");
  CHECK(listed);
  // The same class again, a small GEMM, and any GEMM with a library forced: no new line.
  CHECK(max_error<float>({400, 600, 210, true, false, 0, 1.0f, 0.0f}, DType::f32) < 1e-5);
  CHECK(max_error<float>({37, 29, 53, false, false, 0, 1.0f, 0.0f}, DType::f32) < 1e-5);
  {
    ScopedLib use("eigen");
    CHECK(max_error<float>({300, 300, 300, false, true, 0, 1.0f, 0.0f}, DType::f32) < 1e-5);
  }
  CHECK(lines().size() == 1);
  // A class another process measured is read from the file, not measured again: the line below
  // names Eigen for a class this process has not seen (its operands are never read, so null).
  fs::path shapes;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().string().ends_with("-shapes.tsv")) shapes = e.path();
  REQUIRE(!shapes.empty());
  std::ofstream(shapes, std::ios::app) << "NT m 2^14 n 2^3 k 2^10\teigen\tfrom another process\n"
                                       << "NN m 2^14 n 2^3 k 2^10\tmkl\tnot a library\n";
  CHECK(gl::active_for({.m = 16384, .n = 8, .k = 1024, .trans_b = true}, nullptr, nullptr) == gl::Lib::eigen);
  bool unknown = false;
  for (const auto& l : gl::shape_choices()) unknown = unknown || l.starts_with("NN m 2^14 n 2^3 k 2^10");
  CHECK_FALSE(unknown);
  CHECK(lines().size() == 3);
  fs::remove_all(dir);
}
