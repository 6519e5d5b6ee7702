// The threads backend: the shared correctness suite at several world sizes, plus its fault
// behaviour (timeouts that name the missing ranks, mismatched calls, failed ranks).
#include <doctest/doctest.h>

#include <chrono>
#include <mutex>

#include "collectives/communicator.h"
#include "engine/engine.h"
#include "tests/collectives/suite.h"

using namespace quilt;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> suite_on_threads(int n, const testing::SuiteConfig& cfg = {}) {
  std::mutex mu;
  std::vector<std::string> all;
  run_threads_group(n, [&](Communicator& c) {
    auto f = testing::run_collectives_suite(c, cfg);
    std::lock_guard lk(mu);
    all.insert(all.end(), f.begin(), f.end());
  }, {.timeout = 60s});
  return all;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < 20; ++i) s += v[i] + "\n";
  return s;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

TEST_CASE("threads backend: every collective, dtype and size is right on 1 rank") {
  auto f = suite_on_threads(1);
  CHECK_MESSAGE(f.empty(), joined(f));
}

TEST_CASE("threads backend: every collective, dtype and size is right on 2 ranks") {
  auto f = suite_on_threads(2);
  CHECK_MESSAGE(f.empty(), joined(f));
}

TEST_CASE("threads backend: every collective, dtype and size is right on 3 ranks") {
  auto f = suite_on_threads(3);
  CHECK_MESSAGE(f.empty(), joined(f));
}

TEST_CASE("threads backend: every collective, dtype and size is right on 4 ranks") {
  auto f = suite_on_threads(4);
  CHECK_MESSAGE(f.empty(), joined(f));
}

TEST_CASE("threads backend: every collective, dtype and size is right on 8 ranks") {
  testing::SuiteConfig cfg;
  cfg.sizes = {0, 1, 7, 300, 20011};
  auto f = suite_on_threads(8, cfg);
  CHECK_MESSAGE(f.empty(), joined(f));
}

TEST_CASE("threads backend: a rank that skips a collective makes the others fail naming it") {
  std::mutex mu;
  std::vector<std::string> errors;
  const auto t0 = std::chrono::steady_clock::now();
  run_threads_group(3, [&](Communicator& c) {
    Tensor t = ones({4});
    c.all_reduce(t);
    if (c.rank() == 1) return;  // skips all_reduce #2
    try {
      c.all_reduce(t);
    } catch (const Error& e) {
      std::lock_guard lk(mu);
      errors.push_back(e.what());
    }
  }, {.timeout = 300ms});
  CHECK(seconds_since(t0) < 5.0);
  REQUIRE(errors.size() == 2);
  for (const std::string& e : errors) {
    CHECK_MESSAGE(e.find("all_reduce #2 on world (shape (4,), f32, sum") != std::string::npos, e);
    CHECK_MESSAGE(e.find("did not complete within 300 ms") != std::string::npos, e);
    CHECK_MESSAGE(e.find("ranks that had not arrived: 1 (last entered all_reduce #1)") != std::string::npos, e);
  }
}

TEST_CASE("threads backend: a rank that times out waiting for a slower peer's reads keeps its buffers for it") {
  // reduce_scatter_v with rows {N, 1}: rank 0 reduces N elements of both inputs, rank 1 one,
  // so rank 1 reaches the departure barrier long before rank 0. A first call with the group's
  // long timeout measures how long rank 0 takes; the second runs with a quarter of that, so
  // rank 1 times out at departure while rank 0 still reads rank 1's input, and rank 1's caller
  // then drops that input. Its 256 MiB come from mmap (the block cache is off here), so a
  // released buffer would be unmapped under rank 0's reads: a crash in any build, a
  // use-after-free report under ASan.
  const int64_t saved_limit = cpu_cache_limit();
  set_cpu_cache_limit(0);
  constexpr int64_t N = int64_t(64) << 20;
  std::mutex mu;
  std::vector<std::string> errors;
  run_threads_group(2, [&](Communicator& c) {
    {
      Tensor in = ones({N + 1});
      Tensor out = zeros({c.rank() == 0 ? N : 1});
      c.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      c.reduce_scatter_v(out, in, {N, 1});  // rank 1 waits at departure until rank 0 is done
      Tensor took_ms = full({1}, seconds_since(t0) * 1e3);
      c.broadcast(took_ms, 0);  // one timeout for both ranks
      c.barrier();
      c.set_timeout(std::max(1ms, std::chrono::milliseconds(int64_t(took_ms.item<double>() / 4))));
      try {
        c.reduce_scatter_v(out, in, {N, 1});
      } catch (const Error& e) {
        std::lock_guard lk(mu);
        errors.push_back(e.what());
      }
    }  // rank 1 releases its tensors here, while rank 0 may still be reducing
  }, {.timeout = 60s});
  set_cpu_cache_limit(saved_limit);
  REQUIRE(errors.size() == 2);
  for (const std::string& e : errors) {
    CHECK_MESSAGE(e.find("reduce_scatter_v #5 on world") != std::string::npos, e);
    CHECK_MESSAGE(e.find(" did not complete within ") != std::string::npos, e);
  }
}

