// Pipeline schedules: hand-derived grids, every generator validated and dry-run after lowering,
// CSV and text round trips, the errors a broken schedule or a bad micro-batch count raise; the
// stage split and its cost weights.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "engine/error.h"
#include "parallel/parallel_dims.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/split.h"

using namespace quilt;
using namespace quilt::pipeline;

namespace {

// A rank's lowered list as one line: "0F0 0SEND_F0 ...".
std::string line(const std::vector<Action>& list) {
  std::string out;
  for (const Action& a : list) {
    if (!out.empty()) out += ' ';
    out += to_string(a);
  }
  return out;
}

// Micro-batch counts each schedule accepts at pp: multiples of pp, and odd ones where allowed.
std::vector<int> counts(const std::string& name, int pp) {
  const bool multiple = name == "interleaved1f1b" || name == "interleaved_1f1b" || name == "dfs";
  if (multiple) return {pp, 2 * pp, 3 * pp, 4 * pp};
  return {1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp + 1, 4 * pp};
}

}  // namespace

TEST_CASE("pipeline schedule: actions print as 2F0 and 1SEND_B3 and parse back") {
  CHECK(to_string(Action{2, Op::kF, 0}) == "2F0");
  CHECK(to_string(Action{1, Op::kSendB, 3}) == "1SEND_B3");
  for (Op op : {Op::kF, Op::kB, Op::kI, Op::kW, Op::kSendF, Op::kRecvF, Op::kSendB, Op::kRecvB}) {
    const Action a{12, op, 7};
    CHECK(parse_action(to_string(a)) == a);
  }
  for (const char* bad : {"", "F0", "2X0", "2F", "2F0x", "2SEND0", "-1F0"})
    CHECK_THROWS_WITH_AS(parse_action(bad), doctest::Contains("is not an action: expected <stage><op><micro-batch>"),
                         Error);
}

TEST_CASE("pipeline schedule: gpipe at pp 2 with 4 micro-batches is the hand-derived grid") {
  // Rank 1 starts a step late; rank 0's first backward waits for rank 1's (step 5) to arrive.
  CHECK(to_string(gpipe(2, 4)) ==
        "rank 0: 0F0 0F1 0F2 0F3 . . 0B0 0B1 0B2 0B3\n"
        "rank 1: . 1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3\n");
}

