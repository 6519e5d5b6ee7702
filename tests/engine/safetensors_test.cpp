// safetensors I/O: every malformed corpus file raises its rule's error, round trips are bit
// exact for every dtype, mapped tensors outlive the reader, failed writes leave nothing behind,
// and the bytes written match a hand-computed file.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/io/safetensors.h"

using namespace quilt;
namespace fs = std::filesystem;

namespace {

const fs::path kCorpus = fs::path(__FILE__).parent_path() / "data" / "safetensors";

// A fresh directory under the system temp dir, removed with everything in it.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() / ("quilt_safetensors_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::set<std::string> listing() const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.insert(e.path().filename().string());
    return out;
  }
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
// The raw bytes of a tensor's elements in row-major order, gathered element by element (the
// engine's strided copy of 16-bit floats goes through float and would not keep NaN payloads).
std::string bytes_of(const Tensor& t) {
  Tensor c = t.device().is_cpu() ? t : t.to(Device::cpu());
  const size_t es = c.element_size();
  const char* base = static_cast<const char*>(c.data_ptr());
  std::string out;
  Shape idx(size_t(c.dim()), 0);
  for (int64_t i = 0; i < c.numel(); ++i) {
    int64_t off = 0;
    for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * c.strides()[d];
    out.append(base + off * int64_t(es), es);
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < c.shape()[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

// A CPU tensor filled with random bit patterns (NaN payloads, subnormals, -0 included);
// bools get 0/1 only, the engine's representation.
Tensor random_bits(const Shape& shape, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty(shape, {.dtype = dtype});
  std::mt19937_64 rng(seed);
  auto* p = static_cast<unsigned char*>(t.data_ptr());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = dtype == DType::b8 ? rng() & 1 : static_cast<unsigned char>(rng());
  // Patterns a float round trip would change, planted so every float tensor has them:
  // a signalling NaN with a payload, a negative quiet NaN with a payload, -0, the smallest subnormal.
  auto plant = [&](auto... v) {
    using T = std::common_type_t<decltype(v)...>;
    const T vals[] = {v...};
    for (size_t i = 0; i < std::size(vals) && (i + 1) * sizeof(T) <= t.nbytes(); ++i)
      std::memcpy(p + i * sizeof(T), &vals[i], sizeof(T));
  };
  if (dtype == DType::f16) plant(uint16_t(0x7c01), uint16_t(0xfe55), uint16_t(0x8000), uint16_t(0x0001));
  if (dtype == DType::bf16) plant(uint16_t(0x7f81), uint16_t(0xffc5), uint16_t(0x8000), uint16_t(0x0001));
  if (dtype == DType::f32) plant(0x7f800001u, 0xffc00055u, 0x80000000u, 0x00000001u);
  if (dtype == DType::f64)
    plant(uint64_t(0x7ff0000000000001), uint64_t(0xfff8000000000055), uint64_t(1) << 63, uint64_t(1));
  return t;
}

struct BadCase {
  const char* file;
  const char* fragment;
};

// One row per corpus file: the rule it breaks, as the error must say it.
const BadCase kBadCases[] = {
    {"bad_empty_file", "file is 0 bytes, shorter than the 8-byte header length"},
    {"bad_too_short", "file is 5 bytes, shorter than the 8-byte header length"},
    {"bad_header_over_limit", "header length 100000001 exceeds the limit of 100000000 bytes"},
    {"bad_header_length_max_u64", "header length 18446744073709551615 exceeds the limit"},
    {"bad_header_past_eof", "header length 1000 runs past the end of the file (10 bytes"},
    {"bad_header_empty", "header is not well-formed JSON"},
    {"bad_not_json", "header is not well-formed JSON"},
    {"bad_truncated_json", "header is not well-formed JSON"},
    {"bad_nul_padding", "header is not well-formed JSON"},
    {"bad_invalid_utf8", "header is not valid UTF-8 (byte 3 of the header)"},
    {"bad_overlong_utf8", "header is not valid UTF-8 (byte 2 of the header)"},
    {"bad_header_array", "header is not a JSON object (it is array)"},
    {"bad_header_string", "header is not a JSON object (it is string)"},
    {"bad_deep_nesting", "header is not a JSON object (it is array)"},
    {"bad_entry_not_object", "tensor 'w': header entry is not an object (it is number)"},
    {"bad_missing_dtype", "tensor 'w': header entry has no 'dtype'"},
    {"bad_missing_shape", "tensor 'w': header entry has no 'shape'"},
    {"bad_missing_offsets", "tensor 'w': header entry has no 'data_offsets'"},
    {"bad_dtype_not_string", "tensor 'w': dtype is not a string (it is number)"},
    {"bad_unknown_dtype", "tensor 'w': unknown dtype 'F33' (supported: F32, F16, BF16, F64, I32, I64, BOOL)"},
    {"bad_unsupported_dtype", "tensor 'w': dtype 'U8' is not supported by the engine"},
    {"bad_shape_not_array", "tensor 'w': shape is not an array (it is number)"},
    {"bad_shape_negative", "tensor 'w': shape entry -2 is negative"},
    {"bad_shape_fraction", "tensor 'w': shape entry 2.5 is not a non-negative integer"},
    {"bad_shape_float", "tensor 'w': shape entry 2.0 is not a non-negative integer"},
    {"bad_shape_string", "tensor 'w': shape entry \"2\" is not a non-negative integer"},
    {"bad_shape_huge_number", "is not a non-negative integer"},
    {"bad_shape_over_int64", "tensor 'w': shape entry 9223372036854775808 is too large"},
    {"bad_numel_overflow", "tensor 'w': shape (4294967296, 4294967296) overflows a 64-bit byte count"},
    {"bad_offsets_one", "tensor 'w': data_offsets is not an array of two integers: [0]"},
    {"bad_offsets_three", "tensor 'w': data_offsets is not an array of two integers: [0,4,8]"},
    {"bad_offsets_object", "tensor 'w': data_offsets is not an array of two integers"},
    {"bad_offsets_negative", "tensor 'w': data_offsets begin -8 is negative"},
    {"bad_offsets_float", "tensor 'w': data_offsets end 8.5 is not a non-negative integer"},
    {"bad_offsets_reversed", "tensor 'w': data_offsets [8, 0] begin after they end"},
    {"bad_size_mismatch", "tensor 'w': byte size mismatch: shape (3,) of F32 needs 12 bytes but data_offsets [0, 8] hold 8"},
    {"bad_offsets_past_buffer", "tensor 'w': data_offsets [0, 16] run past the end of the byte buffer (8 bytes)"},
    {"bad_offsets_huge", "run past the end of the byte buffer (8 bytes)"},
    {"bad_first_not_at_zero", "tensor 'w': the first tensor's data_offsets [4, 8] do not begin at 0"},
    {"bad_gap", "tensor 'b': data_offsets [8, 12] leave a gap after tensor 'a' at [0, 4]"},
    {"bad_overlap", "tensor 'b': data_offsets [4, 12] overlap tensor 'a' at [0, 8]"},
    {"bad_trailing_bytes", "4 trailing bytes after the last tensor (the tensors end at 4, the byte buffer holds 8 bytes)"},
    {"bad_trailing_bytes_no_tensors", "4 trailing bytes after the last tensor (the tensors end at 0"},
    {"bad_duplicate_name", "tensor 'w': duplicate tensor name in the header"},
    {"bad_duplicate_field", "tensor 'w': duplicate key 'dtype' in its header entry"},
    {"bad_metadata_string", "__metadata__ is not a map of strings to strings (it is string)"},
    {"bad_metadata_number_value", "__metadata__ is not a map of strings to strings (key 'format' holds number)"},
    {"bad_metadata_nested", "__metadata__ is not a map of strings to strings (key 'format' holds object)"},
    {"bad_metadata_duplicate_key", "__metadata__ has the duplicate key 'k'"},
};

// Runs `f` expecting a quilt::Error; returns its message ("" when none was thrown).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors: every malformed corpus file raises an error naming the file and the broken rule") {
  REQUIRE(fs::is_directory(kCorpus));
  std::set<std::string> listed;
  for (const BadCase& c : kBadCases) {
    listed.insert(c.file);
    const std::string path = (kCorpus / (std::string(c.file) + ".safetensors")).string();
    INFO("corpus file: ", std::string(c.file));
    REQUIRE(fs::exists(path));
    // Every entry point that reads a header must reject it the same way.
    const std::string from_index = error_of([&] { read_safetensors_index(path); });
    const std::string from_mmap = error_of([&] { load_safetensors(path); });
    const std::string from_owned = error_of([&] { load_safetensors(path, {.mmap = false}); });
    const std::string from_memory = error_of([&] { parse_safetensors_index(read_bytes(path), path); });
    CHECK_MESSAGE(from_index.find(c.fragment) != std::string::npos, "message: ", from_index);
    CHECK(from_index.rfind("[safetensors] " + path + ": ", 0) == 0);
    CHECK(from_mmap == from_index);
    CHECK(from_owned == from_index);
    CHECK(from_memory == from_index);
  }
  // A corpus file without a row would go untested.
  for (const auto& e : fs::directory_iterator(kCorpus)) {
    const std::string stem = e.path().stem().string();
    if (stem.rfind("bad_", 0) == 0) CHECK_MESSAGE(listed.count(stem) == 1, "no expected error for ", stem);
  }
}

TEST_CASE("safetensors: unusual but legal corpus files load with the right values") {
  auto path = [](const char* name) { return (kCorpus / (std::string(name) + ".safetensors")).string(); };
  for (bool mmap : {true, false}) {
    INFO("mmap: ", mmap);
    SafetensorsFile padded = load_safetensors(path("good_padded"), {.mmap = mmap});
    CHECK(padded.at("w").to_vector() == std::vector<double>{1, 2});
    // Data at a misaligned file offset is still read correctly (copied rather than mapped).
    SafetensorsFile unaligned = load_safetensors(path("good_unaligned"), {.mmap = mmap});
    CHECK(read_safetensors_index(path("good_unaligned")).data_start % 4 == 1);
    CHECK(unaligned.at("w").to_vector() == std::vector<double>{1, 2});
    CHECK(reinterpret_cast<uintptr_t>(unaligned.at("w").data_ptr()) % 4 == 0);
    // Any non-zero byte is true, stored as the engine's 1.
    SafetensorsFile bools = load_safetensors(path("good_bool_bytes"), {.mmap = mmap});
    CHECK(bytes_of(bools.at("m")) == std::string("\0\1\1\1", 4));
    SafetensorsFile empty = load_safetensors(path("good_empty"), {.mmap = mmap});
    CHECK(empty.tensors.empty());
    CHECK(empty.metadata.empty());
    SafetensorsFile meta = load_safetensors(path("good_metadata_only"), {.mmap = mmap});
    CHECK(meta.tensors.empty());
    CHECK(meta.metadata == std::map<std::string, std::string>{{"format", "pt"}, {"note", "caf\xc3\xa9"}});

    SafetensorsFile mixed = load_safetensors(path("good_mixed"), {.mmap = mmap});
    const std::string ete = "\xc3\xa9t\xc3\xa9";
    CHECK(mixed.names == std::vector<std::string>{"a", "e0", "e1", "b", ete});
    CHECK(mixed.at("a").to_vector() == std::vector<double>{-5});
    CHECK(mixed.at("b").to_vector() == std::vector<double>{7});
    CHECK(mixed.at(ete).dim() == 0);
    CHECK(mixed.at(ete).dtype() == DType::f16);
    CHECK(mixed.at(ete).item<double>() == 1.0);
    CHECK(mixed.at("e0").shape() == Shape{0, 3});
    CHECK(mixed.at("e1").shape() == Shape{2, 0});
    CHECK(mixed.at("e1").dtype() == DType::bf16);
  }
  CHECK_THROWS_WITH_AS(load_safetensors(path("good_padded")).at("nope"),
                       doctest::Contains("tensor 'nope': no such tensor in the file"), Error);
  CHECK_THROWS_WITH_AS(load_safetensors((kCorpus / "does_not_exist.safetensors").string()),
                       doctest::Contains("cannot open for reading: No such file or directory"), Error);
  CHECK_THROWS_WITH_AS(read_safetensors_index(kCorpus.string()), doctest::Contains("is not a regular file"), Error);
}

TEST_CASE("safetensors: a written file matches a hand-computed byte string") {
  TempDir dir;
  const std::string path = dir.file("known.safetensors");
  Tensor b = from_vector({1, -2}, {2}, {.dtype = DType::i32});
  Tensor a = scalar_tensor(1.5, {.dtype = DType::f32});
  Tensor h = from_vector({1.0, -2.0}, {1, 2}, {.dtype = DType::bf16});
  Tensor z = zeros({0}, {.dtype = DType::f64});
  save_safetensors(path, {{"b", b}, {"a", a}, {"h", h}, {"z", z}}, {{"format", "pt"}});

  // Layout: 8-byte element sizes first, then 4, then 2 (stable within a size), so z (empty)
  // sits at [0, 0], b at [0, 8], a at [8, 12], h at [12, 16]. The 249-byte JSON is padded
  // with 7 spaces to 256 = 0x100, the little-endian length in the first 8 bytes.
  const std::string json =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"z\":{\"dtype\":\"F64\",\"shape\":[0],\"data_offsets\":[0,0]},"
      "\"b\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[8,12]},"
      "\"h\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[12,16]}}";
  REQUIRE(json.size() == 249);
  std::string expected("\x00\x01\x00\x00\x00\x00\x00\x00", 8);
  expected += json + std::string(7, ' ');
  expected += std::string("\x01\x00\x00\x00\xfe\xff\xff\xff", 8);  // i32 1, -2
  expected += std::string("\x00\x00\xc0\x3f", 4);                  // f32 1.5 = 0x3fc00000
  expected += std::string("\x80\x3f\x00\xc0", 4);                  // bf16 1.0 = 0x3f80, -2.0 = 0xc000
  CHECK(read_bytes(path) == expected);
  CHECK(dir.listing() == std::set<std::string>{"known.safetensors"});

  // And the reader agrees with the layout it describes.
  SafetensorsIndex index = read_safetensors_index(path);
  CHECK(index.header_size == 256);
  CHECK(index.data_start == 264);
  CHECK(index.names() == std::vector<std::string>{"z", "b", "a", "h"});
  CHECK(index.at("h").begin == 12);
  CHECK(index.at("h").end == 16);
  CHECK(index.metadata.at("format") == "pt");
}

TEST_CASE("safetensors: every dtype round-trips bit for bit, including 0-d, empty and non-contiguous tensors") {
  TempDir dir;
  const std::string path = dir.file("all.safetensors");
  std::vector<std::pair<std::string, Tensor>> tensors;
  uint64_t seed = 1;
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64, DType::b8}) {
    const std::string n = dtype_name(dt);
    tensors.push_back({n + ".matrix", random_bits({5, 7}, dt, seed++)});
    tensors.push_back({n + ".scalar", random_bits({}, dt, seed++)});
    tensors.push_back({n + ".empty", random_bits({3, 0, 2}, dt, seed++)});
    tensors.push_back({n + ".transposed", random_bits({4, 6}, dt, seed++).transpose(0, 1)});
    tensors.push_back({n + ".strided", random_bits({6, 9}, dt, seed++).slice(1, 1, 9, 3).narrow(0, 2, 3)});
    tensors.push_back({n + ".expanded", random_bits({3, 1}, dt, seed++).expand({3, 4})});
  }
  REQUIRE_FALSE(tensors[3].second.is_contiguous());
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "1200"}, {"", "empty key"},
                                                       {"unicode", "\xe2\x88\x87 loss"}};
  save_safetensors(path, tensors, metadata);
  CHECK(dir.listing() == std::set<std::string>{"all.safetensors"});

  for (bool mmap : {true, false}) {
    INFO("mmap: ", mmap);
    SafetensorsFile f = load_safetensors(path, {.mmap = mmap});
    CHECK(f.metadata == metadata);
    REQUIRE(f.tensors.size() == tensors.size());
    for (const auto& entry : tensors) {  // no structured binding: clang 14 cannot capture one
      const auto& name = entry.first;
      const auto& t = entry.second;
      INFO("tensor: ", name);
      const Tensor& r = f.at(name);
      CHECK(r.dtype() == t.dtype());
      CHECK(r.shape() == t.shape());
      CHECK(r.is_contiguous());
      CHECK(bytes_of(r) == bytes_of(t));
      // A mapped tensor of a file this writer produced is aligned for its dtype.
      CHECK(reinterpret_cast<uintptr_t>(r.data_ptr()) % r.element_size() == 0);
    }
  }
  // The header lists the data largest element first, the given order kept within a size.
  std::vector<std::string> names = read_safetensors_index(path).names();
  std::vector<std::string> expected;
  for (size_t size : {8, 4, 2, 1})
    for (const auto& [name, t] : tensors)
      if (t.element_size() == size) expected.push_back(name);
  CHECK(names == expected);
}