TEST_CASE("threads backend: ranks calling different shapes fail naming the odd rank") {
  std::mutex mu;
  std::vector<std::string> errors;
  run_threads_group(4, [&](Communicator& c) {
    Tensor t = ones({c.rank() == 2 ? 5 : 4});
    try {
      c.all_reduce(t);
    } catch (const Error& e) {
      std::lock_guard lk(mu);
      errors.push_back(e.what());
    }
    c.barrier();  // the group is still usable afterwards
  });
  REQUIRE(errors.size() == 4);
  for (const std::string& e : errors)
    CHECK_MESSAGE(e.find("rank 2 calls all_reduce #1 with shape (5,), f32, sum but rank 0 calls all_reduce #1 with "
                         "shape (4,), f32, sum") != std::string::npos, e);
}

TEST_CASE("threads backend: ranks calling different collectives fail naming the op of each") {
  CHECK_THROWS_WITH_AS(run_threads_group(2, [&](Communicator& c) {
    Tensor t = ones({3}, {.dtype = DType::i64});
    if (c.rank() == 0) c.broadcast(t, 0);
    else c.all_reduce(t);
  }), doctest::Contains("rank 1 calls all_reduce #1 with shape (3,), i64, sum but rank 0 calls broadcast #1 with "
                         "shape (3,), i64, root 0"), Error);
}

TEST_CASE("threads backend: all_to_all_single split sizes that do not match name both ranks") {
  // Rank 0 sends itself 1 row but expects 2 from itself: the first mismatch of the matrix.
  CHECK_THROWS_WITH_AS(run_threads_group(2, [&](Communicator& c) {
    Tensor in = zeros({4}), out = zeros({4});
    std::vector<int64_t> in_splits = c.rank() == 0 ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{2, 2};
    c.all_to_all_single(out, in, {2, 2}, in_splits);
  }), doctest::Contains("rank 0 sends 1 elements to rank 0, which expects 2 from it"), Error);
}

TEST_CASE("threads backend: a failing rank abandons the others' collectives at once") {
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(run_threads_group(4, [&](Communicator& c) {
    if (c.rank() == 3) fail("[test] rank 3 broke");
    c.barrier();
  }, {.timeout = 60s}), "[test] rank 3 broke", Error);
  CHECK(seconds_since(t0) < 5.0);
}

TEST_CASE("threads backend: a receive with no matching send times out naming the peer") {
  CHECK_THROWS_WITH_AS(run_threads_group(2, [&](Communicator& c) {
    Tensor t = zeros({3});
    if (c.rank() == 1) c.recv(t, 0, 5);
  }, {.timeout = 200ms}), doctest::Contains("recv p2p#1 on world (shape (3,), f32, from rank 0, tag 5, rank 1) did "
                                            "not complete within 200 ms"), Error);
}

TEST_CASE("threads backend: a receive of the wrong size names both sizes") {
  CHECK_THROWS_WITH_AS(run_threads_group(2, [&](Communicator& c) {
    if (c.rank() == 0) c.send(zeros({3}), 1);
    else c.recv(zeros({4}), 0);
  }), doctest::Contains("rank 0 sent 3 elements of f32 to rank 1 (tag 0) but the receive expects 4 of f32"), Error);
}

