// DeviceMesh over the threads backend: coordinates, per-axis communicators, sub-meshes, flattening.
#include <doctest/doctest.h>

#include "tests/dtensor/util.h"

using namespace quilt;

TEST_CASE("mesh: coordinates are row-major and each axis has its own group") {
  run_threads_group(8, [](Communicator& c) {
    DeviceMesh mesh(c.shared_from_this(), {2, 2, 2}, {"pp", "dp", "tp"});
    const int r = c.rank();
    CHECK(mesh.coordinate() == Shape{r / 4, (r / 2) % 2, r % 2});
    CHECK(mesh.comm(2).size() == 2);
    CHECK(mesh.comm(2).rank() == r % 2);
    // all_reduce over tp sums the two ranks that differ only in the last coordinate.
    Tensor t = full({1}, double(r), {.dtype = DType::f64});
    mesh.comm(mesh.axis("tp")).all_reduce(t);
    CHECK(t.item<double>() == double(2 * (r - r % 2) + 1));
    Tensor u = full({1}, double(r), {.dtype = DType::f64});
    mesh.comm(0).all_reduce(u);
    CHECK(u.item<double>() == double(2 * (r % 4) + 4));
  });
}

TEST_CASE("mesh: sub-meshes by name and flattened axes as torchtitan builds them") {
  run_threads_group(8, [](Communicator& c) {
    DeviceMesh mesh(c.shared_from_this(), {2, 2, 2}, {"dp_shard", "cp", "tp"});
    const int r = c.rank();
    DeviceMesh tp = mesh["tp"];
    CHECK(tp.ndim() == 1);
    CHECK(tp.axis_names() == std::vector<std::string>{"tp"});
    CHECK(tp.ranks() == std::vector<int>{r - r % 2, r - r % 2 + 1});
    CHECK(mesh["tp"] == tp);  // cached: the same mesh
    DeviceMesh flat = mesh[{"dp_shard", "cp"}];
    CHECK(flat.axis_names() == std::vector<std::string>{"dp_shard_cp"});
    CHECK(flat.size() == 4);
    CHECK(flat.coordinate(0) == r / 2);
    CHECK(flat.ranks() == std::vector<int>{r % 2, r % 2 + 2, r % 2 + 4, r % 2 + 6});
    Tensor t = full({1}, 1.0, {.dtype = DType::f64});
    flat.comm().all_reduce(t);
    CHECK(t.item<double>() == 4.0);
    DeviceMesh sub = mesh.sub({"cp", "tp"});
    CHECK(sub.shape() == Shape{2, 2});
    CHECK(sub.coordinate() == Shape{(r / 2) % 2, r % 2});
    CHECK(sub.comm().size() == 4);
    CHECK(mesh.str() == "DeviceMesh(dp_shard=2, cp=2, tp=2)");
    CHECK_THROWS_WITH_AS(mesh["ep"], doctest::Contains("[device_mesh] no axis 'ep' in DeviceMesh(dp_shard=2, cp=2, tp=2)"),
                         Error);
  });
}

TEST_CASE("mesh: a shape that does not cover the communicator is an error naming both") {
  run_threads_group(4, [](Communicator& c) {
    CHECK_THROWS_WITH_AS(DeviceMesh(c.shared_from_this(), {2, 3}, {"a", "b"}),
                         doctest::Contains("mesh shape (2, 3) (6 ranks) does not match the 4 ranks"), Error);
    CHECK_THROWS_WITH_AS(DeviceMesh(c.shared_from_this(), {2, 2}, {"a", "a"}),
                         doctest::Contains("axis name 'a' is used twice"), Error);
  });
}
