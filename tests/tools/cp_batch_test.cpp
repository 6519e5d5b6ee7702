// context_parallel_batch: each cp rank's share of a batch is its load-balanced chunks of every
// row (per document when packed), with the tokens' targets, positions and documents; the ranks'
// shares together are the batch.
#include <doctest/doctest.h>

#include "engine/engine.h"
#include "tools/train_step.h"

using namespace quilt;

namespace {

Tensor ints(const std::vector<double>& v, Shape shape) { return from_vector(v, shape, {.dtype = DType::i64}); }

std::vector<int64_t> row_of(const Tensor& x, int64_t r) {
  const Tensor c = contiguous(x.narrow(0, r, 1));
  return {c.data<int64_t>(), c.data<int64_t>() + c.numel()};
}

}  // namespace

TEST_CASE("cp batch: unpacked rows take chunks r and 2·cp−1−r with positions 0..T−1") {
  // Two rows of 8 tokens: inputs 100 + i (row 1: 200 + i), targets the next token.
  std::vector<double> in, tg;
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 8; ++i) in.push_back(100 * (r + 1) + i), tg.push_back(100 * (r + 1) + i + 1);
  const Batch b{ints(in, {2, 8}), ints(tg, {2, 8}), {}, {}};
  const Batch r0 = context_parallel_batch(b, 2, 0), r1 = context_parallel_batch(b, 2, 1);
  CHECK(r0.inputs.shape() == Shape{2, 4});
  CHECK(row_of(r0.inputs, 0) == std::vector<int64_t>{100, 101, 106, 107});
  CHECK(row_of(r0.inputs, 1) == std::vector<int64_t>{200, 201, 206, 207});
  CHECK(row_of(r1.targets, 1) == std::vector<int64_t>{203, 204, 205, 206});
  CHECK(row_of(r0.positions, 1) == std::vector<int64_t>{0, 1, 6, 7});
  CHECK(row_of(r1.positions, 0) == std::vector<int64_t>{2, 3, 4, 5});
  CHECK_FALSE(r0.document_ids.defined());
}

TEST_CASE("cp batch: packed rows are laid out per document, positions and padding travel with their tokens") {
  // One packed row of 12: a document of 4 (positions 0..3), one of 8 (0..7), padding targets -100.
  const Tensor in = ints({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {1, 12});
  const Tensor tg = ints({2, 3, 4, -100, 6, 7, 8, 9, 10, 11, -100, -100}, {1, 12});
  const Tensor pos = ints({0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7}, {1, 12});
  const Tensor doc = ints({0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, {1, 12});
  const Batch b{in, tg, pos, doc};
  const Batch r0 = context_parallel_batch(b, 2, 0), r1 = context_parallel_batch(b, 2, 1);
  // Document 0 in chunks of 1, document 1 in chunks of 2: rank 0 takes chunks 0 and 3 of each.
  CHECK(row_of(r0.inputs, 0) == std::vector<int64_t>{1, 4, 5, 6, 11, 12});
  CHECK(row_of(r1.inputs, 0) == std::vector<int64_t>{2, 3, 7, 8, 9, 10});
  CHECK(row_of(r0.targets, 0) == std::vector<int64_t>{2, -100, 6, 7, -100, -100});
  CHECK(row_of(r0.positions, 0) == std::vector<int64_t>{0, 3, 0, 1, 6, 7});
  CHECK(row_of(r1.document_ids, 0) == std::vector<int64_t>{0, 0, 1, 1, 1, 1});
  // A document 2·cp does not divide is named.
  const Batch bad{in, tg, pos, ints({0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {1, 12})};
  CHECK_THROWS_WITH_AS(context_parallel_batch(bad, 2, 0),
                       doctest::Contains("document 0's length 3 is not divisible by 2·cp = 4 (cp 2)"), Error);
}
