// The pieces under the backends: host reduction kernels (16-bit floats added as numbers, not
// bits), the signature check of debug mode, options from the environment, one-rank launch,
// rank-prefixed logging and the NCCL backend (at world size 1 when a GPU is present).
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "collectives/internal.h"
#include "collectives/launch.h"
#include "engine/engine.h"
#include "tests/collectives/suite.h"

using namespace quilt;
using namespace std::chrono_literals;

TEST_CASE("host reduce: bf16 and f16 sums add values, not bit patterns") {
  std::vector<BFloat16> a = {BFloat16(1.5f), BFloat16(-2.0f), BFloat16(3.0f)};
  std::vector<BFloat16> b = {BFloat16(2.25f), BFloat16(0.5f), BFloat16(-7.0f)};
  detail::combine_into(DType::bf16, ReduceOp::sum, a.data(), b.data(), 3);
  CHECK(float(a[0]) == 3.75f);
  CHECK(float(a[1]) == -1.5f);
  CHECK(float(a[2]) == -4.0f);
  std::vector<Half> h = {Half(0.1f), Half(1000.0f)}, k = {Half(0.2f), Half(24.0f)};
  const void* srcs[] = {h.data(), k.data(), h.data()};
  std::vector<Half> out(2);
  detail::reduce_many(DType::f16, ReduceOp::sum, out.data(), srcs, 3, 2);
  CHECK(float(out[0]) == doctest::Approx(0.4).epsilon(1e-3));
  CHECK(float(out[1]) == 2024.0f);
}

TEST_CASE("host reduce: 16-bit sums over many ranks accumulate in float and round once") {
  // 1 + 8 * 2^-9: each partial sum in bf16 would round back to 1; float accumulation keeps it.
  std::vector<BFloat16> one = {BFloat16(1.0f)}, tiny = {BFloat16(1.0f / 512)};
  std::vector<const void*> srcs = {one.data()};
  for (int i = 0; i < 8; ++i) srcs.push_back(tiny.data());
  BFloat16 out;
  detail::reduce_many(DType::bf16, ReduceOp::sum, &out, srcs.data(), int(srcs.size()), 1);
  CHECK(float(out) == 1.015625f);
}

TEST_CASE("host reduce: integers wrap, bool sum is or and min is and, avg truncates") {
  std::vector<int32_t> a = {2147483647, -7}, b = {1, 2};
  detail::combine_into(DType::i32, ReduceOp::sum, a.data(), b.data(), 2);
  CHECK(a[0] == -2147483647 - 1);
  CHECK(a[1] == -5);
  detail::divide_by(DType::i32, a.data() + 1, 1, 2);
  CHECK(a[1] == -2);
  bool bx[] = {false, true, true}, by[] = {false, false, true};
  detail::combine_into(DType::b8, ReduceOp::sum, bx, by, 3);
  CHECK(bx[0] == false);
  CHECK(bx[1] == true);
  bool cx[] = {false, true, true};
  detail::combine_into(DType::b8, ReduceOp::min, cx, by, 3);
  CHECK(cx[1] == false);
  CHECK(cx[2] == true);
  CHECK_THROWS_WITH_AS(detail::divide_by(DType::b8, bx, 3, 2), "[collectives] avg is not defined for bool tensors",
                       Error);
  float f[] = {1.0f, 2.0f}, g[] = {NAN, 0.0f};
  detail::combine_into(DType::f32, ReduceOp::max, f, g, 2);
  CHECK(std::isnan(f[0]));
  CHECK(f[1] == 2.0f);
}

