// The collectives suite under mpiexec: every rank runs it on the MPI world communicator, prints
// its failures with "[rank N]", and the exit status is non-zero when any rank failed.
//
//   mpiexec -n 4 collectives_mpi_suite [--large N] [--debug]
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "collectives/launch.h"
#include "collectives/observer.h"
#include "engine/engine.h"
#include "tests/collectives/suite.h"

using namespace quilt;

int main(int argc, char** argv) {
  testing::SuiteConfig cfg;
  bool debug = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--large") == 0 && i + 1 < argc) cfg.sizes.back() = std::atoll(argv[++i]);
    else if (std::strcmp(argv[i], "--debug") == 0) debug = true;
  }
  const LaunchInfo& info = init_from_launcher({.comm = {.debug_checks = debug}});
  Communicator& w = world();
  std::vector<std::string> failures;

  // The launch facts must agree with what mpiexec says (one host: every rank is local).
  const char* env_size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (env_size && std::atoi(env_size) != info.world_size)
    failures.push_back(detail::concat("[rank ", info.rank, "] world size ", info.world_size, " but mpiexec says ", env_size));
  if (info.local_size != info.world_size || info.local_rank != info.rank || info.launcher != "mpirun")
    failures.push_back(detail::concat("[rank ", info.rank, "] launch info: local rank ", info.local_rank, " of ",
                                      info.local_size, ", launcher ", info.launcher));
  if (w.backend() != "mpi" || w.rank() != info.rank || w.size() != info.world_size)
    failures.push_back(detail::concat("[rank ", info.rank, "] world is ", w.backend(), " rank ", w.rank(), " of ", w.size()));

  auto suite = testing::run_collectives_suite(w, cfg);
  failures.insert(failures.end(), suite.begin(), suite.end());

  // A receive that gets fewer elements than it expects fails naming both counts, on the
  // synchronous path (run on the caller's thread) and the asynchronous one (a watched Work). (A
  // send larger than its receive is not tested: Open MPI does not always complete a receive it
  // truncates, so that case ends at the watchdog's timeout.)
  if (w.size() >= 2 && w.rank() < 2) {
    for (bool async : {false, true}) {
      const std::string want = "rank 0 sent 2 elements but the receive expects 3";
      std::string got = "no error";
      const int tag = 11 + int(async);
      try {
        if (w.rank() == 0) {
          w.send(full({2}, 1.0), 1, tag, async).wait();
          got = want;  // the sender sees nothing wrong
        } else {
          w.recv(zeros({3}), 0, tag, async).wait();
        }
      } catch (const Error& e) {
        got = e.what();
      }
      if (got.find(want) == std::string::npos)
        failures.push_back(detail::concat("[rank ", w.rank(), "] ", async ? "async" : "sync",
                                          " recv of 3 from a send of 2: expected an error containing '", want,
                                          "', got: ", got));
    }
  }

  // A synchronous op on contiguous tensors that nothing records runs on the quick path (no call
  // record); anything else on the general one. The two number ops alike and meet each other: here
  // rank 0 reduces a contiguous tensor while the other ranks reduce a transposed view (through a
  // contiguous copy), then an observed all_gather (general on every rank) carries the next number.
  // The same for point-to-point: rank 0 exchanges with rank 1 in one batch (MPI's send-receive)
  // while rank 1 receives into a strided view, then sends, as two single ops.
  if (w.size() >= 2) {
    const uint64_t before = w.last_seq();
    const int n = w.size();
    // The same shape everywhere, (3, 2): contiguous on rank 0, a transposed (2, 3) elsewhere.
    Tensor t = w.rank() == 0 ? full({3, 2}, double(w.rank() + 1)) : full({2, 3}, double(w.rank() + 1)).transpose(0, 1);
    w.all_reduce(t);
    const std::vector<double> got = t.to_vector();
    if (got != std::vector<double>(6, double(n * (n + 1) / 2)))
      failures.push_back(detail::concat("[rank ", w.rank(), "] all_reduce of a ",
                                        w.rank() == 0 ? "contiguous" : "transposed", " tensor gave ", got,
                                        ", expected ", n * (n + 1) / 2, " everywhere"));
    uint64_t observed = 0;
    Tensor gathered = zeros({n, 2});
    {
      ScopedCollectiveObserver obs([&](const CollectiveRecord& r) {
        observed = r.seq;
        return kNoDelay;
      });
      w.all_gather(gathered, full({2}, double(w.rank())));
    }
    std::vector<double> want;
    for (int r = 0; r < n; ++r) want.insert(want.end(), {double(r), double(r)});
    if (gathered.to_vector() != want || observed != before + 2 || w.last_seq() != before + 2)
      failures.push_back(detail::concat("[rank ", w.rank(), "] after a quick or general all_reduce (#", before + 1,
                                        "), the observed all_gather was #", observed, ", last_seq ", w.last_seq(),
                                        " (expected #", before + 2, "), gathered ", gathered.to_vector()));
    if (w.rank() < 2) {
      const int peer = 1 - w.rank();
      Tensor mine = full({4}, double(10 + w.rank())), theirs = zeros({4});
      if (w.rank() == 0) {
        w.batch_p2p({P2POp::send(mine, peer, 3), P2POp::recv(theirs, peer, 3)});
      } else {
        Tensor wide = zeros({4, 2});
        Tensor column = wide.select(1, 1);  // stride 2: received through a staged copy
        w.recv(column, peer, 3);
        w.send(mine, peer, 3);
        theirs = column.contiguous();
      }
      if (theirs.to_vector() != std::vector<double>(4, double(10 + peer)))
        failures.push_back(detail::concat("[rank ", w.rank(), "] the exchange with rank ", peer, " received ",
                                          theirs.to_vector(), ", expected ", 10 + peer, " everywhere"));
    }
  }

  // An asynchronous collective that waits for a late peer does not hold a core while it waits
  // (MPI's nonblocking form, tested with naps in between): rank 0 issues it and sleeps 300 ms
  // outside MPI while the others join only after 300 ms; the process's CPU time over that
  // stretch stays far below the 300 ms a thread polling all along would take. With the MPI
  // thread level below multiple, asynchronous ops run on the caller's thread: nothing to check.
  if (w.size() >= 2 && info.mpi_thread_level == "multiple") {
    auto cpu_ms = [] {
      rusage u{};
      getrusage(RUSAGE_SELF, &u);
      return (double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3) + double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
    };
    const auto late = std::chrono::milliseconds(300);
    Tensor t = full({4}, double(w.rank() + 1));
    const double expect = double(w.size() * (w.size() + 1) / 2);
    if (w.rank() == 0) {
      const double before = cpu_ms();
      Work pending = w.all_reduce(t, ReduceOp::sum, /*async_op=*/true);
      std::this_thread::sleep_for(late);
      const double used = cpu_ms() - before;
      pending.wait();
      if (used > 60.0)
        failures.push_back(detail::concat("[rank 0] an asynchronous all_reduce waiting ", late.count(),
                                          " ms for its peers took ", used, " ms of CPU (expected < 60)"));
    } else {
      std::this_thread::sleep_for(late);
      w.all_reduce(t, ReduceOp::sum, /*async_op=*/true).wait();
    }
    if (t.to_vector() != std::vector<double>(4, expect))
      failures.push_back(detail::concat("[rank ", w.rank(), "] the late asynchronous all_reduce gave ", t.to_vector()[0],
                                        ", expected ", expect));
  }

  for (const std::string& f : failures) std::fprintf(stderr, "%s\n", f.c_str());  // already "[rank N] ..."

  Tensor bad = full({1}, double(failures.size()), {.dtype = DType::i64});
  w.all_reduce(bad);
  const int64_t total = bad.item<int64_t>();
  log_line("collectives suite on ", w.size(), " MPI ranks (thread level ", info.mpi_thread_level,
           debug ? ", debug checks" : "", "): ", total == 0 ? "all passed" : detail::concat(total, " failures"));
  finalize();
  return total == 0 ? 0 : 1;
}
