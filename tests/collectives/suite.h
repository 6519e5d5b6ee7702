// The collectives correctness suite, shared by every backend: the threads doctest, the MPI
// program run under mpiexec (mpi_suite.cpp) and the NCCL doctest on a GPU. Every collective x
// dtype x size (0, 1, odd, uneven splits, large) is checked element by element against values
// computed here; small integer patterns keep every expected sum exact in every dtype.
//
//   auto failures = quilt::testing::run_collectives_suite(comm, {});
//   CHECK(failures.empty());
#pragma once

#include <string>
#include <vector>

#include "collectives/communicator.h"

namespace quilt::testing {

struct SuiteConfig {
  std::vector<int64_t> sizes = {0, 1, 7, 300, 65537};  // elements (rows for the v forms)
  std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64, DType::b8};
  bool p2p = true;        // send/recv, batch_p2p
  bool subgroups = true;  // split and collectives on the parts
  bool async = true;      // several async ops in flight
};

/// Runs the suite on `comm` (collective: every rank calls it); returns this rank's failures,
/// each naming the op, dtype, size and the first wrong element.
std::vector<std::string> run_collectives_suite(Communicator& comm, const SuiteConfig& cfg);

}  // namespace quilt::testing
