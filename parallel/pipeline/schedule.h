// Pipeline schedules as replayable action lists: for each pipeline rank, the order in which it
// runs forwards and backwards of its stages on each micro-batch. Generators build the standard
// schedules, `lower` adds the sends and receives between ranks, `validate` and `simulate` prove a
// list complete and deadlock-free, and CSV files make a custom schedule a file. No tensors here:
// the runtime walks a rank's lowered list.
//
//   Schedule s = make_schedule("1f1b", /*pp=*/2, /*n_microbatches=*/4);
//   to_string(s);                            // "rank 0: 0F0 0F1 . 0B0 0F2 0B1 0F3 0B2 . 0B3\n..."
//   Lowered low = lower(s);                  // rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 ...
//   validate(low);                           // throws naming the rank and action when incomplete
//   simulate(low).deadlocked();              // false: every receive meets its send
//   for (const Action& a : low[rank]) run(a);  // the runtime's loop
//   stage_ranks(low)[a.stage + 1];           // the peer of a SEND_F (a SEND_B's is a.stage - 1)
//   bubble_fraction(s);                      // 0.2 = (pp-1)/(m+pp-1) for 1f1b
//
// Actions print as <stage><op><micro-batch>: "2F0" is stage 2's forward of micro-batch 0,
// "1SEND_B3" stage 1 sending the gradient of its input for micro-batch 3 to stage 0. A receive
// names the stage that consumes it ("2RECV_F0" is stage 2 receiving micro-batch 0 from stage 1).
//
// Schedules (pp ranks, v = stages_per_rank, m micro-batches) and the counts they accept:
//   gpipe            m >= 1. One stage per rank; all forwards, then all backwards.
//   1f1b             m >= 1. One stage per rank; rank r warms up with pp-1-r forwards, then
//                    alternates one forward and one backward.
//   interleaved1f1b  m a multiple of pp (the rounds below). Alias interleaved_1f1b. v stages
//                    per rank, loop placement (stage s on rank s mod pp); forwards go in
//                    rounds of pp micro-batches per stage (Megatron-LM's order), rank r warms
//                    up with (v-1)*pp + 2*(pp-1-r) forwards.
//   dfs              m a multiple of pp. The depth-first order of the breadth-first pipeline
//                    paper (arXiv 2211.05953) is the interleaved 1F1B order, so dfs returns
//                    exactly the lists of interleaved1f1b (a test asserts it).
//   looped_bfs       m >= 1. v stages per rank, loop placement; a rank runs every micro-batch
//                    of its lower stage before its next one (breadth-first), all forwards
//                    before the backwards, which go from its highest stage down.
//   zero_bubble      m >= 1. Interleaved zero bubble: v stages per rank, loop placement, the
//                    backward split into I (input gradient, on the critical path) and W
//                    (weight gradient, free to wait). Built greedily: each step a rank runs
//                    the I of its oldest ready micro-batch, else its oldest ready forward
//                    while fewer than v*pp forwards await their W (the activations 1f1b's
//                    first rank holds), else a W, so W actions fill what would be bubbles.
//   v_schedule       m >= 1. Zero-bubble V: rank r holds stages r and 2*pp-1-r, so the first
//                    and last stage share rank 0 and the turn of the V needs no transfer;
//                    built by the same greedy rule (cap 2*pp forwards).
// The micro-batch count is train.micro_batch_size / distributed.pipeline.pp_microbatch_size;
// a count that breaks a rule is refused naming the schedule, pp and the count.
//
// Time model: a Schedule is a grid of unit time steps (every action one step), placed as early
// as its dependencies allow, so its empty slots show where a rank waits. `bubble_fraction`
// re-times each rank's order with a CostModel (default F=1, B=2, I=1, W=1) to predict the idle
// share of a step. Sends are asynchronous (posted and waited on at the end of the step), so a
// rank never blocks on a send; a receive blocks until its send has run.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace quilt::pipeline {

/// What an action does: compute (F, B = full backward, I = input-gradient backward,
/// W = weight-gradient backward) or a point-to-point transfer.
enum class Op : uint8_t { kF, kB, kI, kW, kSendF, kRecvF, kSendB, kRecvB };

/// One step of a rank's list: `op` on stage `stage` for micro-batch `microbatch`.
struct Action {
  int stage = 0;
  Op op = Op::kF;
  int microbatch = 0;
  auto operator<=>(const Action&) const = default;
};

