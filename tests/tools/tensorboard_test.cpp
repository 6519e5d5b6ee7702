// The events file's framing: CRC-32C against its published check value, and the bytes of a
// record as TFRecord lays them out.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "tools/tensorboard.h"

using namespace quilt;

TEST_CASE("tensorboard: CRC-32C of \"123456789\" is the standard check value 0xE3069283") {
  CHECK(crc32c("123456789", 9) == 0xE3069283u);
  CHECK(crc32c("", 0) == 0u);
  const uint32_t c = 0xE3069283u;
  CHECK(masked_crc32c("123456789", 9) == ((c >> 15) | (c << 17)) + 0xA282EAD8u);
}

TEST_CASE("tensorboard: each record is length, its masked CRC, the Event bytes and their masked CRC") {
  const auto dir = std::filesystem::temp_directory_path() / "quilt-tb-test";
  std::filesystem::remove_all(dir);
  std::string path;
  {
    TensorBoardWriter tb(dir.string());
    path = tb.path();
    tb.scalars(7, {{"loss", 2.5}});
  }
  CHECK(std::filesystem::path(path).filename().string().rfind("events.out.tfevents.", 0) == 0);
  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), {});
  size_t at = 0;
  int records = 0;
  std::string last;
  while (at + 12 <= bytes.size()) {
    uint64_t len;
    uint32_t crc_len, crc_data;
    std::memcpy(&len, bytes.data() + at, 8);
    std::memcpy(&crc_len, bytes.data() + at + 8, 4);
    CHECK(crc_len == masked_crc32c(bytes.data() + at, 8));
    REQUIRE(at + 12 + len + 4 <= bytes.size());
    std::memcpy(&crc_data, bytes.data() + at + 12 + len, 4);
    CHECK(crc_data == masked_crc32c(bytes.data() + at + 12, len));
    last = bytes.substr(at + 12, len);
    at += 12 + len + 4;
    ++records;
  }
  CHECK(at == bytes.size());
  CHECK(records == 2);  // the version record, then step 7
  // step 7 (field 2, varint), then summary { value { tag "loss", simple_value 2.5f } }.
  const float v = 2.5f;
  std::string tail = std::string("\x10\x07\x2a\x0d\x0a\x0b\x0a\x04loss\x15", 13);
  tail.append(reinterpret_cast<const char*>(&v), 4);
  CHECK(last.substr(9) == tail);  // after the 9 bytes of wall_time
  std::filesystem::remove_all(dir);
}