TEST_CASE("debug check: the rank that differs from the majority is named, even rank 0") {
  detail::OpDesc d;
  d.kind = detail::OpKind::all_reduce;
  d.seq = 4;
  d.comm = "world";
  detail::Signature s;
  s.seq = 4;
  s.kind = int32_t(detail::OpKind::all_reduce);
  s.rop = 0;
  s.ndim = 2;
  s.dims[0] = 4;
  s.dims[1] = 3;
  s.shape_hash = 11;
  std::vector<detail::Signature> all(3, s);
  detail::check_signatures(all, d);  // all agree: no throw
  all[0].dims[1] = 2;
  all[0].shape_hash = 12;
  CHECK_THROWS_WITH_AS(detail::check_signatures(all, d),
                       "[all_reduce] ranks disagree on collective #4 of world: rank 0 calls all_reduce #4 with shape "
                       "(4, 2), f32, sum but rank 1 calls all_reduce #4 with shape (4, 3), f32, sum",
                       Error);
  all[0] = s;
  all[2].extra_hash = 99;
  CHECK_THROWS_WITH_AS(detail::check_signatures(all, d), doctest::Contains("(their per-rank row sizes differ)"), Error);
}

TEST_CASE("options: timeout and debug mode come from the environment unless given") {
  ::setenv("QUILT_COMM_TIMEOUT_S", "2.5", 1);
  ::setenv("QUILT_COMM_DEBUG", "1", 1);
  CHECK(resolved_timeout({}) == 2500ms);
  CHECK(resolved_timeout({.timeout = 7s}) == 7s);
  CHECK(resolved_debug_checks({}));
  CHECK_FALSE(resolved_debug_checks({.debug_checks = false}));
  ::setenv("QUILT_COMM_TIMEOUT_S", "soon", 1);
  CHECK_THROWS_WITH_AS(resolved_timeout({}),
                       "[communicator] QUILT_COMM_TIMEOUT_S must be a positive number of seconds, got 'soon'", Error);
  ::unsetenv("QUILT_COMM_TIMEOUT_S");
  ::unsetenv("QUILT_COMM_DEBUG");
  CHECK(resolved_timeout({}) == std::chrono::minutes(10));
  CHECK_FALSE(resolved_debug_checks({}));
}

namespace {
// Runs fn with stderr redirected to a file and returns what it printed.
template <class F>
std::string capture_stderr(F&& fn) {
  char path[] = "/tmp/quilt_log_XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  std::fflush(stderr);
  const int saved = dup(2);
  dup2(fd, 2);
  fn();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::remove(path);
  return ss.str();
}
}  // namespace

TEST_CASE("launch: without a launcher the program is one rank and logs as rank 0") {
  const LaunchInfo& info = init_from_launcher();
  CHECK(info.rank == 0);
  CHECK(info.world_size == 1);
  CHECK(info.launcher == "none");
  Communicator& w = world();
  CHECK(w.size() == 1);
  CHECK(w.backend() == "local");
  CHECK(&cpu_world() == &w);
  Tensor t = from_vector({1, 2, 3}, {3});
  w.all_reduce(t, ReduceOp::avg);
  CHECK(t.to_vector() == std::vector<double>{1, 2, 3});
  const std::string out = capture_stderr([] {
    log_line("hello ", 3);
    set_log_ranks({1});
    log_line("hidden");
    log_line_every_rank("shown anyway");
    set_log_ranks({0});
  });
  CHECK(out == "[rank 0] hello 3\n[rank 0] shown anyway\n");
  finalize();
  CHECK_FALSE(is_initialized());
}

