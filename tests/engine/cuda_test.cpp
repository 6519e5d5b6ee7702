// The CUDA backend against the CPU: elementwise ops, casts, random numbers (bit for bit),
// reductions, matmul, softmax, cross entropy, the caching allocator, streams and events —
// through the public Tensor API.
// Without a usable device every case but the first two prints why and returns.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/storage.h"
#include "kernels/cuda/kernels.h"  // compiled()
#include "tests/engine/cuda_util.h"

using namespace quilt;
using namespace quilt::cuda_test;

namespace {
// Whether a file whose name contains `name` is mapped into this process.
bool mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.find(name) != std::string::npos) return true;
  return false;
}
}  // namespace

TEST_CASE("cuda: cuBLAS is opened at the first GPU GEMM, not at start-up, and a missing one is named") {
  if (!kernels::cuda::compiled()) {
    CHECK_FALSE(kernels::cuda::cublas_loaded());
    CHECK_THROWS_WITH(kernels::cuda::load_cublas(), doctest::Contains("no CUDA implementation in this build"));
    MESSAGE("skipped: a build without CUDA");
    return;
  }
  // Without a device nothing in this process can have opened it; with one, an earlier case in
  // the same process (a whole-suite run) may have run a GEMM on it.
  if (!cuda::is_available()) REQUIRE_FALSE(kernels::cuda::cublas_loaded());
  if (!kernels::cuda::cublas_loaded()) {
    CHECK_FALSE(mapped("/libcublas.so"));
    CHECK_FALSE(mapped("/libcublasLt.so"));
  }
  kernels::cuda::load_cublas();  // every entry point the kernels call is found
  CHECK(kernels::cuda::cublas_loaded());
  CHECK(mapped("/libcublas.so"));
  CHECK(mapped("/libcublasLt.so"));
  CHECK_THROWS_WITH(kernels::cuda::load_cublas("libcublas-missing.so.13"),
                    doctest::Contains("[cublas] libcublas-missing.so.13 could not be opened"));
  // A library that opens but is not cuBLAS: the first entry point it lacks is named.
  CHECK_THROWS_WITH(kernels::cuda::load_cublas("libz.so.1"), doctest::Contains("libz.so.1 has no cublasCreate_v2"));
}

TEST_CASE("cuda: availability is reported, and without a device the reason is given and CUDA use fails cleanly") {
  if (cuda::is_available()) {
    CHECK(cuda::device_count() > 0);
    CHECK(cuda::unavailable_reason().empty());
    CHECK(kernels::cuda::compiled());
    return;
  }
  MESSAGE("no CUDA device (" << cuda::unavailable_reason() << "): checking the failure paths");
  CHECK(cuda::device_count() == 0);
  CHECK_FALSE(cuda::unavailable_reason().empty());
  CHECK(cuda::memory_stats(0).allocated == 0);
  CHECK_THROWS_WITH_AS(cuda::allocator(0), doctest::Contains("[cuda]"), Error);
  CHECK_THROWS_WITH_AS(cuda::set_device(0), doctest::Contains("[cuda]"), Error);
  CHECK_THROWS(zeros({2, 2}).to(kGpu));
}

