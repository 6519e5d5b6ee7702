// What the fuzz targets share: a private scratch directory and writing an input to a file,
// for the readers whose only entry point is a path.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace quilt::fuzz {

/// A fresh directory under the system temp dir, unique to this process and `tag`.
inline std::string scratch_dir(const std::string& tag) {
  const auto p = std::filesystem::temp_directory_path() / ("quilt_fuzz_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

/// Replaces the file `path` with the `size` bytes at `data`.
inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), std::streamsize(size));
}

}  // namespace quilt::fuzz