/// A compute-only schedule: for each rank, one slot per time step; an empty slot is a bubble.
using Schedule = std::vector<std::vector<std::optional<Action>>>;
/// A lowered schedule: for each rank, its actions (transfers included) in the order it runs them.
using Lowered = std::vector<std::vector<Action>>;

/// "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B" or "RECV_B".
const char* op_name(Op op);
/// "2F0", "1SEND_B3".
std::string to_string(const Action& a);
/// Parses "2F0" back; throws naming the text when it is not <stage><op><micro-batch>.
Action parse_action(std::string_view text);
/// One line per rank, actions separated by spaces, "." for a bubble.
std::string to_string(const Schedule& s);
std::ostream& operator<<(std::ostream& os, const Action& a);

/// Names make_schedule accepts (the schedules of parallel_dims' pipeline_schedule_names()).
const std::vector<std::string>& schedule_names();
/// Builds schedule `name` for pp ranks and m micro-batches; stages_per_rank is used by the
/// interleaved schedules (looped_bfs, interleaved1f1b, dfs, zero_bubble). Throws on a bad count.
Schedule make_schedule(std::string_view name, int pp, int n_microbatches, int stages_per_rank = 2);

Schedule gpipe(int pp, int n_microbatches);
Schedule one_f_one_b(int pp, int n_microbatches);
Schedule interleaved_1f1b(int pp, int n_microbatches, int stages_per_rank = 2);
/// Identical to interleaved_1f1b: the interleaved order is the depth-first order.
Schedule dfs(int pp, int n_microbatches, int stages_per_rank = 2);
Schedule looped_bfs(int pp, int n_microbatches, int stages_per_rank = 2);
Schedule zero_bubble(int pp, int n_microbatches, int stages_per_rank = 2);
Schedule v_schedule(int pp, int n_microbatches);

/// Stage -> rank, read from where the stages' compute actions are; throws if a stage is on two ranks.
std::vector<int> stage_ranks(const Lowered& lists);
/// Each rank's actions without bubbles (the compute-only lists, before lowering).
Lowered actions_of(const Schedule& s);
/// Inserts a receive before each compute that needs a tensor from another rank and a send after
/// each compute whose result another rank needs; stages on one rank pass tensors directly.
Lowered lower(const Schedule& s);
/// Checks that every stage runs F once and its backward once (B, or I then W) per micro-batch,
/// forward first, and that every send has its receive; throws naming the rank and action.
void validate(const Lowered& lists);

/// A rank a dry run left waiting: at its next action, for an action that never ran.
struct StuckRank {
  int rank = 0;
  Action at, needs;
};
/// What a dry run of lowered lists found.
struct SimResult {
  int64_t steps = 0;              // lock-step rounds until every list finished or all are stuck
  std::vector<StuckRank> stuck;   // empty: no deadlock
  bool deadlocked() const { return !stuck.empty(); }
  /// "[pipeline] deadlock at step 3: rank 0 waits at 0RECV_B1 for 1SEND_B1, rank 1 waits at ..."
  std::string message() const;
};
/// Runs the lists in lock-step: each round every rank runs its next action if it can (a receive
/// once its send ran in an earlier round, a compute once its inputs are here).
SimResult simulate(const Lowered& lists);

/// lower + validate + simulate; throws naming the rank and action of the first problem.
void check(const Schedule& s);

/// One row per rank, one cell per time step, an empty cell for a bubble. CSV files hold
/// compute-only schedules: loading lowers them, so the transfers always match the compute.
std::string to_csv(const Schedule& s);
/// Parses CSV text and checks the schedule; throws naming the rank, step and action at fault.
Schedule from_csv(std::string_view text);
/// from_csv on a file's contents; throws naming the path when it cannot be read.
Schedule load_csv(const std::string& path);
/// Writes to_csv(s) to path; throws naming the path when it cannot be written.
void save_csv(const std::string& path, const Schedule& s);

/// Time units per action for bubble_fraction (transfers cost nothing here).
struct CostModel {
  double f = 1, b = 2, i = 1, w = 1;
};
/// Idle share of the step when each rank runs its order as early as dependencies allow:
/// 1 - busy / (pp * makespan). 1f1b gives (pp-1)/(m+pp-1) whenever B is a multiple of F.
double bubble_fraction(const Schedule& s, const CostModel& cost = {});

}  // namespace quilt::pipeline
