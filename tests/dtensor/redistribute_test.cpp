// Redistribute on the threads backend: every placement pair round-trips on 1-D and 2-D meshes,
// uneven and smaller-than-mesh shapes included; gradients flow back through it.
#include <doctest/doctest.h>

#include "tests/dtensor/util.h"

using namespace quilt;
using test::make_dist;
using test::max_abs_diff;

namespace {

// Every (src, dst) pair: dst holds the same global value, and going back to src does too.
void round_trips(int world, const Shape& mesh_shape, const std::vector<Shape>& shapes, size_t stride) {
  run_threads_group(world, [&](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, mesh_shape);
    uint64_t seed = 0;
    for (const Shape& shape : shapes) {
      Tensor g = randn(shape, RngKey(1, "g"), {.dtype = DType::f64});
      const auto all = all_placements(mesh_shape.size(), int64_t(shape.size()));
      size_t pair = 0;
      for (const Placements& src : all)
        for (const Placements& dst : all) {
          if (pair++ % stride != 0) continue;  // stride > 1: a fixed sample of a large product
          Tensor x = make_dist(g, mesh, src, ++seed);
          Tensor y = redistribute(x, dst);
          INFO("shape ", shape, " ", str(src), " -> ", str(dst));
          REQUIRE(has_placements(y, dst));
          CHECK(y.local().shape() == local_block(shape, mesh_shape, dst, mesh.coordinate()).shape);
          CHECK(max_abs_diff(full_tensor(y), g) < 1e-12);
          Tensor z = redistribute(y, src);
          CHECK(max_abs_diff(full_tensor(z), g) < 1e-12);
          if (!dst.empty() && std::none_of(dst.begin(), dst.end(), [](const Placement& p) { return p.is_partial(); })) {
            // Shard/Replicate layouts are exact: the local shard is the global block.
            const Block b = local_block(shape, mesh_shape, dst, mesh.coordinate());
            Tensor want = g;
            for (size_t d = 0; d < shape.size(); ++d) want = want.narrow(int64_t(d), b.offset[d], b.shape[d]);
            CHECK(max_abs_diff(y.local(), want) < 1e-12);
          }
        }
    }
  });
}

}  // namespace

TEST_CASE("redistribute: every pair round-trips on a 1-D mesh, uneven sizes included") {
  round_trips(4, {4}, {{8, 4}, {5, 3}, {2, 7}, {0, 3}}, 1);
  round_trips(3, {3}, {{7}, {1, 5}}, 1);
}

TEST_CASE("redistribute: every pair round-trips on 2-D meshes with nested shards") {
  round_trips(4, {2, 2}, {{5, 3}, {2, 9}}, 1);
  round_trips(6, {2, 3}, {{7, 4}, {1, 2}}, 2);
}

TEST_CASE("redistribute: gradients go back to the source layout, Partial sources get Replicate") {
  run_threads_group(4, [](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2, 2});
    Tensor g = randn({5, 3}, RngKey(2, "g"), {.dtype = DType::f64});
    Tensor w = randn({5, 3}, RngKey(2, "w"), {.dtype = DType::f64});
    const std::vector<std::pair<Placements, Placements>> cases = {
        {{Shard(0), Shard(1)}, {Replicate(), Replicate()}}, {{Shard(0), Shard(0)}, {Shard(1), Replicate()}},
        {{Partial(), Shard(1)}, {Replicate(), Shard(0)}},  {{Replicate(), Replicate()}, {Partial(), Shard(1)}},
        {{Partial(ReduceOp::max), Replicate()}, {Shard(1), Replicate()}}};
    for (const auto& entry : cases) {  // no structured binding: clang 14 cannot capture one
      const auto& src = entry.first;
      const auto& dst = entry.second;
      INFO(str(src), " -> ", str(dst));
      Tensor x = make_dist(g, mesh, src, 7).detach().set_requires_grad();
      Tensor y = redistribute(x, dst);
      Tensor loss = sum(y * distribute_tensor(w, mesh, {Replicate(), Replicate()}));
      loss.backward();
      Tensor gx = x.grad();
      REQUIRE(gx.defined());
      CHECK(placements_of(gx) == placements_of(x));  // a leaf's gradient keeps the leaf's layout
      CHECK(max_abs_diff(full_tensor(gx), w) < 1e-12);
    }
  });
}

TEST_CASE("dtensor: from_local infers the global shape of a dim sharded over two axes") {
  run_threads_group(6, [](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {2, 3});
    Tensor g = randn({7, 5}, RngKey(6, "g"), {.dtype = DType::f64});
    for (const Placements& pl : {Placements{Shard(0), Shard(0)}, Placements{Shard(1), Shard(0)}, Placements{Replicate(), Shard(1)}}) {
      Tensor local = distribute_tensor(g, mesh, pl).local().clone();
      Tensor x = from_local(local, mesh, pl);
      CHECK(x.shape() == Shape{7, 5});
      CHECK(test::max_abs_diff(full_tensor(x), g) == 0);
    }
  });
}

TEST_CASE("dtensor: from_local infers uneven global shapes and to_local/full_tensor are differentiable") {
  run_threads_group(4, [](Communicator& c) {
    DeviceMesh mesh = test::mesh_of_shape(c, {4});
    Tensor g = arange(0, 30, 1, {.dtype = DType::f64}).view({10, 3});
    Tensor local = distribute_tensor(g, mesh, {Shard(0)}).local().clone().set_requires_grad();
    Tensor x = from_local(local, mesh, {Shard(0)});
    CHECK(x.shape() == Shape{10, 3});
    CHECK(local.shape() == Shape{c.rank() < 3 ? 3 : 1, 3});
    CHECK(max_abs_diff(full_tensor(x), g) == 0);
    Tensor loss = sum(full_tensor(x) * 2.0);
    loss.backward();
    CHECK(max_abs_diff(local.grad(), full(local.shape(), 2.0, {.dtype = DType::f64})) == 0);
    CHECK_THROWS_WITH_AS(from_local(zeros({2, 3}, {.dtype = DType::f64}), mesh, {Shard(0)}, Shape{10, 3}),
                         doctest::Contains("is not the shard (S(0)) gives it"), Error);
    // to_local's gradient is the shard of a gradient of the tensor's own layout.
    Tensor y = distribute_tensor(g, mesh, {Shard(1)}).detach().set_requires_grad();
    Tensor l = sum(to_local(y) * 3.0);
    l.backward();
    CHECK(placements_of(y.grad()) == Placements{Shard(1)});
    CHECK(max_abs_diff(full_tensor(y.grad()), full({10, 3}, 3.0, {.dtype = DType::f64})) == 0);
  });
}
