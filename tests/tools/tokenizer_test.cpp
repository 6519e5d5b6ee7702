// The byte tokenizer: every byte string round-trips, end of text is its own id, bad ids are errors.
#include <doctest/doctest.h>

#include <random>

#include "engine/error.h"
#include "tools/tokenizer.h"

using namespace quilt;

TEST_CASE("tokenizer: byte tokens round-trip any bytes, UTF-8 and NUL included") {
  auto tok = make_tokenizer("byte");
  CHECK(tok->name() == "byte");
  CHECK(tok->vocab_size() == 257);
  CHECK(tok->eot_token() == 256);
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  all += "Grüße, 世界\n";
  std::vector<uint32_t> ids;
  tok->encode(all, ids);
  CHECK(ids.size() == all.size());
  CHECK(ids[0] == 0);
  CHECK(ids[255] == 255);
  CHECK(tok->decode(ids) == all);
  std::mt19937 rng(7);
  std::string random(1000, '\0');
  for (char& c : random) c = static_cast<char>(rng() & 0xff);
  ids.clear();
  tok->encode(random, ids);
  CHECK(tok->decode(ids) == random);
}

TEST_CASE("tokenizer: encode appends, and end of text decodes to a visible marker") {
  ByteTokenizer tok;
  std::vector<uint32_t> ids = {ByteTokenizer::kEot};
  tok.encode("hi", ids);
  CHECK(ids == std::vector<uint32_t>{256, 'h', 'i'});
  CHECK(tok.decode(ids) == "<|endoftext|>hi");
}

TEST_CASE("tokenizer: ids outside the vocabulary and unknown names are errors naming them") {
  ByteTokenizer tok;
  std::vector<uint32_t> bad = {'a', 300};
  CHECK_THROWS_WITH_AS(tok.decode(bad), doctest::Contains("id 300 at position 1 is outside the vocabulary of 257"),
                       Error);
  CHECK_THROWS_WITH_AS(make_tokenizer("gpt2"), doctest::Contains("data.tokenizer 'gpt2' is not one of: byte"), Error);
}
