// Primitive's device choice: forward() runs forward_cpu or forward_cuda by the inputs' device
// (device_of), and an op without forward_cuda throws naming itself. No CUDA tensor can be made
// without a GPU, so the CUDA side is reached through forward_on(device) and through an op whose
// device is an attribute (no tensor inputs).
#include <doctest/doctest.h>

#include <string>

#include "engine/engine.h"
#include "engine/primitive.h"

using namespace quilt;

namespace {

Tensor vec(std::vector<double> v) {
  const int64_t n = int64_t(v.size());
  return from_vector(v, {n}, {.dtype = DType::f64});
}

// Doubles its input, on the CPU only; counts its calls.
class CpuDouble final : public Primitive {
 public:
  const char* name() const override { return "test_cpu_double"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    ++cpu_calls;
    return {in[0] * 2.0};
  }
  int cpu_calls = 0;
};

// Both devices; records which one ran (its CUDA side touches no device).
class BothDevices final : public Primitive {
 public:
  const char* name() const override { return "test_both_devices"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    ran = "cpu";
    return {in[0] + 1.0};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>&) override {
    ran = "cuda";
    return {};
  }
  std::string ran;
};

// No tensor inputs: fills a (2,) tensor with 7 on the device it was made for.
class Sevens final : public Primitive {
 public:
  explicit Sevens(Device device) : device_(device) {}
  const char* name() const override { return "test_sevens"; }
  Device device_of(const std::vector<Tensor>&) const override { return device_; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>&) override { return {full({2}, 7.0)}; }

 private:
  Device device_;
};

// One forward for every device; counts its calls.
class Identity final : public AnyDevicePrimitive {
 public:
  const char* name() const override { return "test_identity"; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    ++calls;
    return {in[0]};
  }
  int calls = 0;
};

}  // namespace

TEST_CASE("primitive: an op without forward_cuda, asked to run on CUDA, throws naming itself") {
  CpuDouble p;
  CHECK_THROWS_WITH_AS(p.forward_on(Device::cuda(0), {vec({1, 2})}),
                       "[test_cpu_double] has no CUDA implementation in this build", Error);
  CHECK_THROWS_WITH_AS(p.forward_on(Device::cuda(1), {}), "[test_cpu_double] has no CUDA implementation in this build",
                       Error);
  CHECK(p.cpu_calls == 0);
}

TEST_CASE("primitive: forward() runs CPU inputs through forward_cpu, also under apply()") {
  auto p = std::make_shared<CpuDouble>();
  CHECK(p->forward({vec({1, -2})})[0].to_vector() == std::vector<double>{2, -4});
  CHECK(apply1(p, {vec({3})}).to_vector() == std::vector<double>{6});
  CHECK(p->cpu_calls == 2);

  BothDevices both;
  CHECK(both.forward({vec({1, 2})})[0].to_vector() == std::vector<double>{2, 3});
  CHECK(both.ran == "cpu");
  CHECK(both.forward_on(Device::cuda(0), {}).empty());
  CHECK(both.ran == "cuda");
}

TEST_CASE("primitive: an op without tensor inputs runs on the device its attribute names") {
  CHECK(apply1(std::make_shared<Sevens>(Device::cpu()), {}).to_vector() == std::vector<double>{7, 7});
  CHECK_THROWS_WITH_AS(apply1(std::make_shared<Sevens>(Device::cuda(0)), {}),
                       "[test_sevens] has no CUDA implementation in this build", Error);
}

TEST_CASE("primitive: an AnyDevicePrimitive runs its one forward on either device") {
  Identity p;
  const Tensor x = vec({4});
  CHECK(p.forward({x})[0].is_same(x));
  CHECK(p.forward_on(Device::cuda(0), {x})[0].is_same(x));
  CHECK(p.calls == 2);
}

TEST_CASE("primitive: the engine's ops still compute on the CPU through the dispatch") {
  const Tensor a = vec({1, 2, 3}), b = vec({10, 20, 30});
  CHECK((a + b).to_vector() == std::vector<double>{11, 22, 33});
  CHECK(sum(a * b).item<double>() == 140.0);
  CHECK(matmul(reshape(a, {1, 3}), reshape(b, {3, 1})).item<double>() == 140.0);
  CHECK(cumsum(a, 0).to_vector() == std::vector<double>{1, 3, 6});
}