TEST_CASE("cuda: unary ops match the CPU for f32, bf16 and f16, contiguous and strided") {
  SKIP_WITHOUT_CUDA();
  using Fn = std::function<Tensor(const Tensor&)>;
  const std::vector<std::pair<const char*, Fn>> ops = {
      {"neg", [](const Tensor& x) { return quilt::neg(x); }},
      {"exp", [](const Tensor& x) { return quilt::exp(x); }},
      {"log", [](const Tensor& x) { return quilt::log(quilt::abs(x) + 0.1); }},
      {"sqrt", [](const Tensor& x) { return quilt::sqrt(quilt::abs(x)); }},
      {"rsqrt", [](const Tensor& x) { return quilt::rsqrt(quilt::abs(x) + 0.1); }},
      {"tanh", [](const Tensor& x) { return quilt::tanh(x); }},
      {"sigmoid", [](const Tensor& x) { return quilt::sigmoid(x); }},
      {"silu", [](const Tensor& x) { return quilt::silu(x); }},
      {"gelu", [](const Tensor& x) { return quilt::gelu(x); }},
      {"gelu_grad", [](const Tensor& x) { return quilt::gelu_grad(x); }},
      {"relu", [](const Tensor& x) { return quilt::relu(x); }},
      {"abs", [](const Tensor& x) { return quilt::abs(x); }},
      {"sign", [](const Tensor& x) { return quilt::sign(x); }},
      {"sin", [](const Tensor& x) { return quilt::sin(x); }},
      {"cos", [](const Tensor& x) { return quilt::cos(x); }},
      {"square", [](const Tensor& x) { return quilt::square(x); }},
      {"logical_not", [](const Tensor& x) { return quilt::logical_not(x); }},
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    // 1031 elements: not a multiple of any vector width, so the tail path runs too.
    Tensor x = randn({1031}, RngKey(1, "unary"), {.dtype = dt}) * 2.0;
    Tensor xt = randn({37, 29}, RngKey(2, "unary"), {.dtype = dt}).transpose(0, 1);  // strided
    for (const auto& [name, f] : ops) {
      const std::string what = std::string(name) + " " + dtype_name(dt);
      // The CPU computes the inner ops too, so both sides see the same (rounded) inputs.
      check_close(f(gpu(x)), f(x), rtol_of(dt), 1e-6, what);
      check_close(f(gpu(xt)), f(xt), rtol_of(dt), 1e-6, what + " strided");
    }
  }
  Tensor i = from_vector({-3, -1, 0, 2, 7}, {5}, {.dtype = DType::i32});
  check_equal(quilt::abs(gpu(i)), quilt::abs(i), "abs i32");
  check_equal(quilt::neg(gpu(i)), quilt::neg(i), "neg i32");
  check_equal(quilt::sign(gpu(i)), quilt::sign(i), "sign i32");
  check_equal(quilt::logical_not(gpu(i)), quilt::logical_not(i), "logical_not i32");
}

TEST_CASE("cuda: binary ops and where match the CPU with broadcasting, scalars and strides") {
  SKIP_WITHOUT_CUDA();
  using Fn = std::function<Tensor(const Tensor&, const Tensor&)>;
  const std::vector<std::pair<const char*, Fn>> ops = {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }},
      {"pow", [](const Tensor& a, const Tensor& b) { return quilt::pow(quilt::abs(a) + 0.5, b); }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return quilt::maximum(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return quilt::minimum(a, b); }},
      {"eq", [](const Tensor& a, const Tensor& b) { return quilt::eq(quilt::maximum(a, b), a); }},
      {"lt", [](const Tensor& a, const Tensor& b) { return quilt::lt(a, b); }},
      {"ge", [](const Tensor& a, const Tensor& b) { return quilt::ge(a, b); }},
      {"logical_and", [](const Tensor& a, const Tensor& b) { return quilt::logical_and(quilt::gt(a, b), quilt::gt(b, b * 0.0)); }},
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    Tensor a = randn({4, 1, 33}, RngKey(3, "a"), {.dtype = dt});
    Tensor b = randn({5, 33}, RngKey(3, "b"), {.dtype = dt});
    Tensor c = randn({4, 5, 33}, RngKey(3, "c"), {.dtype = dt});
    Tensor s = scalar_tensor(1.75, {.dtype = dt});
    Tensor ct = randn({33, 5, 4}, RngKey(3, "ct"), {.dtype = dt}).permute({2, 1, 0});
    for (const auto& [name, f] : ops) {
      const std::string what = std::string(name) + " " + dtype_name(dt);
      check_close(f(gpu(a), gpu(b)), f(a, b), rtol_of(dt), 1e-6, what + " broadcast");
      check_close(f(gpu(c), gpu(s)), f(c, s), rtol_of(dt), 1e-6, what + " tensor-scalar");
      check_close(f(gpu(s), gpu(c)), f(s, c), rtol_of(dt), 1e-6, what + " scalar-tensor");
      check_close(f(gpu(c), gpu(c * 0.5)), f(c, c * 0.5), rtol_of(dt), 1e-6, what + " contiguous");
      check_close(f(gpu(ct), gpu(c)), f(ct, c), rtol_of(dt), 1e-6, what + " strided");
    }
    Tensor cond = quilt::gt(randn({4, 1, 33}, RngKey(3, "cond")), scalar_tensor(0.0));
    check_equal(quilt::where(gpu(cond), gpu(c), gpu(b)), quilt::where(cond, c, b), std::string("where ") + dtype_name(dt));
  }
  Tensor i = from_vector({7, -7, 9, 0, 5}, {5}, {.dtype = DType::i64});
  Tensor j = from_vector({2, 2, 0, 3, -5}, {5}, {.dtype = DType::i64});
  check_equal(gpu(i) / gpu(j), i / j, "div i64 (in f32, x / 0 = inf)");
  check_equal(gpu(i) * gpu(j) - gpu(j), i * j - j, "mul/sub i64");
}

