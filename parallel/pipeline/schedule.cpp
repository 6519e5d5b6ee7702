// Pipeline schedules: generators, lock-step placement and dry run, lowering, validation, CSV.
#include "parallel/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "engine/error.h"

namespace quilt::pipeline {

namespace {

constexpr const char* kCountKey =
    " micro-batches (train.micro_batch_size / distributed.pipeline.pp_microbatch_size)";
constexpr Op kOps[] = {Op::kF, Op::kB, Op::kI, Op::kW, Op::kSendF, Op::kRecvF, Op::kSendB, Op::kRecvB};

bool is_compute(Op op) { return op == Op::kF || op == Op::kB || op == Op::kI || op == Op::kW; }
bool is_backward_input(Op op) { return op == Op::kB || op == Op::kI; }

// Done-times are keyed by what an action makes available: B and I both finish the input gradient.
Action key(Action a) {
  if (a.op == Op::kB) a.op = Op::kI;
  return a;
}

// What `a` needs to have happened first. Without `owner` (compute-only lists) a stage reads its
// neighbour's result directly; with it, a result from another rank arrives through a receive.
std::vector<Action> inputs(const Action& a, int n_stages, const std::vector<int>* owner, int rank) {
  const int s = a.stage, m = a.microbatch;
  auto from = [&](int producer, Op local, Op recv) {
    return !owner || (*owner)[producer] == rank ? Action{producer, local, m} : Action{s, recv, m};
  };
  switch (a.op) {
    case Op::kF: return s > 0 ? std::vector{from(s - 1, Op::kF, Op::kRecvF)} : std::vector<Action>{};
    case Op::kB:
    case Op::kI:
      if (s + 1 < n_stages) return {{s, Op::kF, m}, from(s + 1, Op::kI, Op::kRecvB)};
      return {{s, Op::kF, m}};
    case Op::kW: return {{s, Op::kI, m}};
    case Op::kSendF: return {{s, Op::kF, m}};
    case Op::kSendB: return {{s, Op::kI, m}};
    case Op::kRecvF: return {{s - 1, Op::kSendF, m}};
    case Op::kRecvB: return {{s + 1, Op::kSendB, m}};
  }
  return {};
}

// The receive a compute on `rank` needs before it runs, and the send it owes after.
std::optional<Action> recv_for(const Action& a, const std::vector<int>& owner, int rank) {
  const int n = static_cast<int>(owner.size());
  if (a.op == Op::kF && a.stage > 0 && owner[a.stage - 1] != rank) return Action{a.stage, Op::kRecvF, a.microbatch};
  if (is_backward_input(a.op) && a.stage + 1 < n && owner[a.stage + 1] != rank)
    return Action{a.stage, Op::kRecvB, a.microbatch};
  return std::nullopt;
}
std::optional<Action> send_for(const Action& a, const std::vector<int>& owner, int rank) {
  const int n = static_cast<int>(owner.size());
  if (a.op == Op::kF && a.stage + 1 < n && owner[a.stage + 1] != rank) return Action{a.stage, Op::kSendF, a.microbatch};
  if (is_backward_input(a.op) && a.stage > 0 && owner[a.stage - 1] != rank)
    return Action{a.stage, Op::kSendB, a.microbatch};
  return std::nullopt;
}

struct Lockstep {
  Schedule grid;
  int64_t steps = 0;
  std::vector<StuckRank> stuck;
};

using Ready = std::function<bool(const Action&)>;

// How a rank chooses its action in each lock-step round.
struct Policy {
  virtual ~Policy() = default;
  virtual bool finished(int rank) const = 0;
  /// What `rank` runs this round (nullopt: a bubble), given which actions could run now.
  virtual std::optional<Action> pick(int rank, const Ready& ready) = 0;
  /// The action `rank` is held at when no rank can run anything.
  virtual Action waiting(int rank) const = 0;
};

// Each rank runs its list in order, each action as soon as its inputs are there.
struct FixedOrder : Policy {
  const Lowered& lists;
  std::vector<size_t> next;
  explicit FixedOrder(const Lowered& l) : lists(l), next(l.size(), 0) {}
  bool finished(int r) const override { return next[r] == lists[r].size(); }
  Action waiting(int r) const override { return lists[r][next[r]]; }
  std::optional<Action> pick(int r, const Ready& ready) override {
    if (!ready(lists[r][next[r]])) return std::nullopt;
    return lists[r][next[r]++];
  }
};

// Runs every rank in lock-step: in round t an action may run once all its inputs finished in an
// earlier round. Stops when every rank is finished or a round runs nothing (a deadlock).
Lockstep run_lockstep(Policy& policy, int pp, int n_stages, const std::vector<int>* owner) {
  Lockstep out;
  out.grid.resize(pp);
  std::map<Action, int64_t> done;
  for (int64_t t = 0;; ++t) {
    bool busy = false, progress = false;
    for (int r = 0; r < pp; ++r) {
      if (policy.finished(r)) continue;
      busy = true;
      const std::optional<Action> run = policy.pick(r, [&](const Action& a) {
        for (const Action& in : inputs(a, n_stages, owner, r)) {
          auto it = done.find(in);
          if (it == done.end() || it->second >= t) return false;
        }
        return true;
      });
      out.grid[r].push_back(run);
      if (run) done[key(*run)] = t, progress = true;
    }
    out.steps = t;
    if (!busy) return out;
    if (progress) continue;
    for (int r = 0; r < pp; ++r) {
      if (policy.finished(r)) continue;
      const Action a = policy.waiting(r);
      for (const Action& in : inputs(a, n_stages, owner, r))
        if (!done.count(in)) {
          out.stuck.push_back({r, a, in});
          break;
        }
    }
    return out;
  }
}

// Places a generator's choices on the unit-time grid; a generator never builds a deadlock.
Schedule place(std::string_view name, Policy& policy, int pp, int n_stages) {
  Lockstep run = run_lockstep(policy, pp, n_stages, nullptr);
  QUILT_CHECK(run.stuck.empty(), "[pipeline] ", name, " built an order that cannot run: rank ", run.stuck[0].rank,
              " waits at ", to_string(run.stuck[0].at));
  return run.grid;
}

void check_count(std::string_view name, int pp, int m, bool multiple_of_pp) {
  QUILT_CHECK(pp >= 1, "[pipeline] ", name, " needs pp >= 1, got ", pp);
  if (multiple_of_pp)
    QUILT_CHECK(m >= pp && m % pp == 0, "[pipeline] ", name, " at pp ", pp,
                " needs a micro-batch count that is a multiple of pp (", pp, ", ", 2 * pp, ", ...), got ", m,
                kCountKey);
  QUILT_CHECK(m >= 1, "[pipeline] ", name, " needs at least 1 micro-batch, got ", m, kCountKey);
}

// The k-th forward (or, reversed, backward) of `rank` under loop placement, in rounds of
// `round` micro-batches per local stage: round = pp is depth-first, round = m breadth-first.
Action looped(int k, int rank, int pp, int v, int round, Op op, bool reverse) {
  int local = (k / round) % v;
  if (reverse) local = v - 1 - local;
  return {local * pp + rank, op, (k / (round * v)) * round + k % round};
}

// A rank's order: `warmup` forwards, then one forward and one backward in turn, then the rest.
std::vector<Action> one_f_one_b_order(const std::vector<Action>& fwd, const std::vector<Action>& bwd, int warmup) {
  std::vector<Action> out(fwd.begin(), fwd.begin() + warmup);
  size_t f = warmup, b = 0;
  while (f < fwd.size()) out.push_back(fwd[f++]), out.push_back(bwd[b++]);
  out.insert(out.end(), bwd.begin() + b, bwd.end());
  return out;
}

// Loop-placed schedules: rank r's k-th forward and backward follow `looped`, and rank r warms
// up with warmup(r) forwards (all of them for the breadth-first, all-forwards-first kind).
Schedule looped_schedule(std::string_view name, int pp, int m, int v, int round, int (*warmup)(int r, int pp, int v)) {
  QUILT_CHECK(v >= 1, "[pipeline] ", name, " needs stages_per_rank >= 1, got ", v);
  Lowered orders(pp);
  for (int r = 0; r < pp; ++r) {
    std::vector<Action> fwd, bwd;
    for (int k = 0; k < m * v; ++k) {
      fwd.push_back(looped(k, r, pp, v, round, Op::kF, false));
      bwd.push_back(looped(k, r, pp, v, round, Op::kB, true));
    }
    orders[r] = one_f_one_b_order(fwd, bwd, warmup ? std::min(warmup(r, pp, v), m * v) : m * v);
  }
  FixedOrder policy(orders);
  return place(name, policy, pp, pp * v);
}

// Zero-bubble schedules, built greedily for any placement (`held[r]`: the stages rank r holds).
// Each round a rank runs, of what is ready, the I of its oldest micro-batch (the critical path),
// else its oldest forward while fewer than v*pp forwards await their W (the activations 1f1b's
// first rank holds), else its oldest W; so W runs where a rank would otherwise wait.
struct ZeroBubble : Policy {
  std::vector<std::vector<int>> held;
  int m, cap;
  std::vector<std::vector<int>> next_f, next_i;  // per rank, per held stage: next micro-batch
  std::vector<std::deque<Action>> pending_w;
  std::vector<int> left;  // F, I and W still to run
  ZeroBubble(std::vector<std::vector<int>> stages, int n_microbatches)
      : held(std::move(stages)), m(n_microbatches), cap(static_cast<int>(held.size() * held[0].size())),
        next_f(held.size(), std::vector<int>(held[0].size(), 0)), next_i(next_f), pending_w(held.size()),
        left(held.size(), static_cast<int>(3 * m * held[0].size())) {}
  bool finished(int r) const override { return left[r] == 0; }
  Action waiting(int r) const override { return {held[r][0], Op::kF, next_f[r][0]}; }
  std::optional<Action> pick(int r, const Ready& ready) override {
    auto oldest = [&](Op op, std::vector<int>& next) -> std::optional<Action> {
      int best = -1;
      for (size_t c = 0; c < next.size(); ++c)
        if (next[c] < m && ready({held[r][c], op, next[c]}) && (best < 0 || next[c] < next[best])) best = c;
      if (best < 0) return std::nullopt;
      return Action{held[r][best], op, next[best]++};
    };
    std::optional<Action> run = oldest(Op::kI, next_i[r]);
    if (run) pending_w[r].push_back({run->stage, Op::kW, run->microbatch});
    int in_flight = static_cast<int>(pending_w[r].size());  // forwards whose W has not run
    for (size_t c = 0; c < held[r].size(); ++c) in_flight += next_f[r][c] - next_i[r][c];
    if (!run && in_flight < cap) run = oldest(Op::kF, next_f[r]);
    if (!run && !pending_w[r].empty()) run = pending_w[r].front(), pending_w[r].pop_front();
    if (run) --left[r];
    return run;
  }
};

// <stage><op><micro-batch>, digits around one op name; nullopt for anything else.
std::optional<Action> parse(std::string_view text) {
  auto digits = [](std::string_view s) {
    return static_cast<size_t>(std::find_if(s.begin(), s.end(), [](char c) { return !std::isdigit(c); }) - s.begin());
  };
  const size_t lead = digits(text);
  for (Op op : kOps) {
    const std::string_view name = op_name(op), rest = text.substr(lead);
    if (lead == 0 || !rest.starts_with(name)) continue;
    const std::string_view tail = rest.substr(name.size());
    Action a{0, op, 0};
    if (tail.empty() || digits(tail) != tail.size() ||
        std::from_chars(text.data(), text.data() + lead, a.stage).ec != std::errc() ||
        std::from_chars(tail.data(), tail.data() + tail.size(), a.microbatch).ec != std::errc())
      return std::nullopt;
    return a;
  }
  return std::nullopt;
}

std::string not_an_action(std::string_view text) {
  return detail::concat("'", text, "' is not an action: expected <stage><op><micro-batch>, e.g. 2F0 or 1SEND_B3");
}

std::string trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

// Micro-batches named anywhere in the lists (one more than the largest index).
int microbatches_of(const Lowered& lists) {
  int m = 0;
  for (const auto& list : lists)
    for (const Action& a : list) m = std::max(m, a.microbatch + 1);
  return m;
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kF: return "F";
    case Op::kB: return "B";
    case Op::kI: return "I";
    case Op::kW: return "W";
    case Op::kSendF: return "SEND_F";
    case Op::kRecvF: return "RECV_F";
    case Op::kSendB: return "SEND_B";
    case Op::kRecvB: return "RECV_B";
  }
  return "?";
}

std::string to_string(const Action& a) {
  return std::to_string(a.stage) + op_name(a.op) + std::to_string(a.microbatch);
}

std::ostream& operator<<(std::ostream& os, const Action& a) { return os << to_string(a); }

Action parse_action(std::string_view text) {
  if (std::optional<Action> a = parse(text)) return *a;
  fail("[pipeline] ", not_an_action(text));
}

std::string to_string(const Schedule& s) {
  std::string out;
  for (size_t r = 0; r < s.size(); ++r) {
    out += "rank " + std::to_string(r) + ":";
    for (const auto& slot : s[r]) out += ' ' + (slot ? to_string(*slot) : std::string("."));
    out += "\n";
  }
  return out;
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe",      "1f1b",       "interleaved1f1b", "interleaved_1f1b",
                                                 "looped_bfs", "dfs",        "zero_bubble",     "v_schedule"};
  return names;
}

