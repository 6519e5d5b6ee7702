// Misbehaving ranks for the fault tests (run under mpiexec by expect_fail.sh): the last rank
// skips a collective, is killed, stops itself, (in debug mode) passes a different shape, or
// throws an error the others do not share (ending through exit_on_error, as `quilt` does); or
// rank 0 waits, synchronously, for a message the last rank never sends (unmatched_recv).
// Every healthy run would finish at once; each fault must end the whole job non-zero, in
// bounded time, with a message naming the op or the error and the guilty rank.
//
//   mpiexec -n 3 collectives_fault skip|sigkill|sigstop|mismatch|throw|unmatched_recv
#include <chrono>
#include <csignal>
#include <cstring>
#include <string>
#include <thread>

#include "collectives/launch.h"
#include "engine/engine.h"

using namespace quilt;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "skip" && mode != "sigkill" && mode != "sigstop" && mode != "mismatch" && mode != "throw" &&
      mode != "unmatched_recv") {
    std::fprintf(stderr, "usage: collectives_fault skip|sigkill|sigstop|mismatch|throw|unmatched_recv\n");
    return 2;
  }
  init_from_launcher({.comm = {.debug_checks = mode == "mismatch"}});
  Communicator& w = world();
  const int victim = w.size() - 1;
  try {
    for (int i = 1; i <= 5; ++i) {
      Tensor t = full({w.rank() == victim && mode == "mismatch" && i == 3 ? 5 : 4}, 1.0);
      if (w.rank() == victim && i == 3) {
        if (mode == "skip") continue;
        if (mode == "sigkill") std::raise(SIGKILL);
        if (mode == "sigstop") std::raise(SIGSTOP);
        if (mode == "throw") {
          try {
            fail("[fault] rank ", w.rank(), " cannot go on (an error only this rank sees)");
          } catch (const Error& e) {
            exit_on_error(e);  // the others wait in all_reduce #3 for this rank
          }
        }
      }
      if (mode == "unmatched_recv" && i == 3) {
        // The others hold back past the timeout, so that rank 0's watchdog is the one that fires.
        if (w.rank() == 0) w.recv(zeros({3}), victim, /*tag=*/5);
        else std::this_thread::sleep_for(std::chrono::seconds(8));
      }
      w.all_reduce(t);
    }
  } catch (const Error& e) {
    log_line_every_rank("caught: ", e.what());
    finalize();
    return 4;
  }
  log_line_every_rank("finished all collectives");
  finalize();
  return 0;
}