TEST_CASE("safetensors: mapped tensors borrow the file and stay valid after the reader and the file are gone") {
  TempDir dir;
  const std::string path = dir.file("big.safetensors");
  Tensor w = random_bits({512, 512}, DType::f32, 42);  // 1 MiB
  save_safetensors(path, {{"w", w}, {"s", scalar_tensor(3, {.dtype = DType::i64})}});

  const int64_t before = cpu_memory_stats().allocated;
  Tensor kept;
  {
    SafetensorsFile f = load_safetensors(path);
    // Mapped, not allocated: the host allocator hands out no megabyte for it.
    CHECK(cpu_memory_stats().allocated - before < 4096);
    kept = f.at("w");
  }
  fs::remove(path);  // the mapping keeps the pages
  CHECK(bytes_of(kept) == bytes_of(w));
  CHECK(kept.storage().use_count() == 1);

  // Writes to a mapped tensor stay private: the file does not change.
  save_safetensors(path, {{"w", w}});
  {
    SafetensorsFile f = load_safetensors(path);
    Tensor m = f.at("w");
    m.fill_(0.0);
    CHECK(m.sum().item<double>() == 0.0);
  }
  CHECK(bytes_of(load_safetensors(path).at("w")) == bytes_of(w));

  // The owned mode allocates each tensor and does not depend on the file afterwards.
  const int64_t before_owned = cpu_memory_stats().allocated;
  SafetensorsFile owned = load_safetensors(path, {.mmap = false});
  CHECK(cpu_memory_stats().allocated - before_owned >= int64_t(w.nbytes()));
  fs::remove(path);
  CHECK(bytes_of(owned.at("w")) == bytes_of(w));
}