TEST_CASE("cuda: casts between every pair of dtypes equal the CPU's, contiguous and strided") {
  SKIP_WITHOUT_CUDA();
  const std::vector<double> v = {-3.75, -1, 0, 0.5, 1, 2.25, 100.625, 1234.5, -0.0, 7, 65.0, -120};
  const DType all[] = {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64, DType::b8};
  for (DType from : all) {
    Tensor src = from_vector(v, {3, 4}, {.dtype = from});
    Tensor src_gpu = gpu(src);
    for (DType to : all) {
      const std::string what = std::string(dtype_name(from)) + " -> " + dtype_name(to);
      check_equal(src_gpu.to(to), src.to(to), what);
      check_equal(src_gpu.transpose(0, 1).to(to), src.transpose(0, 1).to(to), what + " strided");
    }
    check_equal(src_gpu.transpose(0, 1).contiguous(), src.transpose(0, 1).contiguous(),
                std::string("strided same-dtype copy ") + dtype_name(from));
  }
  // fill_ and in-place ops on the device.
  Tensor z = zeros({3, 1000}, {.dtype = DType::bf16, .device = kGpu});
  z.fill_(1.5);
  check_equal(z, full({3, 1000}, 1.5, {.dtype = DType::bf16}), "fill bf16");
  z.narrow(1, 10, 500).fill_(-2);
  Tensor zc = full({3, 1000}, 1.5, {.dtype = DType::bf16});
  zc.narrow(1, 10, 500).fill_(-2);
  check_equal(z, zc, "strided fill bf16");
}

TEST_CASE("cuda: random numbers equal the CPU's bit for bit, whole tensors and shards") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const std::string d = dtype_name(dt);
    check_equal(rand({513, 129}, RngKey(11, "u"), {.dtype = dt, .device = kGpu}, -2, 3),
                rand({513, 129}, RngKey(11, "u"), {.dtype = dt}, -2, 3), "rand " + d);
    check_equal(randn({513, 129}, RngKey(11, "n"), {.dtype = dt, .device = kGpu}, 0.5, 0.02),
                randn({513, 129}, RngKey(11, "n"), {.dtype = dt}, 0.5, 0.02), "randn " + d);
  }
  // A shard of a (64, 100) tensor at offsets (16, 40) draws the global tensor's numbers there.
  const GlobalView view{{64, 100}, {16, 40}};
  Tensor shard = randn({32, 50}, RngKey(5, "w"), {.device = kGpu}, 0, 1, view);
  check_equal(shard, randn({32, 50}, RngKey(5, "w"), {}, 0, 1, view), "randn shard");
  check_equal(shard, randn({64, 100}, RngKey(5, "w")).narrow(0, 16, 32).narrow(1, 40, 50), "shard = slice of full");
  // f64 goes through the device's log/cos, which may differ from the host's in the last bit.
  check_close(randn({100, 100}, RngKey(9, "d"), {.dtype = DType::f64, .device = kGpu}),
              randn({100, 100}, RngKey(9, "d"), {.dtype = DType::f64}), 1e-14, 1e-15, "randn f64");
  check_equal(rand({100, 100}, RngKey(9, "d"), {.dtype = DType::f64, .device = kGpu}),
              rand({100, 100}, RngKey(9, "d"), {.dtype = DType::f64}), "rand f64");
}