TEST_CASE("nccl backend: the collectives suite passes at world size 1 on a GPU") {
  if (!nccl_available()) {
    MESSAGE("skipped: NCCL needs a CUDA build and a GPU (", cuda::unavailable_reason(), ")");
    CHECK_THROWS_WITH_AS(make_nccl_communicator(*make_threads_group(1)[0], Device::cuda(0)),
                         doctest::Contains("[nccl] "), Error);
    return;
  }
  auto boot = make_threads_group(1)[0];
  auto comm = make_nccl_communicator(*boot, Device::cuda(0), {.timeout = 60s});
  CHECK(comm->backend() == "nccl");
  CHECK(comm->size() == 1);
  auto failures = testing::run_collectives_suite(*comm, {});
  std::string text;
  for (auto& f : failures) text += f + "\n";
  CHECK_MESSAGE(failures.empty(), text);
  // A host tensor (a loss, a count, a strided view) goes through a copy on the communicator's GPU
  // and its result comes back to the host; a tensor on another GPU is refused naming both.
  Tensor host = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::f64});
  Tensor col = host.transpose(0, 1);
  comm->all_reduce(col, ReduceOp::max);
  CHECK(host.device().is_cpu());
  CHECK(host.to_vector() == std::vector<double>{1, 2, 3, 4, 5, 6});
  Tensor gathered = Tensor::empty({3, 2}, {.dtype = DType::f64}).transpose(0, 1);  // strided host output
  comm->all_gather(gathered, host);
  CHECK(gathered.to_vector() == std::vector<double>{1, 2, 3, 4, 5, 6});
  if (cuda::device_count() > 1)
    CHECK_THROWS_WITH_AS(comm->all_reduce(host.to(Device::cuda(1))),
                         doctest::Contains("works on cuda:0 (or host) tensors, got one on cuda:1"), Error);
}

TEST_CASE("inline slot: the watchdog's snapshot describes the running op exactly, and nothing once it left") {
  detail::InlineSlot slot;
  slot.comm = "world.split3[color 1]";
  slot.rank = 2;
  CHECK_FALSE(slot.snapshot().has_value());
  detail::OpDesc d;
  d.kind = detail::OpKind::reduce;
  d.seq = 17;
  d.comm = slot.comm;
  d.rank = 2;
  d.has_tensor = true;
  d.dtype = DType::bf16;
  d.shape = Shape{4, 3, 2};
  d.rop = ReduceOp::max;
  d.root = 1;
  slot.enter(d, 2500ms);
  auto snap = slot.snapshot();
  REQUIRE(snap.has_value());
  CHECK(snap->first.str() == d.str());
  CHECK(snap->first.str() == "reduce #17 on world.split3[color 1] (shape (4, 3, 2), bf16, max, root 1, rank 2)");
  CHECK(snap->second == 2500ms);
  slot.leave();
  CHECK_FALSE(slot.snapshot().has_value());
  detail::OpDesc b;  // no tensor, no reduction
  b.kind = detail::OpKind::barrier;
  b.seq = 18;
  b.comm = slot.comm;
  b.rank = 2;
  slot.enter(b, 1s);
  snap = slot.snapshot();
  REQUIRE(snap.has_value());
  CHECK(snap->first.str() == "barrier #18 on world.split3[color 1] (rank 2)");
}

TEST_CASE("op shape: inline up to 8 dims, spilled beyond, equal to the shape either way") {
  const Shape small{5, 1, 7}, big{2, 1, 3, 1, 2, 1, 2, 1, 3};
  detail::OpShape a = small, b = big;
  CHECK(a.size() == 3);
  CHECK(a.vec() == small);
  CHECK(a.numel() == 35);
  CHECK(b.size() == 9);
  CHECK(b.vec() == big);
  CHECK(b[8] == 3);
  CHECK(b.numel() == 72);
  b = small;
  CHECK(b.vec() == small);
  CHECK(detail::OpShape().numel() == 1);
}

TEST_CASE("communicator names in op descriptions: one stored copy per name, the empty name by default") {
  const detail::CommName a("dp.split12[color 3] of a long mesh axis"), b(std::string("dp.split12[color 3] of a long mesh axis"));
  CHECK(&a.str() == &b.str());  // interned: the same storage, whichever way it was named
  CHECK(a.str() == "dp.split12[color 3] of a long mesh axis");
  const detail::CommName c("tp");
  CHECK(&c.str() != &a.str());
  CHECK(detail::CommName().str().empty());
  detail::OpDesc d;
  d.kind = detail::OpKind::barrier;
  d.seq = 2;
  d.comm = a;
  CHECK(d.str() == "barrier #2 on dp.split12[color 3] of a long mesh axis (rank 0)");
}
