// Builds without CUDA link this: NCCL reports unavailable and its factory says so.
#include "collectives/communicator.h"

namespace quilt {

bool nccl_available() { return false; }

std::shared_ptr<Communicator> make_nccl_communicator(Communicator&, Device device, const CommOptions&) {
  fail("[nccl] this build has no NCCL support (configured with QUILT_CUDA=OFF); cannot create a communicator on ",
       device.str());
}

}  // namespace quilt