TEST_CASE("cuda: reductions match the CPU over every kind of dim set") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor x = randn({7, 300, 5}, RngKey(21, "r"), {.dtype = dt});
    Tensor xg = gpu(x);
    const double rt = dt == DType::f32 ? 1e-4 : 2e-2;
    const std::vector<Shape> dim_sets = {{}, {0}, {1}, {2}, {0, 2}, {1, 2}, {0, 1}};
    for (const Shape& dims : dim_sets) {
      const std::string what = std::string(dtype_name(dt)) + " dims " + std::to_string(dims.size()) +
                               (dims.empty() ? "" : " first " + std::to_string(dims[0]));
      check_close(quilt::sum(xg, dims), quilt::sum(x, dims), rt, 1e-3, "sum " + what);
      check_close(quilt::mean(xg, dims, true), quilt::mean(x, dims, true), rt, 1e-4, "mean keepdim " + what);
      check_equal(quilt::max(xg, dims), quilt::max(x, dims), "max " + what);
      check_equal(quilt::min(xg, dims), quilt::min(x, dims), "min " + what);
    }
    for (int64_t d = 0; d < 3; ++d) check_equal(quilt::argmax(xg, d), quilt::argmax(x, d), "argmax dim " + std::to_string(d));
    check_equal(quilt::argmax(xg), quilt::argmax(x), "argmax all");
    check_close(quilt::sum_squares(xg), quilt::sum_squares(x), rt, 1e-3, "sum_squares");
    check_close(quilt::sum(xg.transpose(0, 2), {1}), quilt::sum(x.transpose(0, 2), {1}), rt, 1e-3, "sum strided");
  }
  // Large enough that the reduced range is split across blocks (two passes).
  Tensor big = rand({1 << 22}, RngKey(22, "big"));
  // Loose: the CPU's f32 sum of 4M values carries its own rounding error; this checks the layout.
  check_close(quilt::sum(gpu(big)), quilt::sum(big), 1e-3, 0, "sum of 4M");
  check_equal(quilt::max(gpu(big)), quilt::max(big), "max of 4M");
  check_equal(quilt::argmax(gpu(big)), quilt::argmax(big), "argmax of 4M");
  Tensor tall = rand({1 << 18, 3}, RngKey(22, "tall"));
  check_close(quilt::sum(gpu(tall), {0}), quilt::sum(tall, {0}), 1e-3, 0, "column sum of (2^18, 3)");
  // Ties: argmax returns the first maximum.
  Tensor ties = from_vector({1, 5, 5, 2, 5, 0}, {6});
  CHECK(quilt::argmax(gpu(ties)).item<int64_t>() == 1);
  Tensor ints = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::i32});
  check_equal(quilt::sum(gpu(ints), {1}), quilt::sum(ints, {1}), "sum i32 -> i64");
}

TEST_CASE("cuda: matmul matches the CPU for f32 and bf16, transposed, batched and broadcast") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::f32, DType::bf16}) {
    const double rt = dt == DType::f32 ? 1e-4 : 2e-2, at = dt == DType::f32 ? 1e-4 : 5e-2;
    const std::string d = dtype_name(dt);
    auto r = [&](const Shape& s, const char* k) { return randn(s, RngKey(31, k), {.dtype = dt}); };
    Tensor a = r({65, 130}, "a"), b = r({130, 47}, "b");
    check_close(matmul(gpu(a), gpu(b)), matmul(a, b), rt, at, "2-D " + d);
    Tensor at_ = r({130, 65}, "at").transpose(0, 1), bt = r({47, 130}, "bt").transpose(0, 1);
    check_close(matmul(gpu(at_), gpu(b)), matmul(at_, b), rt, at, "A^T " + d);
    check_close(matmul(gpu(a), gpu(bt)), matmul(a, bt), rt, at, "B^T " + d);
    check_close(matmul(gpu(at_), gpu(bt)), matmul(at_, bt), rt, at, "A^T B^T " + d);
    Tensor x3 = r({3, 4, 33, 17}, "x3"), w = r({17, 9}, "w");
    check_close(matmul(gpu(x3), gpu(w)), matmul(x3, w), rt, at, "folded batch " + d);
    Tensor p = r({4, 8, 16}, "p"), q = r({4, 16, 8}, "q");
    check_close(matmul(gpu(p), gpu(q)), matmul(p, q), rt, at, "strided batch " + d);
    Tensor u = r({2, 1, 8, 16}, "u"), v = r({1, 3, 16, 5}, "v");
    check_close(matmul(gpu(u), gpu(v)), matmul(u, v), rt, at, "broadcast batch (pointer arrays) " + d);
    Tensor l = r({5, 16}, "l");
    check_close(matmul(gpu(l), gpu(q)), matmul(l, q), rt, at, "broadcast left operand " + d);
  }
}

