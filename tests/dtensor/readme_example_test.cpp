// The DTensor example of README.md, compiled and run here (on 4 threads standing in for 4
// ranks), and checked to be the README's text word for word so the two cannot drift apart.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "dtensor/checkpoint.h"
#include "tests/dtensor/util.h"

using namespace quilt;

namespace {

// The lines between the markers below, without their common indentation.
std::string example_from_this_file() {
  // The markers are built here so that these lines do not match themselves.
  const std::string marker = std::string("// README ") + "example ";
  std::ifstream f(__FILE__);
  std::string line, out;
  bool in = false;
  while (std::getline(f, line)) {
    const size_t at = line.find_first_not_of(' ');
    const std::string text = at == std::string::npos ? "" : line.substr(at);
    if (text == marker + "end") break;
    if (in) out += (line.size() >= 4 ? line.substr(4) : std::string()) + "\n";
    if (text == marker + "begin") in = true;
  }
  return out;
}

std::string readme() {
  const auto path = std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "README.md";
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("readme: the DTensor example runs and matches the single-process result") {
  const std::string dir = (std::filesystem::temp_directory_path() / ("quilt_readme_" + std::to_string(::getpid()))).string();
  std::vector<Tensor> ys(4), grads(4);
  run_threads_group(4, [&](Communicator& comm) {
    // README example begin
    DeviceMesh mesh(comm.shared_from_this(), {2, 2}, {"dp", "tp"});   // world_ptr() under mpiexec
    Tensor x = distribute_tensor(randn({6, 8}, RngKey(0, "x")), mesh, {Shard(0), Replicate()});
    Tensor w = distribute_tensor(randn({8, 5}, RngKey(0, "w")), mesh, {Replicate(), Shard(1)})
                   .detach().set_requires_grad();          // a column-parallel weight (a leaf)
    Tensor y = relu(matmul(x, w));                         // (S(0), S(1)): no communication
    Tensor loss = mean(square(y));                         // reduced over both axes as needed
    loss.backward();                                       // w.grad() arrives as (R, S(1))
    Tensor r = redistribute(y, {Replicate(), Shard(1)});   // all-gathers rows over dp
    Tensor full = full_tensor(y);                          // plain (6, 5), the same on every rank
    dtensor::save_checkpoint(dir + "/step-1", {{"w", w}}, comm);
    // README example end
    CHECK(placements_of(y) == Placements{Shard(0), Shard(1)});
    CHECK(placements_of(w.grad()) == Placements{Replicate(), Shard(1)});
    CHECK(placements_of(r) == Placements{Replicate(), Shard(1)});
    ys[size_t(comm.rank())] = full;
    grads[size_t(comm.rank())] = full_tensor(w.grad());
  });
  Tensor x = randn({6, 8}, RngKey(0, "x"));
  Tensor w = randn({8, 5}, RngKey(0, "w")).set_requires_grad();
  Tensor y = relu(matmul(x, w));
  mean(square(y)).backward();
  for (int r = 0; r < 4; ++r) {
    CHECK(test::max_abs_diff(ys[size_t(r)], y) < 1e-6);
    CHECK(test::max_abs_diff(grads[size_t(r)], w.grad()) < 1e-6);
  }
  CHECK(dtensor::read_checkpoint_info(dir + "/step-1").tensors.at(0).placements == "(R, S(1))");
  std::filesystem::remove_all(dir);

  const std::string example = example_from_this_file();
  REQUIRE(example.size() > 200);
  CHECK_MESSAGE(readme().find(example) != std::string::npos,
                "README.md's DTensor example differs from tests/dtensor/readme_example_test.cpp");
}
