// Placements, chunk arithmetic and the redistribute planner: pure functions, no ranks.
#include <doctest/doctest.h>

#include "dtensor/redistribute.h"
#include "dtensor/sharding.h"

using namespace quilt;

namespace {
// Expected size lists go through an out-of-line copy: GCC 12.2 with -march=native (AVX-512)
// miscompiles some inline int64 vector constants such as {1, 1, 0, 0} (SLP vectorizer).
__attribute__((noinline)) std::vector<int64_t> sizes(std::initializer_list<int64_t> v) { return {v.begin(), v.end()}; }
}  // namespace

TEST_CASE("sharding: chunks follow torch.chunk for any size on any axis") {
  CHECK(chunk_sizes(10, 4) == sizes({3, 3, 3, 1}));
  CHECK(chunk_sizes(8, 4) == sizes({2, 2, 2, 2}));
  CHECK(chunk_sizes(2, 4) == sizes({1, 1, 0, 0}));
  CHECK(chunk_sizes(5, 3) == sizes({2, 2, 1}));
  CHECK(chunk_sizes(7, 4) == sizes({2, 2, 2, 1}));
  CHECK(chunk_sizes(9, 4) == sizes({3, 3, 3, 0}));  // ceil-sized: the last one is empty
  CHECK(chunk_sizes(0, 3) == sizes({0, 0, 0}));
  CHECK(chunk_of(10, 4, 3) == Chunk{9, 1});
  CHECK(chunk_of(2, 4, 3) == Chunk{2, 0});
  for (int64_t n = 0; n < 20; ++n)
    for (int64_t k = 1; k < 9; ++k) {
      int64_t next = 0;
      for (int64_t i = 0; i < k; ++i) {
        const Chunk c = chunk_of(n, k, i);
        CHECK(c.offset == next);  // pieces tile the dim in order
        next += c.size;
      }
      CHECK(next == n);
    }
  CHECK_THROWS_WITH_AS(chunk_of(4, 2, 2), doctest::Contains("[sharding] chunk 2 of 2 pieces"), Error);
}

TEST_CASE("sharding: a dim sharded over two axes is cut in mesh-axis order") {
  // 10 rows over (2, 2), both axes on dim 0: axis 0 cuts 5 | 5, axis 1 cuts each 5 into 3 | 2.
  const Shape g{10, 6}, m{2, 2};
  const Placements p{Shard(0), Shard(0)};
  CHECK(local_block(g, m, p, {0, 0}).offset == Shape{0, 0});
  CHECK(local_block(g, m, p, {0, 1}).offset == Shape{3, 0});
  CHECK(local_block(g, m, p, {1, 0}).offset == Shape{5, 0});
  CHECK(local_block(g, m, p, {1, 1}).offset == Shape{8, 0});
  CHECK(local_block(g, m, p, {1, 1}).shape == Shape{2, 6});
  const Block b = local_block(g, m, {Shard(1), Partial()}, {1, 1});
  CHECK(b.offset == Shape{0, 3});
  CHECK(b.shape == Shape{10, 3});
  CHECK(piece_before_axis(g, m, p, {1, 1}, 1, 0) == Chunk{5, 5});
  CHECK(all_coordinates({2, 3}).size() == 6);
  CHECK(all_coordinates({2, 3})[4] == Shape{1, 1});
}

TEST_CASE("sharding: placements print and parse back") {
  const Placements p{Shard(1), Replicate(), Partial(ReduceOp::max), Partial()};
  CHECK(str(p) == "(S(1), R, P(max), P(sum))");
  CHECK(parse_placements(str(p)) == p);
  CHECK(parse_placements("()").empty());
  CHECK(normalize_placements({Shard(-1)}, 3, "t") == Placements{Shard(2)});
  CHECK_THROWS_WITH_AS(normalize_placements({Shard(3)}, 3, "t"), doctest::Contains("[t] Shard(3) is out of range"),
                       Error);
  CHECK_THROWS_WITH_AS(parse_placement("Q(1)"), doctest::Contains("[placement] cannot parse 'Q(1)'"), Error);
}

TEST_CASE("redistribute: plans use one collective per changed axis and gather inner axes first") {
  CHECK(plan_redistribute({4}, {Shard(0)}, {Replicate()}).str() == "axis 0: S(0) -> R");
  CHECK(plan_redistribute({4}, {Partial()}, {Shard(1)}).str() == "axis 0: P(sum) -> S(1)");
  CHECK(plan_redistribute({4}, {Shard(0)}, {Shard(1)}).str() == "axis 0: S(0) -> S(1)");
  CHECK(plan_redistribute({4}, {Shard(0)}, {Shard(0)}).steps.empty());
  // P(sum) -> P(max) has no direct collective: reduce, then re-split.
  CHECK(plan_redistribute({4}, {Partial()}, {Partial(ReduceOp::max)}).str() ==
        "axis 0: P(sum) -> R; axis 0: R -> P(max)");
  // Both axes shard dim 0: the inner (later) axis must be joined before the outer one.
  const auto& p = plan_redistribute({2, 2}, {Shard(0), Shard(0)}, {Replicate(), Shard(0)});
  REQUIRE(p.steps.size() == 3);
  CHECK(p.steps[0].axis == 1);
  CHECK(p.steps[1].axis == 0);
  CHECK(p.steps[2].axis == 1);
  // The cheaper order: reduce-scatter on one axis first shrinks what the other axis reduces.
  const auto& q = plan_redistribute({2, 4}, {Partial(), Partial()}, {Shard(0), Shard(1)});
  CHECK(q.steps.size() == 2);
  CHECK(q.cost < 2 * (2.0 * 3 / 4));  // cheaper than two full all-reduces
  const size_t n = redistribute_plan_cache_size();
  (void)plan_redistribute({2, 4}, {Partial(), Partial()}, {Shard(0), Shard(1)});
  CHECK(redistribute_plan_cache_size() == n);  // cached
  CHECK_THROWS_WITH_AS(plan_redistribute({2, 2}, {Replicate(), Replicate()}, {Partial(), Partial(ReduceOp::max)}),
                       doctest::Contains("mix Partial reductions"), Error);
}
