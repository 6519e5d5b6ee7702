// Inputs the fuzz targets of tests/fuzz/ found (recipes, token shards): each once broke a
// reader, and must now get a quilt::Error that names the problem.
#include <doctest/doctest.h>

#include "engine/error.h"
#include "tools/config.h"

using namespace quilt;

TEST_CASE("fuzz regressions: a recipe string that is not UTF-8 is refused, naming the key and the byte") {
  // recipe_to_yaml wrote U+FFFD for the bad byte, so the recipe did not read back unchanged.
  CHECK_THROWS_WITH_AS(parse_recipe("data:\n path: \xff\x01", {}, "fuzz.yaml"),
                       doctest::Contains("data.path: the value is not valid UTF-8 (byte 0) (fuzz.yaml:2)"), Error);
  CHECK_THROWS_WITH_AS(parse_recipe("data: {path: ok}\n", {"data.path=ok\xc3"}, "fuzz.yaml"),
                       doctest::Contains("data.path: the value is not valid UTF-8 (byte 2) (from --set"), Error);
}
