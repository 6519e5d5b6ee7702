// safetensors files: the Hugging Face checkpoint format (8-byte little-endian header length,
// a JSON header naming each tensor's dtype, shape and byte range, then the raw bytes).
// Reading validates every rule of the format and maps the file, so tensors borrow the pages
// (the mapping lives as long as any tensor uses it); writing goes to a temporary file that is
// fsynced and renamed over the target, so a crash never leaves a half file under the final name.
// The index functions read only the header, and then only the byte ranges a caller asks for,
// which is what a rank loading its shard of a large checkpoint needs.
//
//   save_safetensors("m.safetensors", {{"w", w}, {"b", b}}, {{"format", "pt"}});
//   SafetensorsFile f = load_safetensors("m.safetensors");        // f.at("w") views the mapping
//   SafetensorsIndex idx = read_safetensors_index("m.safetensors");
//   Tensor rows = read_safetensors_block(idx, "w", {128, 0}, {64, 512});   // rows 128..191 only
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/tensor.h"

namespace quilt {

/// Largest header length a reader accepts (the limit of the reference implementation).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

/// One tensor as the header describes it.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0;  // byte range [begin, end) relative to the start of the byte buffer
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
};

/// The validated header of a file: where the byte buffer starts and every tensor in it.
struct SafetensorsIndex {
  std::string path;                            // the file (or the name given to an in-memory image)
  uint64_t file_size = 0;                      // bytes in the whole file
  uint64_t header_size = 0;                    // N, the JSON header length (padding included)
  uint64_t data_start = 0;                     // file offset of the byte buffer (8 + N)
  std::vector<SafetensorsEntry> entries;       // in byte-buffer order
  std::map<std::string, std::string> metadata; // the `__metadata__` map (empty if absent)

  /// The entry called `name`, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const;
  /// The entry called `name`; throws naming the file and the tensor when there is none.
  const SafetensorsEntry& at(const std::string& name) const;
  /// Tensor names in byte-buffer order.
  std::vector<std::string> names() const;
};

/// A whole file read into tensors.
struct SafetensorsFile {
  std::string path;
  std::vector<std::string> names;            // in byte-buffer order
  std::map<std::string, Tensor> tensors;     // contiguous CPU tensors
  std::map<std::string, std::string> metadata;

  /// The tensor called `name`; throws naming the file and the tensor when there is none.
  const Tensor& at(const std::string& name) const;
};

/// How load_safetensors brings the bytes into memory.
struct SafetensorsLoadOptions {
  // true: tensors view a copy-on-write mapping of the file (no read until touched; writes to a
  // tensor stay private to the process; as with any mapping, truncating the file while tensors
  // use it makes later reads fault). false: each tensor gets its own allocation, read now.
  bool mmap = true;
};

/// The safetensors name of a dtype ("F32", "BF16", "F16", "F64", "I32", "I64", "BOOL").
const char* safetensors_dtype_name(DType dtype);
/// The engine dtype of a safetensors dtype name; throws naming the string for unknown or
/// unsupported ones (`what` prefixes the message, e.g. the file and tensor).
DType parse_safetensors_dtype(const std::string& name, const std::string& what = "[safetensors]");

/// Index of the first byte of `s` that breaks UTF-8 (overlongs, surrogates and > U+10FFFF
/// included), or npos when `s` is valid: headers must be UTF-8, and so must recipe strings.
size_t first_invalid_utf8(std::string_view s);

/// Reads and validates only the header of `path` (the byte buffer is not read).
SafetensorsIndex read_safetensors_index(const std::string& path);
/// Validates `file_bytes` as a whole safetensors file held in memory; `name` appears in errors.
SafetensorsIndex parse_safetensors_index(std::string_view file_bytes, const std::string& name = "<memory>");

/// Copies bytes [offset, offset + nbytes) of tensor `name`'s data from the file into `dst`.
void read_safetensors_bytes(const SafetensorsIndex& index, const std::string& name, uint64_t offset,
                            uint64_t nbytes, void* dst);
/// Reads the block [start, start + sizes) of tensor `name` into a new contiguous CPU tensor,
/// reading from the file only the byte runs the block covers.
Tensor read_safetensors_block(const SafetensorsIndex& index, const std::string& name, const Shape& start,
                              const Shape& sizes);
/// Reads the whole tensor `name` into a new contiguous CPU tensor.
Tensor read_safetensors_tensor(const SafetensorsIndex& index, const std::string& name);

/// Reads and validates a whole file.
SafetensorsFile load_safetensors(const std::string& path, SafetensorsLoadOptions options = {});

/// Writes `tensors` (any device, any strides; stored contiguous) and `metadata` to `path`
/// atomically: a temporary file in the same directory is written, fsynced and renamed over
/// `path`; on any error it is removed and `path` is left as it was. Tensors are laid out in
/// the given order, stably regrouped by element size (largest first) so that every tensor of
/// a mapped file is aligned for its dtype.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace quilt
