// A few optimizer steps of a small MLP laid out with FSDP x TP on a 2-D mesh follow the
// single-process run: gradients arrive in each parameter's layout and optimizers update shards.
#include <doctest/doctest.h>

#include "dtensor/grad_norm.h"
#include "tests/dtensor/util.h"

using namespace quilt;

namespace {

struct Mlp {
  Tensor w1, w2, b1;
};

Tensor loss_of(const Mlp& m, const Tensor& x, const Tensor& y, const std::optional<DeviceMesh>& mesh) {
  Tensor w1 = m.w1, w2 = m.w2;
  if (mesh) {  // FSDP: gather the dp shards before use; the backward reduce-scatters
    w1 = redistribute(w1, {Replicate(), Shard(1)});
    w2 = redistribute(w2, {Replicate(), Shard(0)});
  }
  Tensor h = relu(matmul(x, w1) + m.b1);  // column-parallel over tp
  Tensor out = matmul(h, w2);             // row-parallel over tp: Partial, reduced by the loss
  return mean(square(out - y));
}

template <class Opt>
std::vector<Tensor> train(const std::optional<DeviceMesh>& mesh, int steps) {
  Tensor x = randn({8, 6}, RngKey(1, "x"), {.dtype = DType::f64});
  Tensor y = randn({8, 4}, RngKey(1, "y"), {.dtype = DType::f64});
  Mlp m;
  m.w1 = randn({6, 10}, RngKey(1, "w1"), {.dtype = DType::f64}) * 0.5;
  m.w2 = randn({10, 4}, RngKey(1, "w2"), {.dtype = DType::f64}) * 0.5;
  m.b1 = randn({10}, RngKey(1, "b1"), {.dtype = DType::f64}) * 0.1;
  if (mesh) {
    x = distribute_tensor(x, *mesh, {Shard(0), Replicate()});
    y = distribute_tensor(y, *mesh, {Shard(0), Replicate()});
    m.w1 = distribute_tensor(m.w1, *mesh, {Shard(0), Shard(1)});
    m.w2 = distribute_tensor(m.w2, *mesh, {Shard(1), Shard(0)});
    m.b1 = distribute_tensor(m.b1, *mesh, {Replicate(), Shard(0)});
  }
  for (Tensor* p : {&m.w1, &m.w2, &m.b1}) *p = p->detach().set_requires_grad();
  Opt opt(std::vector<Tensor>{m.w1, m.w2, m.b1}, {.lr = 0.05});
  std::vector<Tensor> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor loss = loss_of(m, x, y, mesh);
    loss.backward();
    dtensor::clip_grad_norm_({m.w1, m.w2, m.b1}, 0.5);
    opt.step();
    opt.zero_grad();
    losses.push_back(full_tensor(loss.detach()));
  }
  for (Tensor* p : {&m.w1, &m.w2, &m.b1}) losses.push_back(full_tensor(p->detach()));
  return losses;
}

template <class Opt>
void compare() {
  const std::vector<Tensor> want = train<Opt>(std::nullopt, 3);
  run_threads_group(4, [&](Communicator& c) {
    DeviceMesh mesh(c.shared_from_this(), {2, 2}, {"dp", "tp"});
    const std::vector<Tensor> got = train<Opt>(mesh, 3);
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) CHECK(test::max_abs_diff(got[i], want[i]) < 1e-10);
  });
}

}  // namespace

TEST_CASE("training: SGD steps on an FSDP x TP layout follow the single-process run") { compare<SGD>(); }
TEST_CASE("training: AdamW steps on an FSDP x TP layout follow the single-process run") { compare<AdamW>(); }
