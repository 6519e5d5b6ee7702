// Builds without MPI (QUILT_MPI=OFF) link this: a launcher-started run is refused with a clear
// error; programs started without a launcher run as one rank, and the threads backend works.
#include "collectives/internal.h"
#include <cstdlib>

#include "engine/error.h"

namespace quilt::detail {

MpiWorld mpi_init_world(const CommOptions&, const std::string& launcher) {
  fail("[mpi] this build has no MPI support (configured with QUILT_MPI=OFF), but the process was started by ",
       launcher, "; rebuild with MPI (libopenmpi-dev) or run without a launcher as one rank");
}

void mpi_finalize_world() {}
bool mpi_announce_failure(const std::string&, bool) { return false; }
void mpi_abort_world(int code) { std::_Exit(code); }

}  // namespace quilt::detail