TEST_CASE("cuda: softmax and log-softmax match the CPU, forward and backward") {
  SKIP_WITHOUT_CUDA();
  for (int64_t cols : {10, 1000, 3000}) {  // a warp per row, then a block per row
    for (DType dt : {DType::f32, DType::bf16}) {
      for (bool log : {false, true}) {
        const std::string what = std::string(log ? "log_softmax " : "softmax ") + dtype_name(dt) + " cols " +
                                 std::to_string(cols);
        auto f = [&](const Tensor& x) { return log ? log_softmax(x, -1) : softmax(x, -1); };
        Tensor x = randn({37, cols}, RngKey(41, "x"), {.dtype = dt}) * 3.0;
        Tensor g = randn({37, cols}, RngKey(41, "g"), {.dtype = dt});
        Tensor xc = x.detach(), xg = gpu(x).detach();
        xc.set_requires_grad(true);
        xg.set_requires_grad(true);
        Tensor yc = f(xc), yg = f(xg);
        const double rt = dt == DType::f32 ? 1e-4 : 2e-2, at = dt == DType::f32 ? 1e-5 : 1e-3;
        check_close(yg, yc, rt, at, what);
        (yc * g).sum().backward();
        (yg * gpu(g)).sum().backward();
        check_close(xg.grad(), xc.grad(), rt, log ? 1e-2 : at, what + " backward");
      }
    }
  }
  // Over a middle dim too (the engine moves it last).
  Tensor x = randn({4, 300, 6}, RngKey(42, "x"));
  check_close(softmax(gpu(x), 1), softmax(x, 1), 1e-4, 1e-6, "softmax dim 1");
}

TEST_CASE("cuda: cross entropy matches the CPU, with ignored targets, forward and backward") {
  SKIP_WITHOUT_CUDA();
  for (int64_t cols : {7, 5000}) {
    const int64_t rows = 19;
    std::vector<double> t(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) t[size_t(i)] = i % 5 == 3 ? -100 : double((i * 7919) % cols);
    Tensor tc = from_vector(t, {rows}, {.dtype = DType::i64});
    for (DType dt : {DType::f32, DType::bf16}) {
      const std::string what = std::string(dtype_name(dt)) + " cols " + std::to_string(cols);
      Tensor x = randn({rows, cols}, RngKey(51, "x"), {.dtype = dt}) * 2.0;
      Tensor xc = x.detach(), xg = gpu(x).detach();
      xc.set_requires_grad(true);
      xg.set_requires_grad(true);
      Tensor lc = cross_entropy(xc, tc), lg = cross_entropy(xg, gpu(tc));
      const double rt = dt == DType::f32 ? 1e-5 : 1e-2;
      check_close(lg, lc, rt, 1e-5, "cross_entropy " + what);
      check_close(cross_entropy(xg, gpu(tc), -100, Reduction::none), cross_entropy(xc, tc, -100, Reduction::none), rt,
                  1e-5, "cross_entropy per row " + what);
      lc.backward();
      lg.backward();
      check_close(xg.grad(), xc.grad(), dt == DType::f32 ? 1e-4 : 2e-2, 1e-6, "cross_entropy backward " + what);
    }
  }
}

