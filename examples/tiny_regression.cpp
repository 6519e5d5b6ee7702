// A tiny model trained with the public API: a two-layer MLP fits y = sin(3x) by SGD.
// Exits non-zero if the loss does not fall by 10x, so the build checks it really learns.
#include <cstdio>

#include "engine/engine.h"

using namespace quilt;

int main() {
  const int64_t n = 256, hidden = 32;
  Tensor x = rand({n, 1}, RngKey(0, "x"), {}, -1.0, 1.0);
  Tensor y = sin(x * 3.0);
  Tensor w1 = randn({1, hidden}, RngKey(0, "w1"), {}, 0.0, 1.0).set_requires_grad();
  Tensor b1 = zeros({hidden}, {.requires_grad = true});
  Tensor w2 = randn({hidden, 1}, RngKey(0, "w2"), {}, 0.0, 0.2).set_requires_grad();
  const double lr = 0.1;
  double first = 0, last = 0;
  for (int step = 0; step < 500; ++step) {
    Tensor h = tanh(matmul(x, w1) + b1);
    Tensor loss = mean(square(matmul(h, w2) - y));
    loss.backward();
    {
      NoGradGuard ng;
      for (Tensor* p : {&w1, &b1, &w2}) {
        p->add_(p->grad(), -lr);
        p->set_grad({});
      }
    }
    last = loss.item<double>();
    if (step == 0) first = last;
    if (step % 100 == 0 || step == 499) std::printf("step %3d  loss %.6f\n", step, last);
  }
  if (!(last < first / 10)) {
    std::printf("loss did not fall enough: %.6f -> %.6f\n", first, last);
    return 1;
  }
  return 0;
}