Schedule make_schedule(std::string_view name, int pp, int n_microbatches, int stages_per_rank) {
  if (name == "gpipe") return gpipe(pp, n_microbatches);
  if (name == "1f1b") return one_f_one_b(pp, n_microbatches);
  if (name == "interleaved1f1b" || name == "interleaved_1f1b")
    return interleaved_1f1b(pp, n_microbatches, stages_per_rank);
  if (name == "dfs") return dfs(pp, n_microbatches, stages_per_rank);
  if (name == "looped_bfs") return looped_bfs(pp, n_microbatches, stages_per_rank);
  if (name == "zero_bubble") return zero_bubble(pp, n_microbatches, stages_per_rank);
  if (name == "v_schedule") return v_schedule(pp, n_microbatches);
  std::string known;
  for (const std::string& n : schedule_names()) known += (known.empty() ? "" : ", ") + n;
  fail("[pipeline] unknown schedule '", name, "' (distributed.pipeline.pp_schedule is one of ", known, ")");
}

Schedule gpipe(int pp, int n_microbatches) {
  check_count("gpipe", pp, n_microbatches, false);
  return looped_schedule("gpipe", pp, n_microbatches, 1, n_microbatches, nullptr);
}

Schedule one_f_one_b(int pp, int n_microbatches) {
  check_count("1f1b", pp, n_microbatches, false);
  return looped_schedule("1f1b", pp, n_microbatches, 1, pp, [](int r, int n, int) { return n - 1 - r; });
}

