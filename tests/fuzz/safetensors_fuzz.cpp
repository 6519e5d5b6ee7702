// Fuzzes the safetensors reader: the input is a whole file. It is parsed in memory; a file the
// parser accepts is then written out and read back through every path a checkpoint load
// takes (mapped, copied, and by blocks). quilt::Error is the expected answer to a bad file;
// anything else (another exception, a sanitizer report) is a bug.
#include "engine/io/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

using namespace quilt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = fuzz::scratch_dir("safetensors") + "/f.safetensors";
  try {
    parse_safetensors_index({reinterpret_cast<const char*>(data), size});
    fuzz::write_file(path, data, size);
    const SafetensorsIndex idx = read_safetensors_index(path);
    for (bool mmap : {true, false}) load_safetensors(path, {.mmap = mmap});
    for (const SafetensorsEntry& e : idx.entries) {
      // The back half of every dim: a block that starts inside the tensor and ends at its end.
      Shape start, sizes;
      for (int64_t n : e.shape) start.push_back(n / 2), sizes.push_back(n - n / 2);
      read_safetensors_block(idx, e.name, start, sizes);
    }
  } catch (const Error&) {
  }
  return 0;
}
