// Fail together: see agree.h.
#include "collectives/agree.h"

#include <algorithm>

#include "engine/ops/creation.h"

namespace quilt {
namespace {

// The longest message a rank contributes; longer ones are cut (the start names the thing).
constexpr size_t kMaxMessage = 4000;

// "rank 2", "ranks 0-3, 6" (ascending ranks).
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) {
      out += '-';
      out += std::to_string(ranks[j]);
    }
    i = j + 1;
  }
  return out;
}

}  // namespace

void agree(Communicator& comm, const std::string& what, const std::function<void()>& step) {
  std::string error;
  bool failed = false;
  try {
    step();
  } catch (const AgreedError&) {
    throw;  // every rank already holds it
  } catch (const std::exception& e) {
    failed = true;
    error = e.what();
  }
  if (comm.size() == 1) {
    if (failed) throw AgreedError(what + " failed: " + error, true);
    return;
  }
  if (error.size() > kMaxMessage) error = error.substr(0, kMaxMessage) + " [...]";
  Tensor longest = from_vector({failed ? double(error.size() + 1) : 0.0}, {1}, {.dtype = DType::i64});
  comm.all_reduce(longest, ReduceOp::max);
  const int64_t width = longest.data<int64_t>()[0];
  if (width == 0) return;

  // Someone failed: gather every rank's message (empty where the step succeeded), padded to
  // the longest, as one character per i32.
  Tensor mine = zeros({width}, {.dtype = DType::i32});
  int32_t* m = mine.data<int32_t>();
  if (failed) {
    m[0] = 1;
    for (size_t i = 0; i < error.size(); ++i) m[i + 1] = static_cast<unsigned char>(error[i]);
  }
  Tensor all = zeros({int64_t(comm.size()) * width}, {.dtype = DType::i32});
  comm.all_gather(all, mine);
  // Ranks with the same message share a line: "ranks 0-3: ...".
  const int32_t* a = all.data<int32_t>();
  std::vector<std::pair<std::string, std::vector<int>>> errors;
  for (int r = 0; r < comm.size(); ++r) {
    const int32_t* row = a + int64_t(r) * width;
    if (!row[0]) continue;
    std::string text;
    for (int64_t i = 1; i < width && row[i]; ++i) text += char(row[i]);
    auto same = std::find_if(errors.begin(), errors.end(), [&](const auto& e) { return e.first == text; });
    if (same == errors.end()) errors.push_back({std::move(text), {r}});
    else same->second.push_back(r);
  }
  std::string msg = what + " failed on ";
  if (errors.size() == 1) {
    msg += rank_list(errors[0].second) + ": " + errors[0].first;
  } else {
    std::vector<int> failed_ranks;
    for (const auto& e : errors) failed_ranks.insert(failed_ranks.end(), e.second.begin(), e.second.end());
    std::sort(failed_ranks.begin(), failed_ranks.end());
    msg += rank_list(failed_ranks) + ":";
    for (const auto& [text, ranks] : errors) msg += "\n  " + rank_list(ranks) + ": " + text;
  }
  throw AgreedError(msg, comm.rank() == 0);
}

}  // namespace quilt