Schedule interleaved_1f1b(int pp, int n_microbatches, int stages_per_rank) {
  check_count("interleaved1f1b", pp, n_microbatches, true);
  return looped_schedule("interleaved1f1b", pp, n_microbatches, stages_per_rank, pp,
                         [](int r, int n, int v) { return (v - 1) * n + 2 * (n - 1 - r); });
}

Schedule dfs(int pp, int n_microbatches, int stages_per_rank) {
  check_count("dfs", pp, n_microbatches, true);
  return interleaved_1f1b(pp, n_microbatches, stages_per_rank);
}

Schedule looped_bfs(int pp, int n_microbatches, int stages_per_rank) {
  check_count("looped_bfs", pp, n_microbatches, false);
  return looped_schedule("looped_bfs", pp, n_microbatches, stages_per_rank, n_microbatches, nullptr);
}

Schedule zero_bubble(int pp, int n_microbatches, int stages_per_rank) {
  check_count("zero_bubble", pp, n_microbatches, false);
  QUILT_CHECK(stages_per_rank >= 1, "[pipeline] zero_bubble needs stages_per_rank >= 1, got ", stages_per_rank);
  std::vector<std::vector<int>> held(pp);
  for (int r = 0; r < pp; ++r)
    for (int c = 0; c < stages_per_rank; ++c) held[r].push_back(c * pp + r);
  ZeroBubble policy(held, n_microbatches);
  return place("zero_bubble", policy, pp, pp * stages_per_rank);
}

