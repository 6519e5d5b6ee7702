// agree(): a step that fails on some ranks stops every rank with the same error, naming the
// failing ranks and their messages; a step that succeeds everywhere costs one all-reduce.
#include <doctest/doctest.h>

#include <mutex>

#include "collectives/agree.h"
#include "engine/engine.h"

using namespace quilt;

namespace {

struct Outcome {
  std::string message;  // "" when agree returned
  bool reporter = false;
};

// Runs agree on n thread ranks, with `fail(rank)` giving each rank's error ("" for none).
std::vector<Outcome> agree_on(int n, const std::function<std::string(int)>& fail) {
  std::vector<Outcome> out(static_cast<size_t>(n));
  run_threads_group(n, [&](Communicator& c) {
    Outcome& o = out[size_t(c.rank())];
    try {
      agree(c, "opening the data", [&] {
        const std::string e = fail(c.rank());
        if (!e.empty()) throw Error(e);
      });
    } catch (const AgreedError& e) {
      o.message = e.what();
      o.reporter = e.reporter();
    }
    c.barrier();  // the group is still in step afterwards
  });
  return out;
}

}  // namespace

TEST_CASE("agree: nothing fails, every rank goes on") {
  for (const Outcome& o : agree_on(3, [](int) { return std::string(); })) CHECK(o.message.empty());
}

TEST_CASE("agree: one rank fails, every rank throws its message and rank 0 reports it") {
  const auto out = agree_on(4, [](int r) { return r == 2 ? std::string("[data] /x: no such file") : ""; });
  for (size_t r = 0; r < out.size(); ++r) {
    CHECK(out[r].message == "opening the data failed on rank 2: [data] /x: no such file");
    CHECK(out[r].reporter == (r == 0));
  }
}

TEST_CASE("agree: ranks with the same message share a line, different messages get one each") {
  auto same = agree_on(4, [](int r) { return r == 0 ? std::string() : "[data] disk full"; });
  CHECK(same[0].message == "opening the data failed on ranks 1-3: [data] disk full");
  auto mixed = agree_on(4, [](int r) { return r == 1 ? std::string("a") : r == 3 ? std::string("b") : std::string(); });
  CHECK(mixed[2].message == "opening the data failed on ranks 1, 3:\n  rank 1: a\n  rank 3: b");
}

TEST_CASE("agree: a long message is cut, and one rank alone throws at once") {
  auto out = agree_on(2, [](int r) { return r == 1 ? std::string(10000, 'x') : ""; });
  CHECK(out[0].message.size() < 4100);
  CHECK(out[0].message.find(" [...]") != std::string::npos);
  run_threads_group(1, [&](Communicator& c) {
    CHECK_THROWS_WITH_AS(agree(c, "checkpoint save", [] { fail("[checkpoint] no space left"); }),
                         "checkpoint save failed: [checkpoint] no space left", AgreedError);
  });
}