TEST_CASE("safetensors: a failed write leaves no temporary file and no changed target") {
  TempDir dir;
  const Tensor x = from_vector({1, 2, 3}, {3});

  SUBCASE("the directory does not exist") {
    const std::string path = dir.file("missing/x.safetensors");
    CHECK_THROWS_WITH_AS(save_safetensors(path, {{"x", x}}),
                         doctest::Contains("cannot create the temporary file"), Error);
    CHECK(dir.listing().empty());
  }
  SUBCASE("the target is a directory, so the final rename fails") {
    fs::create_directories(dir.path / "taken" / "inner");
    CHECK_THROWS_WITH_AS(save_safetensors(dir.file("taken"), {{"x", x}}), doctest::Contains("cannot rename"), Error);
    CHECK(dir.listing() == std::set<std::string>{"taken"});
  }
  SUBCASE("bad inputs are rejected before anything is created") {
    const std::string path = dir.file("x.safetensors");
    CHECK_THROWS_WITH_AS(save_safetensors(path, {{"x", x}, {"x", x}}),
                         doctest::Contains(("[save_safetensors] " + path + ": duplicate tensor name 'x'").c_str()), Error);
    CHECK_THROWS_WITH_AS(save_safetensors(path, {{"__metadata__", x}}), doctest::Contains("'__metadata__' is reserved"),
                         Error);
    CHECK_THROWS_WITH_AS(save_safetensors(path, {{"u", Tensor()}}), doctest::Contains("tensor 'u' is undefined"), Error);
    CHECK_THROWS_WITH_AS(save_safetensors(path, {{"bad\xff", x}}), doctest::Contains("is not valid UTF-8"), Error);
    CHECK_THROWS_WITH_AS(save_safetensors(path, {{"x", x}}, {{"k", "\xc3"}}),
                         doctest::Contains("__metadata__ value of 'k' is not valid UTF-8"), Error);
    CHECK(dir.listing().empty());
  }
  SUBCASE("a tensor on a device that cannot be read fails midway and the old file survives") {
    const std::string path = dir.file("x.safetensors");
    save_safetensors(path, {{"old", x}});
    const std::string old_bytes = read_bytes(path);
    if (cuda::is_available()) {
      // With a GPU the device tensor is copied to the host and written like any other.
      Tensor g = x.to(Device::cuda(0));
      Tensor h = random_bits({4, 6}, DType::f16, 5);
      Tensor gt = h.to(Device::cuda(0)).transpose(0, 1);  // strided on the device, NaN payloads in it
      save_safetensors(path, {{"a", x}, {"g", g}, {"gt", gt}});
      SafetensorsFile f = load_safetensors(path);
      CHECK(bytes_of(f.at("g")) == bytes_of(x));
      CHECK(bytes_of(f.at("gt")) == bytes_of(h.transpose(0, 1)));
    } else {
      // A tensor claiming to live on a CUDA device this build cannot reach: the host copy
      // throws after the temporary file was created and the first tensor written.
      float host[3] = {1, 2, 3};
      Tensor fake = Tensor::from_storage(Storage::borrow(host, sizeof host, Device::cuda(0), {}), {3}, {1}, 0,
                                         DType::f32);
      CHECK_THROWS_AS(save_safetensors(path, {{"a", x}, {"g", fake}}), Error);
      CHECK(read_bytes(path) == old_bytes);
      CHECK(dir.listing() == std::set<std::string>{"x.safetensors"});
    }
  }
}