TEST_CASE("cuda: the caching allocator reuses freed blocks and keeps its counters") {
  SKIP_WITHOUT_CUDA();
  cuda::empty_cache(0);
  const MemoryStats s0 = cuda::memory_stats(0);
  void* first = nullptr;
  {
    Tensor t = empty({1 << 18}, {.device = kGpu});  // 1 MiB
    first = t.data_ptr();
    const MemoryStats s1 = cuda::memory_stats(0);
    CHECK(s1.allocated - s0.allocated == int64_t(1) << 20);
    CHECK(s1.num_allocs == s0.num_allocs + 1);
    CHECK(s1.peak_allocated >= s1.allocated);
  }
  const MemoryStats s2 = cuda::memory_stats(0);
  CHECK(s2.allocated == s0.allocated);
  CHECK(s2.reserved > s0.allocated);  // the block stays cached
  {
    Tensor t = empty({1 << 18}, {.device = kGpu});
    if (s0.allocated == 0) CHECK(t.data_ptr() == first);  // same stream: reused at once
    CHECK(cuda::memory_stats(0).num_system_allocs == s2.num_system_allocs);
  }
  cuda::reset_peak_memory(0);
  CHECK(cuda::memory_stats(0).peak_allocated == cuda::memory_stats(0).allocated);
  // A large tensor gets a segment of its own; once cached, a smaller request is split from it
  // (or from another cached block) without asking the driver, and empty_cache returns it.
  constexpr int64_t kBig = int64_t(64) << 20;
  { Tensor big = empty({kBig / 4}, {.device = kGpu}); }
  const MemoryStats s3 = cuda::memory_stats(0);
  CHECK(s3.reserved - s3.allocated >= kBig);
  {
    Tensor half = empty({kBig / 8}, {.device = kGpu});
    CHECK(cuda::memory_stats(0).num_system_allocs == s3.num_system_allocs);
  }
  cuda::empty_cache(0);
  CHECK(cuda::memory_stats(0).reserved <= s3.reserved - kBig);
}

TEST_CASE("cuda: work on a side stream is ordered with events and copies round-trip") {
  SKIP_WITHOUT_CUDA();
  Tensor x = randn({1 << 16}, RngKey(61, "x"));
  Tensor xg = gpu(x);
  Stream side = new_stream(kGpu);
  Event ready(kGpu);
  ready.record(current_stream(kGpu));
  Tensor y;
  {
    StreamGuard g(side);
    ready.wait(side);
    y = xg * 2.0 + 1.0;
    Event done(kGpu);
    done.record(side);
    done.synchronize();
    CHECK(done.query());
  }
  check_close(y, x * 2.0 + 1.0, 1e-6, 1e-6, "side stream result");
  synchronize(side);
  check_equal(gpu(x).to(Device::cpu()), x, "host -> device -> host");
}

TEST_CASE("cuda: non-blocking copies between pinned memory and the GPU, and a pinned block is not reused under a copy") {
  SKIP_WITHOUT_CUDA();
  const Tensor x = randn({1 << 20}, RngKey(62, "x"));
  Tensor pinned = Tensor::empty(x.shape(), {.dtype = DType::f32, .pinned = true});
  REQUIRE(pinned.is_pinned());
  pinned.copy_(x);
  // Work queued ahead keeps the stream busy, so the copy below is still pending when the host
  // frees its source and allocates (and overwrites) a block of the same size.
  const Tensor big = randn({2048, 2048}, RngKey(62, "a")).to(kGpu);
  Tensor busy = big;
  for (int i = 0; i < 8; ++i) busy = matmul(busy, big) * (1.0 / 2048);
  Tensor on_gpu = pinned.to(kGpu, /*non_blocking=*/true);
  pinned = Tensor();
  Tensor other = Tensor::empty(x.shape(), {.dtype = DType::f32, .pinned = true});
  other.fill_(-7.0);
  synchronize(current_stream(kGpu));
  check_equal(on_gpu, x, "pinned -> device, source freed and its size allocated again before the copy ran");
  // Back to the host: pinned, valid once the stream is synchronised; a pageable or strided
  // source takes the waiting path and gives the same values.
  Tensor back = on_gpu.to(Device::cpu(), true);
  CHECK(back.is_pinned());
  synchronize(current_stream(kGpu));
  check_equal(back, x, "device -> pinned host");
  check_equal(x.to(kGpu, true), x, "pageable -> device (waits)");
  check_equal(transpose(gpu(x.reshape({1024, 1024})), 0, 1).to(Device::cpu(), true), transpose(x.reshape({1024, 1024}), 0, 1),
              "strided device -> host (waits)");
}