Schedule v_schedule(int pp, int n_microbatches) {
  check_count("v_schedule", pp, n_microbatches, false);
  std::vector<std::vector<int>> held(pp);
  for (int r = 0; r < pp; ++r) held[r] = {r, 2 * pp - 1 - r};  // down the V, then back up
  ZeroBubble policy(held, n_microbatches);
  return place("v_schedule", policy, pp, 2 * pp);
}

Lowered actions_of(const Schedule& s) {
  Lowered out(s.size());
  for (size_t r = 0; r < s.size(); ++r)
    for (const auto& slot : s[r])
      if (slot) out[r].push_back(*slot);
  return out;
}

std::vector<int> stage_ranks(const Lowered& lists) {
  std::map<int, std::pair<int, Action>> seen;  // stage -> first (rank, action) computing it
  for (int r = 0; r < static_cast<int>(lists.size()); ++r)
    for (const Action& a : lists[r]) {
      if (!is_compute(a.op)) continue;
      auto [it, fresh] = seen.try_emplace(a.stage, r, a);
      QUILT_CHECK(fresh || it->second.first == r, "[pipeline] rank ", r, " runs ", to_string(a), " but stage ", a.stage,
                  " belongs to rank ", it->second.first, " (", to_string(it->second.second), ")");
    }
  std::vector<int> owner(seen.empty() ? 0 : seen.rbegin()->first + 1, -1);
  for (const auto& [stage, where] : seen) owner[stage] = where.first;
  for (size_t s = 0; s < owner.size(); ++s)
    QUILT_CHECK(owner[s] >= 0, "[pipeline] stage ", s, " runs on no rank (stages 0..", owner.size() - 1, " are named)");
  return owner;
}

