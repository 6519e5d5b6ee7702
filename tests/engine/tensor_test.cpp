// Tensor basics: views share storage, strides, printing, errors that name the op.
#include <doctest/doctest.h>

#include "engine/engine.h"

using namespace quilt;

TEST_CASE("tensor: views share storage and contiguous() copies only when needed") {
  Tensor x = arange(0, 12, 1, {.dtype = DType::f32}).view({3, 4});
  Tensor t = x.transpose(0, 1);
  CHECK(t.shape() == Shape{4, 3});
  CHECK_FALSE(t.is_contiguous());
  CHECK(t.storage().id() == x.storage().id());
  Tensor c = t.contiguous();
  CHECK(c.is_contiguous());
  CHECK(c.storage().id() != x.storage().id());
  CHECK(c.to_vector() == std::vector<double>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  CHECK(x.contiguous().is_same(x));
}

TEST_CASE("tensor: slice, select, expand and reshape agree with index arithmetic") {
  Tensor x = arange(0, 24, 1, {.dtype = DType::f64}).view({2, 3, 4});
  CHECK(x.slice(2, 1, 4, 2).to_vector() == std::vector<double>{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23});
  CHECK(x.select(1, -1).to_vector() == std::vector<double>{8, 9, 10, 11, 20, 21, 22, 23});
  Tensor e = from_vector({1, 2}, {2, 1}, {.dtype = DType::f64}).expand({2, 3});
  CHECK(e.strides() == Shape{1, 0});
  CHECK(e.to_vector() == std::vector<double>{1, 1, 1, 2, 2, 2});
  Tensor r = x.transpose(0, 2).reshape({-1});
  CHECK(r.numel() == 24);
  CHECK(r.to_vector()[1] == 12);
}

TEST_CASE("tensor: bad shapes raise errors naming the op and the shapes") {
  Tensor x = zeros({2, 3});
  CHECK_THROWS_WITH_AS(x.view({4, 2}), doctest::Contains("[view] cannot view shape (2, 3)"), Error);
  CHECK_THROWS_WITH_AS(add(zeros({2, 3}), zeros({4})), doctest::Contains("[add] shapes (2, 3) and (4,) do not broadcast"), Error);
  CHECK_THROWS_WITH_AS(matmul(zeros({2, 3}), zeros({4, 2})), doctest::Contains("[matmul] inner dims differ"), Error);
}

TEST_CASE("tensor: casts round to nearest even and keep specials") {
  Tensor x = from_vector({1.0, 1.00390625, -2.5, 65504, 1e-8}, {5}, {.dtype = DType::f64});
  auto bf = x.to(DType::bf16).to_vector();
  CHECK(bf[0] == 1.0);
  CHECK(bf[1] == 1.0);  // halfway case rounds to even
  CHECK(bf[2] == -2.5);
  auto h = x.to(DType::f16).to_vector();
  CHECK(h[3] == 65504);
  CHECK(h[4] == doctest::Approx(0.0).epsilon(1e-7));
}

TEST_CASE("tensor: printing shows values, shape and dtype") {
  Tensor x = from_vector({1, 2, 3, 4}, {2, 2}, {.dtype = DType::i64});
  CHECK(x.str() == "Tensor([[1, 2],\n        [3, 4]], shape=(2, 2), dtype=i64, device=cpu)");
}

TEST_CASE("tensor: transposing copies of every dtype match element by element (tiled path)") {
  for (DType dt : {DType::f32, DType::bf16, DType::f64, DType::i32, DType::b8}) {
    Tensor x = randn({3, 37, 45}, RngKey(9, "t")).to(dt);
    Tensor c = x.transpose(1, 2).contiguous();  // batched 2-D transpose
    Tensor c2 = x.select(0, 1).transpose(0, 1).contiguous();
    const std::vector<double> v = x.to_vector(), cv = c.to_vector(), cv2 = c2.to_vector();
    bool ok = true;
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t i = 0; i < 37; ++i)
        for (int64_t j = 0; j < 45; ++j) {
          ok = ok && cv[size_t(b * 45 * 37 + j * 37 + i)] == v[size_t(b * 37 * 45 + i * 45 + j)];
          if (b == 1) ok = ok && cv2[size_t(j * 37 + i)] == v[size_t(b * 37 * 45 + i * 45 + j)];
        }
    CHECK_MESSAGE(ok, dtype_name(dt));
  }
}