TEST_CASE("cuda: randint draws on the device the CPU's integers, for integer and floating dtypes") {
  SKIP_WITHOUT_CUDA();
  for (DType dt : {DType::i64, DType::i32, DType::f32, DType::bf16}) {
    const Tensor want = randint(-7, 1000, {3, 1031}, RngKey(63, "r"), {.dtype = dt});
    const Tensor got = randint(-7, 1000, {3, 1031}, RngKey(63, "r"), {.dtype = dt, .device = kGpu});
    REQUIRE(got.device() == kGpu);
    check_equal(got, want, std::string("randint ") + dtype_name(dt));
  }
  CHECK(randint(0, 5, {0}, RngKey(63, "e"), {.dtype = DType::i64, .device = kGpu}).numel() == 0);
}

TEST_CASE("cuda: record_stream and graphs refuse what they cannot do, on every build") {
  CHECK_FALSE(cuda::capture_underway());
  Tensor host = ones({4});
  CHECK_FALSE(host.record_stream(current_stream(Device::cpu())));  // the host allocator tracks no stream
  float buf[4] = {1, 2, 3, 4};
  Tensor borrowed = Tensor::from_storage(Storage::borrow(buf, sizeof(buf), Device::cpu(), nullptr), {4}, {1}, 0,
                                         DType::f32);
  CHECK_FALSE(borrowed.record_stream(current_stream(Device::cpu())));
  cuda::Graph g;
  CHECK_THROWS_WITH_AS(g.capture_begin(current_stream(Device::cpu())),
                       doctest::Contains("[cuda graph] capture_begin on a stream of cpu"), Error);
  CHECK_THROWS_WITH_AS(g.replay(current_stream(Device::cpu())), doctest::Contains("not captured"), Error);
  CHECK_THROWS_WITH_AS(g.capture_end(), doctest::Contains("without capture_begin"), Error);
  CHECK_FALSE(g.captured());
  CHECK_FALSE(cuda::capture_underway());
}

TEST_CASE("cuda: a block recorded on a side stream is not reused before that stream is done") {
  SKIP_WITHOUT_CUDA();
  const Stream side = new_stream(kGpu);
  void* first = nullptr;
  {
    Tensor t = zeros({1 << 20}, {.device = kGpu});
    first = t.data_ptr();
    CHECK(t.record_stream(side));
    Event on_compute(kGpu);
    on_compute.record(current_stream(kGpu));
    on_compute.wait(side);
  }
  synchronize(side);
  synchronize(current_stream(kGpu));
  Tensor again = zeros({1 << 20}, {.device = kGpu});  // both streams are done: the block is back
  CHECK(again.data_ptr() == first);
}

TEST_CASE("cuda: a captured graph replays the step on new inputs, and its memory is private") {
  SKIP_WITHOUT_CUDA();
  const Stream s = new_stream(kGpu);
  Tensor x = gpu(arange(0, 1024, 1, {.dtype = DType::f32}));
  Tensor y;
  cuda::Graph g;
  synchronize(current_stream(kGpu));
  g.capture_begin(s);
  CHECK(cuda::capture_underway());
  y = quilt::exp(x * 0.001) + 1.0;
  g.capture_end();
  CHECK_FALSE(cuda::capture_underway());
  CHECK(g.captured());
  for (int step = 1; step <= 3; ++step) {
    {
      StreamGuard on(s);
      x.copy_(gpu(arange(0, 1024, 1, {.dtype = DType::f32}) * double(step)));
    }
    g.replay(s);
    synchronize(s);
    check_close(y.to(Device::cpu()), quilt::exp(arange(0, 1024, 1, {.dtype = DType::f32}) * (0.001 * step)) + 1.0, 1e-6,
                1e-6, "graph replay " + std::to_string(step));
  }
  g.reset();
  CHECK_FALSE(g.captured());
}
