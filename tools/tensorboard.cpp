// The events file: see tensorboard.h.
#include "tools/tensorboard.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "engine/error.h"

namespace quilt {
namespace {

// Byte-wise table of the reflected Castagnoli polynomial 0x82F63B78.
const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out.push_back(char(uint8_t(v)));
}

template <class T>
void put_fixed(std::string& out, T v) {  // little-endian, as x86 stores it
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

// A length-delimited field (wire type 2).
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, uint64_t(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_varint(e, 1 << 3 | 1);  // wall_time: double, fixed64
  put_fixed(e, wall_time);
  put_varint(e, 2 << 3 | 0);  // step: int64, varint
  put_varint(e, uint64_t(step));
  return e;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  const auto& t = crc_table();
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const double now = wall_seconds();
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(int64_t(now)) + "." + host)).string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  QUILT_CHECK(out_.is_open(), "[logging.tensorboard] cannot open ", path_, " for writing");
  std::string e = event_header(now, 0);
  put_bytes(e, 3, "brain.Event:2");  // file_version: TensorBoard checks it on the first record
  record(e);
}

void TensorBoardWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    put_varint(value, 2 << 3 | 5);  // simple_value: float, fixed32
    put_fixed(value, float(v));
    put_bytes(summary, 1, value);
  }
  std::string e = event_header(wall_seconds(), step);
  put_bytes(e, 5, summary);
  record(e);
}

void TensorBoardWriter::record(const std::string& data) {
  std::string frame;
  put_fixed(frame, uint64_t(data.size()));
  put_fixed(frame, masked_crc32c(frame.data(), 8));
  frame += data;
  put_fixed(frame, masked_crc32c(data.data(), data.size()));
  out_.write(frame.data(), std::streamsize(frame.size()));
  out_.flush();
  QUILT_CHECK(out_.good(), "[logging.tensorboard] writing ", path_, " failed (disk full?)");
}

}  // namespace quilt
