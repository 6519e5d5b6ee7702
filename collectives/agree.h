// Fail together: a step that can fail on some ranks only (file-system work on rank 0, reading
// a checkpoint shard, opening data) is followed by agreement, so the job either continues on
// every rank or stops on every rank with the failing ranks' errors.
//
//   agree(*r.world, "checkpoint save", [&] { if (rank == 0) fs::create_directories(root); });
//   // every rank gets here, or every rank throws AgreedError("checkpoint save failed on rank 0: ...")
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "engine/error.h"

namespace quilt {

/// An error every rank of a communicator raised together (see agree): each rank holds the same
/// message, so one rank printing it is enough: the reporter (rank 0 of that communicator).
class AgreedError : public Error {
 public:
  AgreedError(const std::string& message, bool reporter) : Error(message), reporter_(reporter) {}
  bool reporter() const { return reporter_; }

 private:
  bool reporter_;
};

/// Runs `step` on this rank, then every rank of `comm` learns whether it threw anywhere. When
/// it did, every rank throws the same AgreedError: "<what> failed on rank 2: <its message>", or
/// "<what> failed on ranks 1, 3:" and each failing rank's message on its own line. Collective
/// over `comm` (one small all-reduce when nothing failed). An AgreedError thrown by `step`
/// itself (a nested agreement) is passed on as it is.
void agree(Communicator& comm, const std::string& what, const std::function<void()>& step);

/// Every rank's `text`, in rank order (collective over `comm`; two small collectives).
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text);

}  // namespace quilt