TEST_CASE("threads backend: async works report completion and wait_for gives up in time") {
  run_threads_group(2, [&](Communicator& c) {
    Tensor t = full({5}, c.rank() + 1.0);
    Work w = c.all_reduce(t, ReduceOp::max, /*async_op=*/true);
    w.wait();
    CHECK(w.is_completed());
    CHECK(t.to_vector() == std::vector<double>(5, 2.0));
    CHECK(w.describe().find("all_reduce #1 on world") != std::string::npos);
    if (c.rank() == 0) {
      Tensor r = zeros({1});
      Work pending = c.recv(r, 1, 9, true);
      CHECK_FALSE(pending.wait_for(20ms));
      CHECK_FALSE(pending.is_completed());
      c.barrier();  // now rank 1 sends
      CHECK(pending.wait_for(10s));
      CHECK(r.item<double>() == 42.0);
    } else {
      c.barrier();
      c.send(full({1}, 42.0), 0, 9);
    }
  });
}

TEST_CASE("threads backend: bad arguments are rejected with messages naming the op and sizes") {
  run_threads_group(2, [&](Communicator& c) {
    CHECK_THROWS_WITH_AS(c.all_gather(zeros({5}), zeros({3})),
                         "[all_gather] output of shape (5,) (5 elements) cannot hold 2 inputs of shape (3,) on world",
                         Error);
    CHECK_THROWS_WITH_AS(c.broadcast(zeros({2}), 2), "[broadcast] root 2 is out of range for world of 2 ranks", Error);
    CHECK_THROWS_WITH_AS(c.all_reduce(zeros({2}, {.dtype = DType::b8}), ReduceOp::avg),
                         "[all_reduce] avg is not defined for bool tensors", Error);
    CHECK_THROWS_WITH_AS(c.all_to_all_single(zeros({3}), zeros({3})), doctest::Contains("do not split evenly over 2 ranks"),
                         Error);
    CHECK_THROWS_WITH_AS(c.all_gather_v(zeros({3, 2}), zeros({1, 2}), {1, 1}),
                         "[all_gather_v] output has 3 rows, the row counts (1, 1) add up to 2", Error);
    CHECK_THROWS_WITH_AS(c.reduce_scatter(zeros({2}), zeros({5}, {.dtype = DType::f64})),
                         "[reduce_scatter] output is f32 but input is f64", Error);
    CHECK_THROWS_WITH_AS(c.send(zeros({1}), -1), "[send] peer -1 is out of range for world of 2 ranks", Error);
    // Rejected calls consume no sequence number: the ranks stay in step.
    CHECK(c.last_seq() == 0);
    c.barrier();
    CHECK(c.last_seq() == 1);
  });
}

TEST_CASE("threads backend: tensors that require grad are reduced without touching autograd") {
  run_threads_group(2, [&](Communicator& c) {
    Tensor w = full({3}, 1.0).set_requires_grad(true);
    c.all_reduce(w);
    CHECK(w.to_vector() == std::vector<double>(3, 2.0));
    CHECK(w.is_leaf());
  });
}

TEST_CASE("threads backend: a work describes its op, communicator named, after the communicators are gone") {
  // Op descriptions hold the communicator's name interned, not a copy: a name past the short-string
  // size (a split's) must still read back once every communicator of the group has been destroyed.
  std::vector<Work> works(2);
  run_threads_group(2, [&](Communicator& c) {
    std::shared_ptr<Communicator> sub = c.split(0, c.rank());
    Tensor t = full({3}, 1.0);
    works[size_t(c.rank())] = sub->all_reduce(t, ReduceOp::sum, /*async_op=*/true);
    works[size_t(c.rank())].wait();
    CHECK(t.to_vector() == std::vector<double>(3, 2.0));
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(works[size_t(r)].describe() ==
          "all_reduce #1 on world.split1[color 0] (shape (3,), f32, sum, rank " + std::to_string(r) + ")");
  }
}
