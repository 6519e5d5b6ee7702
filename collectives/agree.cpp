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
  Tensor any = from_vector({failed ? 1.0 : 0.0}, {1}, {.dtype = DType::i64});
  comm.all_reduce(any, ReduceOp::max);
  if (any.data<int64_t>()[0] == 0) return;
  // Someone failed: every rank's message ("" where the step succeeded).
  const std::vector<std::string> texts = all_gather_text(comm, failed ? "!" + error : std::string());
  // Ranks with the same message share a line: "ranks 0-3: ...".
  std::vector<std::pair<std::string, std::vector<int>>> errors;
  for (int r = 0; r < comm.size(); ++r) {
    if (texts[size_t(r)].empty()) continue;
    const std::string text = texts[size_t(r)].substr(1);
    auto same = std::find_if(errors.begin(), errors.end(), [&](const auto& e) { return e.first == text; });
    if (same == errors.end()) errors.push_back({text, {r}});
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

std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text) {
  if (comm.size() == 1) return {text};
  Tensor longest = from_vector({double(text.size())}, {1}, {.dtype = DType::i64});
  comm.all_reduce(longest, ReduceOp::max);
  // Each text padded to the longest, one byte per i32, after its length.
  const int64_t width = longest.data<int64_t>()[0] + 1;
  Tensor mine = zeros({width}, {.dtype = DType::i32});
  int32_t* m = mine.data<int32_t>();
  m[0] = int32_t(text.size());
  for (size_t i = 0; i < text.size(); ++i) m[i + 1] = static_cast<unsigned char>(text[i]);
  Tensor all = zeros({int64_t(comm.size()) * width}, {.dtype = DType::i32});
  comm.all_gather(all, mine);
  std::vector<std::string> out;
  const int32_t* a = all.data<int32_t>();
  for (int r = 0; r < comm.size(); ++r) {
    const int32_t* row = a + int64_t(r) * width;
    std::string t(size_t(row[0]), '\0');
    for (int32_t i = 0; i < row[0]; ++i) t[size_t(i)] = char(row[i + 1]);
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace quilt
