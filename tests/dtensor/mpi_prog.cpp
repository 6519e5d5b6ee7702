// Multi-rank dtensor checks under mpiexec (registered in tests/dtensor.cmake):
//
//   mpiexec -n 4|8 dtensor_mpi redistribute         every placement pair round-trips, 1-D and 2-D
//   mpiexec -n 4 dtensor_mpi ckpt-save <root>        saves <root>/step-1 at this world size
//   mpiexec -n 2|8 dtensor_mpi ckpt-load <root> <mesh>   loads the latest into mesh "2", "8", "2x4"
//   mpiexec -n 4 dtensor_mpi ckpt-crash <root>       saves step-1, then rank 1 dies (SIGKILL)
//                                                    half-way through writing step-2
//   mpiexec -n 2 dtensor_mpi ckpt-verify-crash <root>   step-1 is still the latest complete one
//
// Each mode prints "[rank N] ok: ..." and exits 0, or prints what differed and exits 1.
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "collectives/launch.h"
#include "dtensor/checkpoint.h"
#include "tests/dtensor/util.h"

using namespace quilt;
namespace fs = std::filesystem;

namespace {

int g_failures = 0;

void expect(bool ok, const std::string& what) {
  if (ok) return;
  ++g_failures;
  log_line_every_rank("FAILED: ", what);
}

// Every pair (or every `stride`-th) on `mesh`: the target holds the global value, going back
// does too, and (on a sample) gradients flow back to the source layout.
int round_trips(const DeviceMesh& mesh, const std::vector<Shape>& shapes, size_t stride) {
  int pairs = 0;
  uint64_t seed = 0;
  for (const Shape& shape : shapes) {
    Tensor g = randn(shape, RngKey(3, "g"), {.dtype = DType::f64});
    const auto all = all_placements(size_t(mesh.ndim()), int64_t(shape.size()));
    size_t k = 0;
    for (const Placements& src : all)
      for (const Placements& dst : all) {
        if (k++ % stride != 0) continue;
        ++pairs;
        const std::string what = detail::concat("mesh ", mesh.shape(), " shape ", shape, " ", str(src), " -> ", str(dst));
        Tensor x = test::make_dist(g, mesh, src, ++seed).detach().set_requires_grad();
        Tensor y = redistribute(x, dst);
        expect(test::max_abs_diff(full_tensor(y.detach()), g) < 1e-12, what + ": forward");
        expect(test::max_abs_diff(full_tensor(redistribute(y.detach(), src)), g) < 1e-12, what + ": back");
        if (pairs % 7 == 0) {  // gradients on a sample: full_tensor(grad) is the weight
          Tensor w = randn(shape, RngKey(4, "w"), {.dtype = DType::f64});
          sum(y * w).backward();
          expect(placements_of(x.grad()) == placements_of(x), what + ": gradient layout");
          expect(test::max_abs_diff(full_tensor(x.grad()), w) < 1e-12, what + ": gradient");
        }
      }
  }
  return pairs;
}

const std::vector<std::pair<std::string, Shape>> kTensors = {
    {"w", {5, 3}}, {"tiny", {2, 7}}, {"rows", {13, 2}}, {"vec", {6}}};

Tensor value(const std::string& name, const Shape& shape) { return randn(shape, RngKey(77, name)); }

DeviceMesh parse_mesh(const std::string& spec) {
  Shape shape;
  size_t start = 0;
  while (true) {
    const size_t x = spec.find('x', start);
    shape.push_back(std::stoll(spec.substr(start, x == std::string::npos ? std::string::npos : x - start)));
    if (x == std::string::npos) break;
    start = x + 1;
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < shape.size(); ++i) names.push_back("a" + std::to_string(i));
  return DeviceMesh(world_ptr(), shape, names);
}

void save(const std::string& dir, const DeviceMesh& mesh) {
  const std::vector<Placements> pl = {{Shard(0)}, {Shard(1)}, {Partial()}, {Replicate()}};
  dtensor::StateDict state;
  for (size_t i = 0; i < kTensors.size(); ++i) {
    Tensor v = value(kTensors[i].first, kTensors[i].second);
    state.emplace_back(kTensors[i].first, distribute_tensor(v, mesh, pl[i]));
  }
  dtensor::save_checkpoint(dir, state, world(), {{"world", std::to_string(world().size())}});
}

void load_and_check(const std::string& dir, const DeviceMesh& mesh) {
  // Placements cycle through shards of both dims and replicas on every axis.
  dtensor::StateDict targets;
  for (size_t i = 0; i < kTensors.size(); ++i) {
    Placements pl;
    for (int64_t a = 0; a < mesh.ndim(); ++a) {
      const int64_t nd = int64_t(kTensors[i].second.size());
      const size_t k = (i + size_t(a)) % 3;
      pl.push_back(k == 2 ? Placement(Replicate()) : Placement(Shard(int64_t(k) % nd)));
    }
    targets.emplace_back(kTensors[i].first, distribute_tensor(zeros(kTensors[i].second), mesh, pl));
  }
  dtensor::load_checkpoint(dir, targets);
  for (size_t i = 0; i < kTensors.size(); ++i)
    expect(test::max_abs_diff(full_tensor(targets[i].second), value(kTensors[i].first, kTensors[i].second)) < 1e-6,
           "loaded " + kTensors[i].first + " " + str(placements_of(targets[i].second)) + " from " + dir);
}

int run(const std::vector<std::string>& args) {
  const std::string mode = args.empty() ? "" : args[0];
  Communicator& w = world();
  const int n = w.size();
  if (mode == "redistribute") {
    int pairs = round_trips(DeviceMesh::one_d(world_ptr(), "x"), {{8, 3}, {5, 3}, {2, 9}}, 1);
    if (n % 2 == 0) {
      DeviceMesh m2(world_ptr(), {2, n / 2}, {"dp", "tp"});
      pairs += round_trips(m2, {{6, 5}, {3, 2}}, 1);
    }
    log_line("ok: ", pairs, " redistribute pairs round-trip on ", n, " ranks");
  } else if (mode == "ckpt-save" && args.size() >= 2) {
    const std::string root = args[1];
    if (w.rank() == 0) {
      fs::remove_all(root);
      fs::create_directories(root);
    }
    w.barrier();
    save(root + "/step-1", DeviceMesh::one_d(world_ptr()));
    log_line("ok: saved ", root, "/step-1 at ", n, " ranks");
  } else if (mode == "ckpt-load" && args.size() >= 3) {
    const std::string dir = dtensor::latest_checkpoint(args[1]);
    expect(!dir.empty(), "a complete checkpoint under " + args[1]);
    if (!dir.empty()) {
      expect(dtensor::read_checkpoint_info(dir).world_size == 4, "the checkpoint was saved at 4 ranks");
      load_and_check(dir, parse_mesh(args[2]));
    }
    log_line("ok: loaded ", dir, " into mesh ", args[2], " at ", n, " ranks");
  } else if (mode == "ckpt-crash" && args.size() >= 2) {
    const std::string root = args[1];
    if (w.rank() == 0) {
      fs::remove_all(root);
      fs::create_directories(root);
    }
    w.barrier();
    DeviceMesh mesh = DeviceMesh::one_d(world_ptr());
    save(root + "/step-1", mesh);
    log_line("saved step-1; rank 1 now dies half-way through step-2");
    dtensor::detail::set_checkpoint_fault_hook([](const std::string& path, int rank) {
      if (rank != 1) return;
      std::ofstream(path) << "the first bytes of a shard file";
      std::raise(SIGKILL);
    });
    save(root + "/step-2", mesh);
    log_line_every_rank("FAILED: the save of step-2 returned although rank 1 was killed");
    return 1;
  } else if (mode == "ckpt-verify-crash" && args.size() >= 2) {
    const std::string root = args[1];
    expect(dtensor::latest_checkpoint(root) == root + "/step-1", "step-1 is the latest complete checkpoint, got '" +
                                                                     dtensor::latest_checkpoint(root) + "'");
    expect(!fs::exists(root + "/step-2/index.json"), "step-2 must not look complete");
    load_and_check(root + "/step-1", DeviceMesh::one_d(world_ptr()));
    log_line("ok: step-1 is the latest complete checkpoint after the crash");
  } else {
    std::fprintf(stderr, "usage: dtensor_mpi redistribute | ckpt-save <root> | ckpt-load <root> <mesh> | "
                         "ckpt-crash <root> | ckpt-verify-crash <root>\n");
    return 2;
  }
  return g_failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  init_from_launcher();
  std::vector<std::string> args(argv + 1, argv + argc);
  int rc = 0;
  try {
    rc = run(args);
  } catch (const std::exception& e) {
    log_line_every_rank("FAILED: ", e.what());
    rc = 1;
  }
  // Any rank's failure fails the job.
  Tensor t = full({1}, double(rc), {.dtype = DType::i32});
  world().all_reduce(t, ReduceOp::max);
  finalize();
  return t.item<int>();
}