TEST_CASE("safetensors: the index reads only the header and blocks read only their byte runs") {
  TempDir dir;
  const std::string path = dir.file("blocks.safetensors");
  Tensor w = random_bits({6, 5, 4}, DType::f32, 7);
  Tensor wide = random_bits({4, 20000}, DType::f16, 8);  // rows of 40,000 bytes
  Tensor s = scalar_tensor(-4, {.dtype = DType::i64});
  Tensor m = random_bits({9}, DType::b8, 9);
  save_safetensors(path, {{"w", w}, {"wide", wide}, {"s", s}, {"m", m}}, {{"k", "v"}});

  SafetensorsIndex index = read_safetensors_index(path);
  CHECK(index.metadata.at("k") == "v");
  CHECK(index.at("w").shape == Shape{6, 5, 4});
  CHECK(index.at("w").dtype == DType::f32);
  CHECK(index.at("w").nbytes() == 480);
  CHECK(index.find("nope") == nullptr);
  CHECK_THROWS_WITH_AS(index.at("nope"), doctest::Contains("tensor 'nope': no such tensor"), Error);

  auto block = [&](const std::string& name, const Tensor& full, const Shape& start, const Shape& sizes) {
    Tensor expect = full;
    for (size_t d = 0; d < start.size(); ++d) expect = expect.narrow(int64_t(d), start[d], sizes[d]);
    INFO("block of ", name, " at ", doctest::toString(start.size()), " dims, start[0] ", start.empty() ? -1 : start[0]);
    Tensor got = read_safetensors_block(index, name, start, sizes);
    CHECK(got.shape() == sizes);
    CHECK(bytes_of(got) == bytes_of(expect));
  };
  block("w", w, {2, 0, 0}, {3, 5, 4});  // rows: one run
  block("w", w, {0, 1, 0}, {6, 3, 4});  // middle dim: a run per outer index, gathered in one read
  block("w", w, {1, 2, 1}, {4, 2, 2});  // innermost dim partial: short runs
  block("w", w, {0, 0, 0}, {6, 5, 4});  // all of it
  block("w", w, {5, 4, 3}, {1, 1, 1});  // one element
  block("w", w, {3, 0, 0}, {0, 5, 4});  // empty
  block("wide", wide, {0, 100}, {4, 10});      // gaps of ~40 KB are read as one span
  block("wide", wide, {1, 0}, {3, 20000});     // whole rows
  block("wide", wide, {0, 19990}, {4, 10});    // the last columns
  block("s", s, {}, {});                       // 0-d
  CHECK(bytes_of(read_safetensors_tensor(index, "m")) == bytes_of(m));
  CHECK(bytes_of(read_safetensors_tensor(index, "wide")) == bytes_of(wide));

  CHECK_THROWS_WITH_AS(read_safetensors_block(index, "w", {0, 0, 1}, {6, 5, 4}),
                       doctest::Contains("tensor 'w': block start (0, 0, 1) sizes (6, 5, 4) is not inside its shape (6, 5, 4)"),
                       Error);
  CHECK_THROWS_WITH_AS(read_safetensors_block(index, "w", {0, 0}, {6, 5}), doctest::Contains("is not inside its shape"),
                       Error);

  std::vector<char> raw(8);
  read_safetensors_bytes(index, "w", 16, 8, raw.data());
  CHECK(std::string(raw.data(), 8) == bytes_of(w).substr(16, 8));
  CHECK_THROWS_WITH_AS(read_safetensors_bytes(index, "w", 476, 8, raw.data()),
                       doctest::Contains("byte range [476, 484) is outside its 480 bytes"), Error);

  // The file replaced by a different one after the index was read.
  save_safetensors(path, {{"w", w}});
  CHECK_THROWS_WITH_AS(read_safetensors_tensor(index, "w"), doctest::Contains("changed since read_safetensors_index"),
                       Error);
}