TEST_CASE("pipeline schedule: 1f1b at pp 2 with 4 micro-batches is the hand-derived grid and lowering") {
  const Schedule s = one_f_one_b(2, 4);
  // Rank 0 warms up with pp-1-r = 1 forward, rank 1 with none; then one forward, one backward.
  CHECK(to_string(s) ==
        "rank 0: 0F0 0F1 . 0B0 0F2 0B1 0F3 0B2 . 0B3\n"
        "rank 1: . 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3\n");
  const Lowered low = lower(s);
  CHECK(line(low[0]) ==
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0F3 0SEND_F3 0RECV_B2 0B2 0RECV_B3 0B3");
  CHECK(line(low[1]) ==
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 1RECV_F3 1F3 1B3 1SEND_B3");
}

TEST_CASE("pipeline schedule: looped_bfs finishes a stage before the next, interleaved1f1b goes depth first") {
  // Loop placement at pp 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
  CHECK(to_string(looped_bfs(2, 2)) ==
        "rank 0: 0F0 0F1 2F0 2F1 . . 2B0 2B1 0B0 0B1\n"
        "rank 1: . 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1\n");
  // Rounds of pp = 2 micro-batches per stage; rank 0 warms up with (v-1)*pp + 2*(pp-1) = 4.
  const Lowered order = actions_of(interleaved_1f1b(2, 4));
  CHECK(line(order[0]) == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3");
  CHECK(line(order[1]) == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3");
}

TEST_CASE("pipeline schedule: every generator at pp 2 and 4 validates after lowering and runs without deadlock") {
  for (const std::string& name : schedule_names())
    for (int pp : {2, 4})
      for (int m : counts(name, pp))
        for (int v : {2, 3}) {
          CAPTURE(name);
          CAPTURE(pp);
          CAPTURE(m);
          CAPTURE(v);
          const Schedule s = make_schedule(name, pp, m, v);
          REQUIRE(s.size() == static_cast<size_t>(pp));
          const Lowered low = lower(s);
          CHECK_NOTHROW(validate(low));
          const SimResult run = simulate(low);
          CHECK_MESSAGE(!run.deadlocked(), run.message());
          CHECK_NOTHROW(check(s));
          // Placement: one stage per rank, V (r and 2pp-1-r), or loop (s on rank s mod pp).
          const std::vector<int> owner = stage_ranks(low);
          const bool single = name == "gpipe" || name == "1f1b";
          CHECK(owner.size() == static_cast<size_t>(single ? pp : name == "v_schedule" ? 2 * pp : v * pp));
          for (int st = 0; st < static_cast<int>(owner.size()); ++st)
            CHECK(owner[st] == (name == "v_schedule" && st >= pp ? 2 * pp - 1 - st : st % pp));
        }
}

TEST_CASE("pipeline schedule: stages on one rank pass tensors directly, so lowering adds no transfer between them") {
  const Lowered low = lower(v_schedule(2, 4));
  // Rank 1 holds stages 1 and 2, the turn of the V; rank 0 holds 0 and 3.
  for (const Action& a : low[1]) {
    CHECK(a != Action{1, Op::kSendF, a.microbatch});
    CHECK(a != Action{2, Op::kRecvF, a.microbatch});
    CHECK(a != Action{2, Op::kSendB, a.microbatch});
    CHECK(a != Action{1, Op::kRecvB, a.microbatch});
  }
  CHECK(line(low[0]).starts_with("0F0 0SEND_F0"));
}

TEST_CASE("pipeline schedule: dfs is the interleaved 1f1b order, list for list") {
  for (int pp : {2, 4})
    for (int m : {pp, 2 * pp, 4 * pp}) {
      CHECK(dfs(pp, m) == interleaved_1f1b(pp, m));
      CHECK(make_schedule("interleaved_1f1b", pp, m, 3) == make_schedule("dfs", pp, m, 3));
    }
}

TEST_CASE("pipeline schedule: CSV text round-trips every schedule identically") {
  for (const std::string& name : schedule_names())
    for (int pp : {2, 4}) {
      const Schedule s = make_schedule(name, pp, 2 * pp);
      const std::string csv = to_csv(s);
      CHECK(from_csv(csv) == s);
      CHECK(to_csv(from_csv(csv)) == csv);
    }
  CHECK(to_csv(gpipe(2, 2)) == "0F0,0F1,,,0B0,0B1\n,1F0,1F1,1B0,1B1\n");
  CHECK(from_csv("0F0, 0F1 ,,,0B0,0B1\r\n,1F0,1F1,1B0,1B1\r\n") == gpipe(2, 2));

  const std::string path = "pipeline_schedule_test.csv";
  save_csv(path, zero_bubble(2, 4));
  CHECK(load_csv(path) == zero_bubble(2, 4));
  std::remove(path.c_str());
  CHECK_THROWS_WITH_AS(load_csv("no/such/schedule.csv"), doctest::Contains("cannot read schedule csv 'no/such"), Error);
}

TEST_CASE("pipeline schedule: a hand-broken CSV is rejected naming the rank and action") {
  REQUIRE_NOTHROW(from_csv("0F0,0F1,,,0B0,0B1\n,1F0,1F1,1B0,1B1\n"));  // gpipe(2, 2), which each case breaks
  struct Case {
    const char* csv;
    const char* error;
  };
  const Case cases[] = {
      {"0F0,0F1,,,0B0,0B1\n,1F0,1Q1,1B0,1B1\n", "csv rank 1 step 2: '1Q1' is not an action"},
      {"0F0,0F1,,,0B0,0B1\n,1F0,1F1,1B0\n", "rank 1 lacks a backward for 1F1 (1B1, or 1I1 then 1W1)"},
      {"0F0,,,,0B0,0B1\n,1F0,1F1,1B0,1B1\n", "rank 0 lacks 0F1"},
      {"0F0,0F1,,,0B0,0B1\n,1F0,1F1,1B0,1B1,1F1\n", "rank 1 runs 1F1 twice"},
      {"0F0,0F1,,,0B0,0B1\n,1F0,1B1,1F1,1B0\n", "rank 1 runs 1B1 before 1F1"},
      {"0F0,0F1,,,0B0,0B1,1F1\n,1F0,1B0,1B1\n", "rank 1 runs 1F0 but stage 1 belongs to rank 0 (1F1)"},
      {"0F0,0F1,0I0,0W1,0I1,0W0\n1F0,1F1,1I0,1I1,1W0,1W1\n", "rank 0 runs 0W1 before 0I1"},
      {"0F0,0F1,,,0B0,0B1\n,1F0,1F1,1I0,1W0,1B1,1W1\n", "rank 1 runs 1B1 and also a split backward 1W1"},
      {"0F0,0F1,,,0B0,0B1\n,1F0,1F1,1I0,1W0,1I1\n", "rank 1 runs 1I1 but lacks 1W1"},
      // Complete and ordered per rank, but each waits on the other: rank 0's first backward
      // needs rank 1's, which comes after a forward that needs rank 0's second forward.
      {"0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n",
       "deadlock at step 4: rank 0 waits at 0RECV_B0 for 1SEND_B0, rank 1 waits at 1RECV_F1 for 0SEND_F1"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.csv);
    CHECK_THROWS_WITH_AS(from_csv(c.csv), doctest::Contains(c.error), Error);
  }
}

TEST_CASE("pipeline schedule: lowered lists with a missing, misplaced or stray transfer are caught") {
  Lowered low = lower(one_f_one_b(2, 4));
  Lowered missing = low;
  std::erase(missing[0], Action{0, Op::kSendF, 1});
  CHECK_THROWS_WITH_AS(validate(missing), doctest::Contains("rank 0 lacks 0SEND_F1 after 0F1 (rank 1 receives it)"),
                       Error);
  Lowered missing_recv = low;
  std::erase(missing_recv[0], Action{0, Op::kRecvB, 2});
  CHECK_THROWS_WITH_AS(validate(missing_recv), doctest::Contains("rank 0 lacks 0RECV_B2 before 0B2 (rank 1 sends it)"),
                       Error);
  Lowered stray = low;
  stray[1].push_back({1, Op::kSendF, 0});
  CHECK_THROWS_WITH_AS(validate(stray), doctest::Contains("rank 1 runs 1SEND_F0, a transfer no compute calls for"),
                       Error);
  // Valid list for list, but rank 0 holds its first send back until it has the first gradient.
  Lowered late = low;
  std::erase(late[0], Action{0, Op::kSendF, 0});
  late[0].insert(late[0].begin() + 4, Action{0, Op::kSendF, 0});
  CHECK(line(late[0]).starts_with("0F0 0F1 0SEND_F1 0RECV_B0 0SEND_F0"));
  CHECK_NOTHROW(validate(late));
  const SimResult run = simulate(late);
  REQUIRE(run.deadlocked());
  CHECK(run.message() ==
        "[pipeline] deadlock at step 3: rank 0 waits at 0RECV_B0 for 1SEND_B0, rank 1 waits at 1RECV_F0 for 0SEND_F0");
}

TEST_CASE("pipeline schedule: a micro-batch count below a schedule's rule is refused naming the numbers and key") {
  CHECK_THROWS_WITH_AS(interleaved_1f1b(4, 6),
                       doctest::Contains("interleaved1f1b at pp 4 needs a micro-batch count that is a multiple of pp "
                                         "(4, 8, ...), got 6 micro-batches (train.micro_batch_size / "
                                         "distributed.pipeline.pp_microbatch_size)"),
                       Error);
  CHECK_THROWS_WITH_AS(make_schedule("zero_bubble", 4, 0), doctest::Contains("zero_bubble needs at least 1"), Error);
  CHECK_THROWS_WITH_AS(v_schedule(2, -1), doctest::Contains("v_schedule needs at least 1 micro-batch, got -1"), Error);
  CHECK_THROWS_WITH_AS(make_schedule("dfs", 2, 3), doctest::Contains("dfs at pp 2 needs"), Error);
  CHECK_THROWS_WITH_AS(gpipe(2, 0), doctest::Contains("gpipe needs at least 1 micro-batch, got 0 micro-batches"),
                       Error);
  CHECK_THROWS_WITH_AS(make_schedule("zigzag", 2, 4),
                       doctest::Contains("unknown schedule 'zigzag' (distributed.pipeline.pp_schedule is one of gpipe"),
                       Error);
}

TEST_CASE("pipeline schedule: every schedule a recipe may name is built here") {
  for (const std::string& name : pipeline_schedule_names()) CHECK_NOTHROW(make_schedule(name, 2, 4));
}

TEST_CASE("pipeline schedule: 1f1b at pp 4 idles (pp-1)/(m+pp-1) of the step, F=B or B=2F alike") {
  for (int m : {4, 8, 16}) {
    CAPTURE(m);
    const double expected = 3.0 / (m + 3);
    CHECK(bubble_fraction(one_f_one_b(4, m), CostModel{1, 1, 1, 1}) == doctest::Approx(expected));
    CHECK(bubble_fraction(one_f_one_b(4, m)) == doctest::Approx(expected));
    CHECK(bubble_fraction(gpipe(4, m)) == doctest::Approx(expected));
  }
  CHECK(bubble_fraction(one_f_one_b(2, 4)) == doctest::Approx(0.2));
}

TEST_CASE("pipeline schedule: zero_bubble and v_schedule idle less than 1f1b at the same micro-batch count") {
  for (int m : {4, 8, 16}) {
    CAPTURE(m);
    const double one_f = bubble_fraction(one_f_one_b(4, m));
    CHECK(bubble_fraction(zero_bubble(4, m)) < one_f);
    CHECK(bubble_fraction(v_schedule(4, m)) < one_f);
    CHECK(bubble_fraction(interleaved_1f1b(4, m)) < one_f);
  }
}

namespace {
// A split as "emb[0,2) [2,4) [4,5) [5,6)head".
std::string spans_text(const std::vector<StageSpan>& spans) {
  std::string out;
  for (const StageSpan& sp : spans) {
    if (!out.empty()) out += ' ';
    out += (sp.embed ? "emb[" : "[") + std::to_string(sp.first_layer) + "," + std::to_string(sp.end_layer) + ")" +
           (sp.head ? "head" : "");
  }
  return out;
}
}  // namespace

TEST_CASE("pipeline split: layers spread evenly with the embedding and head as weighted pseudo-layers") {
  CHECK(spans_text(split_layers(4, 2)) == "emb[0,2) [2,4)head");
  CHECK(spans_text(split_layers(8, 4)) == "emb[0,2) [2,5) [5,7) [7,8)head");
  // Six layers over four stages (v_schedule at pp 2): weights 1 and 1 put layers 0 and 5, the
  // embedding and the head on rank 0 (stages 0 and 3) and four layers on rank 1; weights 0 and 0
  // give each rank three.
  CHECK(spans_text(split_layers(6, 4, 1, 1)) == "emb[0,1) [1,3) [3,5) [5,6)head");
  CHECK(spans_text(split_layers(6, 4, 0, 0)) == "emb[0,2) [2,4) [4,5) [5,6)head");
  CHECK(spans_text(split_layers(2, 4, 1, 1)) == "emb[0,0) [0,1) [1,2) [2,2)head");
  CHECK(spans_text(split_layers(4, 2, 0, 2)) == "emb[0,3) [3,4)head");
  CHECK_THROWS_WITH_AS(split_layers(2, 4, 0, 0),
                       doctest::Contains("2 layers (with the embedding as 0 and the head as 0) do not fill 4 stages: "
                                         "stage 2 would hold nothing"),
                       Error);
}

TEST_CASE("pipeline split: the pseudo-layer weights are the costs rounded, raised to 1 where stages would be empty") {
  const auto w = [](int64_t layers, int64_t stages, double in, double out) {
    const PseudoLayerWeights x = pseudo_layer_weights(layers, stages, in, out);
    return std::to_string(x.input) + "," + std::to_string(x.output);
  };
  CHECK(w(6, 4, 0.0, 0.2) == "0,0");
  CHECK(w(6, 4, 0.0, 0.6) == "0,1");
  CHECK(w(16, 4, 0.0, 2.3) == "0,2");
  CHECK(w(3, 4, 0.0, 0.2) == "0,1");
  CHECK(w(2, 4, 0.0, 0.2) == "1,1");
  CHECK(w(2, 4, 0.0, 3.0) == "0,3");
  CHECK_THROWS_WITH_AS(pseudo_layer_weights(4, 2, -1.0, 0.0), doctest::Contains("must be finite and >= 0, not -1"),
                       Error);
}