Lowered lower(const Schedule& s) {
  const Lowered compute = actions_of(s);
  const std::vector<int> owner = stage_ranks(compute);
  Lowered out(compute.size());
  for (int r = 0; r < static_cast<int>(compute.size()); ++r)
    for (const Action& a : compute[r]) {
      QUILT_CHECK(is_compute(a.op), "[pipeline] lower: rank ", r, " already has transfer ", to_string(a),
                  "; a schedule to lower holds compute actions only");
      if (auto recv = recv_for(a, owner, r)) out[r].push_back(*recv);
      out[r].push_back(a);
      if (auto send = send_for(a, owner, r)) out[r].push_back(*send);
    }
  return out;
}

void validate(const Lowered& lists) {
  const std::vector<int> owner = stage_ranks(lists);
  const int n_stages = static_cast<int>(owner.size()), m = microbatches_of(lists);
  // Compute first: a repeated compute is the fault to name, not the transfers lowered from it.
  std::vector<std::map<Action, size_t>> pos(lists.size());
  for (bool compute : {true, false})
    for (size_t r = 0; r < lists.size(); ++r)
      for (size_t i = 0; i < lists[r].size(); ++i)
        QUILT_CHECK(is_compute(lists[r][i].op) != compute || pos[r].emplace(lists[r][i], i).second, "[pipeline] rank ",
                    r, " runs ", to_string(lists[r][i]), " twice");
  auto find = [&](int r, Action a) -> std::optional<size_t> {
    auto it = pos[r].find(a);
    return it == pos[r].end() ? std::nullopt : std::optional(it->second);
  };
  auto before = [&](int r, Action first, Action then) {
    QUILT_CHECK(*find(r, first) < *find(r, then), "[pipeline] rank ", r, " runs ", to_string(then), " before ",
                to_string(first));
  };
  std::set<std::pair<int, Action>> needed;  // (rank, transfer) the compute actions call for
  auto transfers = [&](int r, const Action& a) {
    if (auto recv = recv_for(a, owner, r)) {
      QUILT_CHECK(find(r, *recv), "[pipeline] rank ", r, " lacks ", to_string(*recv), " before ", to_string(a),
                  " (rank ", owner[recv->op == Op::kRecvF ? a.stage - 1 : a.stage + 1], " sends it)");
      before(r, *recv, a);
      needed.insert({r, *recv});
    }
    if (auto send = send_for(a, owner, r)) {
      QUILT_CHECK(find(r, *send), "[pipeline] rank ", r, " lacks ", to_string(*send), " after ", to_string(a),
                  " (rank ", owner[send->op == Op::kSendF ? a.stage + 1 : a.stage - 1], " receives it)");
      before(r, a, *send);
      needed.insert({r, *send});
    }
  };
  for (int s = 0; s < n_stages; ++s)
    for (int k = 0; k < m; ++k) {
      const int r = owner[s];
      const Action f{s, Op::kF, k}, b{s, Op::kB, k}, i{s, Op::kI, k}, w{s, Op::kW, k};
      QUILT_CHECK(find(r, f), "[pipeline] rank ", r, " lacks ", to_string(f), " (stage ", s, " never runs micro-batch ",
                  k, " forward)");
      QUILT_CHECK(!(find(r, b) && (find(r, i) || find(r, w))), "[pipeline] rank ", r, " runs ", to_string(b),
                  " and also a split backward ", to_string(find(r, i) ? i : w));
      if (find(r, b)) {
        before(r, f, b);
      } else {
        QUILT_CHECK(find(r, i), "[pipeline] rank ", r, " lacks a backward for ", to_string(f), " (", to_string(b),
                    ", or ", to_string(i), " then ", to_string(w), ")");
        QUILT_CHECK(find(r, w), "[pipeline] rank ", r, " runs ", to_string(i), " but lacks ", to_string(w));
        before(r, f, i);
        before(r, i, w);
      }
      transfers(r, f);
      transfers(r, find(r, b) ? b : i);
    }
  for (size_t r = 0; r < lists.size(); ++r)
    for (const Action& a : lists[r])
      QUILT_CHECK(is_compute(a.op) || needed.count({static_cast<int>(r), a}), "[pipeline] rank ", r, " runs ",
                  to_string(a), ", a transfer no compute calls for (no matching peer or stage on this rank)");
}