TEST_CASE("safetensors: truncated, mutated and deeply nested inputs raise quilt::Error and never crash") {
  TempDir dir;
  const std::string path = dir.file("seed.safetensors");
  save_safetensors(path,
                   {{"a", random_bits({2, 3}, DType::f32, 1)},
                    {"b", random_bits({3}, DType::bf16, 2)},
                    {"c", random_bits({}, DType::b8, 3)}},
                   {{"format", "pt"}});
  const std::string good = read_bytes(path);
  CHECK_NOTHROW(parse_safetensors_index(good));

  int rejected = 0;
  // Every proper prefix of a valid file is invalid (the byte buffer or header is cut).
  for (size_t n = 0; n < good.size(); ++n) {
    CHECK_THROWS_AS(parse_safetensors_index(std::string_view(good).substr(0, n)), Error);
    ++rejected;
  }
  // Random byte edits either still describe a valid file or raise quilt::Error, nothing else.
  std::mt19937_64 rng(2024);
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bad = good;
    const int edits = 1 + int(rng() % 3);
    for (int e = 0; e < edits; ++e) bad[rng() % bad.size()] = static_cast<char>(rng());
    try {
      SafetensorsIndex idx = parse_safetensors_index(bad);
      CHECK(idx.data_start + (idx.entries.empty() ? 0 : idx.entries.back().end) == bad.size());
    } catch (const Error&) {
      ++rejected;
    }
  }
  CHECK(rejected > int(good.size()));

  // A megabyte of nesting must not exhaust the stack.
  std::string deep = std::string(500000, '[') + std::string(500000, ']');
  std::string file(8, '\0');
  for (int b = 0; b < 8; ++b) file[size_t(b)] = static_cast<char>(uint64_t(deep.size()) >> (8 * b));
  CHECK_THROWS_WITH_AS(parse_safetensors_index(file + deep), doctest::Contains("header is not a JSON object"), Error);
  std::string deep_obj;
  for (int i = 0; i < 200000; ++i) deep_obj += "{\"a\":";
  deep_obj += "1" + std::string(200000, '}');
  for (int b = 0; b < 8; ++b) file[size_t(b)] = static_cast<char>(uint64_t(deep_obj.size()) >> (8 * b));
  CHECK_THROWS_WITH_AS(parse_safetensors_index(file + deep_obj), doctest::Contains("tensor 'a': header entry has no 'dtype'"),
                       Error);
}

TEST_CASE("safetensors: dtype names map both ways and unknown names are errors") {
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64, DType::b8})
    CHECK(parse_safetensors_dtype(safetensors_dtype_name(dt)) == dt);
  CHECK(std::string(safetensors_dtype_name(DType::b8)) == "BOOL");
  CHECK_THROWS_WITH_AS(parse_safetensors_dtype("f32"), doctest::Contains("[safetensors] unknown dtype 'f32'"), Error);
  CHECK_THROWS_WITH_AS(parse_safetensors_dtype("F8_E4M3"), doctest::Contains("dtype 'F8_E4M3' is not supported"), Error);
}
