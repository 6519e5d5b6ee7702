// TensorBoard scalars without TensorBoard: an events file (events.out.tfevents.<time>.<host>)
// of TFRecord-framed Event protos, each holding one step's scalars. TFRecord frames every
// record as: u64 length, u32 masked CRC32C of those 8 bytes, the data, u32 masked CRC32C of
// the data (little-endian). The few protobuf fields it needs are encoded by hand:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
//
//   TensorBoardWriter tb("build/run1");           // build/run1/events.out.tfevents.1733130000.host
//   tb.scalars(10, {{"loss", 2.31}, {"lr", 1e-3}});
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace quilt {

/// CRC-32C (Castagnoli) of `n` bytes.
uint32_t crc32c(const void* data, size_t n);
/// TFRecord's masked CRC: rotated right by 15 and offset, so CRCs of CRCs stay distinct.
uint32_t masked_crc32c(const void* data, size_t n);

/// Appends scalar events to a new events file in a directory.
class TensorBoardWriter {
 public:
  /// Creates `dir`/events.out.tfevents.<unix seconds>.<host> and writes its version record.
  explicit TensorBoardWriter(const std::string& dir);
  /// One Event at `step` with a simple_value per (tag, value); flushed at once.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& data);
  std::string path_;
  std::ofstream out_;
};

}  // namespace quilt
