// Inputs that broke the safetensors reader (found fuzzing it, tests/fuzz/): each must now get a
// quilt::Error that names the file, the tensor and the broken rule.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "engine/error.h"
#include "engine/io/safetensors.h"

using namespace quilt;

namespace {

// A whole file: the 8-byte little-endian header length, then `header` (the byte buffer is empty).
std::string file_with_header(const std::string& header) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char((uint64_t(header.size()) >> (8 * i)) & 0xff);
  return bytes + header;
}

}  // namespace

TEST_CASE("fuzz regressions: an empty safetensors shape whose strides overflow 64 bits is refused") {
  // Zero elements passed the byte-count check, and the tensor's strides then overflowed int64.
  const std::string f = file_with_header(
      R"({"z": {"dtype": "F32", "shape": [0, 4611686018427387904, 4611686018427387904], "data_offsets": [0, 0]}})");
  CHECK_THROWS_WITH_AS(parse_safetensors_index(f, "fuzz.safetensors"),
                       doctest::Contains("fuzz.safetensors: tensor 'z'"), Error);
  CHECK_THROWS_WITH_AS(parse_safetensors_index(f, "fuzz.safetensors"),
                       doctest::Contains("holds no element but its strides overflow 64 bits"), Error);
  // The same dims with the zero in the middle are a legal empty tensor (strides 0 and 2^62).
  const std::string ok = file_with_header(
      R"({"z": {"dtype": "BOOL", "shape": [4611686018427387904, 0, 4611686018427387904], "data_offsets": [0, 0]}})");
  CHECK(parse_safetensors_index(ok, "ok.safetensors").entries.at(0).shape[1] == 0);
}