std::string SimResult::message() const {
  if (stuck.empty()) return "no deadlock after " + std::to_string(steps) + " steps";
  std::ostringstream out;
  out << "[pipeline] deadlock at step " << steps << ":";
  for (size_t i = 0; i < stuck.size(); ++i)
    out << (i ? "," : "") << " rank " << stuck[i].rank << " waits at " << stuck[i].at << " for " << stuck[i].needs;
  return out.str();
}

SimResult simulate(const Lowered& lists) {
  const std::vector<int> owner = stage_ranks(lists);
  FixedOrder policy(lists);
  const Lockstep run = run_lockstep(policy, static_cast<int>(lists.size()), static_cast<int>(owner.size()), &owner);
  return {run.steps, run.stuck};
}

void check(const Schedule& s) {
  const Lowered lists = lower(s);
  validate(lists);
  const SimResult run = simulate(lists);
  QUILT_CHECK(!run.deadlocked(), run.message());
}

std::string to_csv(const Schedule& s) {
  std::string out;
  for (const auto& row : s) {
    for (size_t t = 0; t < row.size(); ++t) {
      if (t) out += ',';
      if (row[t]) out += to_string(*row[t]);
    }
    out += "\n";
  }
  return out;
}

Schedule from_csv(std::string_view text) {
  Schedule s;
  std::istringstream lines{std::string(text)};
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    auto& row = s.emplace_back();
    std::istringstream cells(line);
    for (std::string cell; std::getline(cells, cell, ',');) {
      const std::string t = trim(cell);
      std::optional<Action> a = parse(t);
      QUILT_CHECK(a || t.empty(), "[pipeline] csv rank ", s.size() - 1, " step ", row.size(), ": ", not_an_action(t));
      row.push_back(a);
    }
  }
  check(s);
  return s;
}

Schedule load_csv(const std::string& path) {
  std::ifstream in(path);
  QUILT_CHECK(in, "[pipeline] cannot read schedule csv '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return from_csv(text.str());
  } catch (const Error& e) {
    fail(e.what(), " (in ", path, ")");
  }
}

void save_csv(const std::string& path, const Schedule& s) {
  std::ofstream out(path);
  out << to_csv(s);
  QUILT_CHECK(out.flush(), "[pipeline] cannot write schedule csv '", path, "'");
}

double bubble_fraction(const Schedule& s, const CostModel& cost) {
  Lowered lists = actions_of(s);
  for (auto& list : lists) std::erase_if(list, [](const Action& a) { return !is_compute(a.op); });
  const int n_stages = static_cast<int>(stage_ranks(lists).size());
  auto units = [&](Op op) { return op == Op::kF ? cost.f : op == Op::kB ? cost.b : op == Op::kI ? cost.i : cost.w; };
  // Event order does not matter: each rank runs its list in order, each action at
  // max(rank free, inputs finished), so sweeping the ranks until nothing moves is exact.
  std::map<Action, double> finish;
  std::vector<double> free_at(lists.size(), 0);
  std::vector<size_t> next(lists.size(), 0);
  double busy = 0, makespan = 0;
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t r = 0; r < lists.size(); ++r)
      for (; next[r] < lists[r].size(); ++next[r]) {
        const Action& a = lists[r][next[r]];
        double start = free_at[r];
        bool ready = true;
        for (const Action& in : inputs(a, n_stages, nullptr, 0)) {
          auto it = finish.find(in);
          if (it == finish.end()) ready = false;
          else start = std::max(start, it->second);
        }
        if (!ready) break;
        free_at[r] = finish[key(a)] = start + units(a.op);
        busy += units(a.op);
        makespan = std::max(makespan, free_at[r]);
        moved = true;
      }
  }
  for (size_t r = 0; r < lists.size(); ++r)
    QUILT_CHECK(next[r] == lists[r].size(), "[pipeline] bubble_fraction: rank ", r, " can never run ",
                to_string(lists[r][next[r]]));
  return makespan > 0 ? 1 - busy / (static_cast<double>(lists.size()) * makespan) : 0;
}

}  // namespace quilt::pipeline
