// safetensors reading (validated header, mmap or owned tensors, byte-range and block reads)
// and atomic writing (temporary file, fsync, rename).
#include "engine/io/safetensors.h"

#include "engine/ops/view.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <system_error>
#include <tuple>

namespace quilt {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian bytes; a big-endian host would need byte swapping");

namespace {

using json = nlohmann::json;

// ---- errors ----------------------------------------------------------------------------

template <class... A>
[[noreturn]] void bad_file(const std::string& path, const A&... a) {
  fail("[safetensors] ", path, ": ", a...);
}
template <class... A>
[[noreturn]] void bad_tensor(const std::string& path, const std::string& name, const A&... a) {
  fail("[safetensors] ", path, ": tensor '", name, "': ", a...);
}
std::string errno_text(int e) { return std::generic_category().message(e); }

// ---- dtypes ----------------------------------------------------------------------------

struct DTypeName {
  const char* name;
  DType dtype;
};
constexpr DTypeName kDTypes[] = {{"F32", DType::f32}, {"F16", DType::f16}, {"BF16", DType::bf16},
                                 {"F64", DType::f64}, {"I32", DType::i32}, {"I64", DType::i64},
                                 {"BOOL", DType::b8}};
// Names the format defines that the engine has no dtype for: an error that says "not supported"
// reads better than "unknown" for a file that is perfectly valid elsewhere.
constexpr const char* kForeignDTypes[] = {"U8",      "I8",      "U16",     "I16",     "U32",
                                          "U64",     "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4",
                                          "F6_E2M3", "F6_E3M2", "C64",     "F8_E4M3FNUZ", "F8_E5M2FNUZ"};
constexpr const char* kSupportedList = "F32, F16, BF16, F64, I32, I64, BOOL";

}  // namespace

// ---- UTF-8 -----------------------------------------------------------------------------

size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) { ++i; continue; }
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) { len = 3; lo = 0xA0; }
    else if (c >= 0xE1 && c <= 0xEC) len = 3;
    else if (c == 0xED) { len = 3; hi = 0x9F; }
    else if (c >= 0xEE && c <= 0xEF) len = 3;
    else if (c == 0xF0) { len = 4; lo = 0x90; }
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else if (c == 0xF4) { len = 4; hi = 0x8F; }
    else return i;
    if (n - i < len) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return i;
    i += len;
  }
  return std::string_view::npos;
}

namespace {

// ---- file descriptors ------------------------------------------------------------------

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { if (fd_ >= 0) ::close(fd_); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  // Closes now and reports the error close() gives (which can be a deferred write error).
  int close_checked() {
    const int fd = std::exchange(fd_, -1);
    return fd >= 0 ? ::close(fd) : 0;
  }

 private:
  int fd_;
};

struct OpenFile {
  Fd fd;
  uint64_t size = 0;
};

std::unique_ptr<OpenFile> open_for_reading(const std::string& path) {
  auto f = std::make_unique<OpenFile>();
  int fd;
  do fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) bad_file(path, "cannot open for reading: ", errno_text(errno));
  f->fd.reset(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) bad_file(path, "cannot stat: ", errno_text(errno));
  if (!S_ISREG(st.st_mode)) bad_file(path, "is not a regular file");
  f->size = uint64_t(st.st_size);
  return f;
}

void pread_all(int fd, void* dst, uint64_t nbytes, uint64_t offset, const std::string& path) {
  char* out = static_cast<char*>(dst);
  while (nbytes > 0) {
    // Linux transfers at most ~2 GiB per call; ask for 1 GiB at a time.
    const size_t chunk = size_t(std::min<uint64_t>(nbytes, uint64_t(1) << 30));
    const ssize_t got = ::pread(fd, out, chunk, off_t(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      bad_file(path, "read of ", chunk, " bytes at offset ", offset, " failed: ", errno_text(errno));
    }
    if (got == 0) bad_file(path, "file ended at offset ", offset, " while ", nbytes, " more bytes were expected (truncated while reading?)");
    out += got;
    offset += uint64_t(got);
    nbytes -= uint64_t(got);
  }
}

void write_all(int fd, const void* src, size_t nbytes, const std::string& what) {
  const char* in = static_cast<const char*>(src);
  while (nbytes > 0) {
    const size_t chunk = std::min<size_t>(nbytes, size_t(1) << 30);
    const ssize_t put = ::write(fd, in, chunk);
    if (put < 0) {
      if (errno == EINTR) continue;
      fail("[save_safetensors] ", what, ": write failed: ", errno_text(errno));
    }
    in += put;
    nbytes -= size_t(put);
  }
}

// ---- header validation -----------------------------------------------------------------

// A non-negative integer that fits `limit`, from a header number; `what` names the field.
uint64_t header_uint(const json& v, const std::string& path, const std::string& name, const std::string& what,
                     uint64_t limit) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > limit) bad_tensor(path, name, what, " ", u, " is too large (limit ", limit, ")");
    return u;
  }
  if (v.is_number_integer()) bad_tensor(path, name, what, " ", v.dump(), " is negative");
  bad_tensor(path, name, what, " ", v.dump(), " is not a non-negative integer");
}

const char* json_kind(const json& v) { return v.type_name(); }

void check_header_length(uint64_t n, uint64_t file_size, const std::string& path) {
  if (n > kSafetensorsMaxHeaderBytes)
    bad_file(path, "header length ", n, " exceeds the limit of ", kSafetensorsMaxHeaderBytes, " bytes");
  if (n > file_size - 8)
    bad_file(path, "header length ", n, " runs past the end of the file (", file_size, " bytes, so at most ",
             file_size - 8, " header bytes)");
}

uint64_t read_le64(const unsigned char* b) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b[i];
  return n;
}

// Parses and validates a header (`header` is the N bytes after the length) of a file of
// `file_size` bytes.
SafetensorsIndex parse_header(std::string_view header, uint64_t file_size, const std::string& path) {
  SafetensorsIndex index;
  index.path = path;
  index.file_size = file_size;
  index.header_size = header.size();
  index.data_start = 8 + header.size();
  const uint64_t buffer_size = file_size - index.data_start;

  if (const size_t bad = first_invalid_utf8(header); bad != std::string_view::npos)
    bad_file(path, "header is not valid UTF-8 (byte ", bad, " of the header)");

  // nlohmann stops at a NUL as if the input ended there, which would accept "{}\0garbage";
  // JSON text cannot contain a raw NUL anywhere, so any NUL is malformed.
  if (const size_t nul = header.find('\0'); nul != std::string_view::npos)
    bad_file(path, "header is not well-formed JSON: NUL byte at offset ", nul, " of the header");

  // nlohmann keeps the last of two equal keys silently; the callback sees every key, so a
  // duplicate tensor name (or field) is caught here instead of one tensor vanishing.
  std::vector<std::set<std::string>> open_objects;
  std::string current_top_key;
  std::optional<std::pair<std::string, std::string>> duplicate;  // (owner, key); owner "" = top level
  json root;
  try {
    root = json::parse(header.begin(), header.end(),
                       [&](int, json::parse_event_t event, json& parsed) -> bool {
                         switch (event) {
                           case json::parse_event_t::object_start: open_objects.emplace_back(); break;
                           case json::parse_event_t::object_end:
                             if (!open_objects.empty()) open_objects.pop_back();
                             break;
                           case json::parse_event_t::key: {
                             const std::string& k = parsed.get_ref<const std::string&>();
                             if (open_objects.empty()) break;
                             if (open_objects.size() == 1) current_top_key = k;
                             if (!open_objects.back().insert(k).second && !duplicate)
                               duplicate.emplace(open_objects.size() == 1 ? "" : current_top_key, k);
                             break;
                           }
                           default: break;
                         }
                         return true;
                       });
  } catch (const json::exception& e) {
    bad_file(path, "header is not well-formed JSON: ", e.what());
  }
  if (!root.is_object()) bad_file(path, "header is not a JSON object (it is ", json_kind(root), ")");
  if (duplicate) {
    if (duplicate->first.empty()) bad_tensor(path, duplicate->second, "duplicate tensor name in the header");
    if (duplicate->first == "__metadata__") bad_file(path, "__metadata__ has the duplicate key '", duplicate->second, "'");
    bad_tensor(path, duplicate->first, "duplicate key '", duplicate->second, "' in its header entry");
  }

  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        bad_file(path, "__metadata__ is not a map of strings to strings (it is ", json_kind(entry), ")");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          bad_file(path, "__metadata__ is not a map of strings to strings (key '", k, "' holds ", json_kind(v), ")");
        index.metadata.emplace(k, v.get<std::string>());
      }
      continue;
    }
    if (!entry.is_object()) bad_tensor(path, name, "header entry is not an object (it is ", json_kind(entry), ")");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!entry.contains(field)) bad_tensor(path, name, "header entry has no '", field, "'");
    const json& jd = entry["dtype"];
    const json& js = entry["shape"];
    const json& jo = entry["data_offsets"];
    if (!jd.is_string()) bad_tensor(path, name, "dtype is not a string (it is ", json_kind(jd), ")");
    if (!js.is_array()) bad_tensor(path, name, "shape is not an array (it is ", json_kind(js), ")");
    if (!jo.is_array() || jo.size() != 2)
      bad_tensor(path, name, "data_offsets is not an array of two integers: ", jo.dump());

    SafetensorsEntry e;
    e.name = name;
    e.dtype = parse_safetensors_dtype(jd.get<std::string>(), "[safetensors] " + path + ": tensor '" + name + "':");
    for (size_t d = 0; d < js.size(); ++d)
      e.shape.push_back(int64_t(header_uint(js[d], path, name, "shape entry", uint64_t(std::numeric_limits<int64_t>::max()))));
    e.begin = header_uint(jo[0], path, name, "data_offsets begin", std::numeric_limits<uint64_t>::max());
    e.end = header_uint(jo[1], path, name, "data_offsets end", std::numeric_limits<uint64_t>::max());
    if (e.begin > e.end) bad_tensor(path, name, "data_offsets [", e.begin, ", ", e.end, "] begin after they end");

    uint64_t bytes = dtype_size(e.dtype);
    for (int64_t s : e.shape)
      if (__builtin_mul_overflow(bytes, uint64_t(s), &bytes))
        bad_tensor(path, name, "shape ", e.shape, " overflows a 64-bit byte count");
    if (bytes > uint64_t(std::numeric_limits<int64_t>::max()))
      bad_tensor(path, name, "shape ", e.shape, " needs ", bytes, " bytes, more than a tensor can hold");
    // An empty shape passes the byte count, but its strides (the products of the trailing dims,
    // e.g. (0, 2^62, 2^62)) must still fit the int64 a tensor keeps them in.
    for (int64_t d = int64_t(e.shape.size()) - 1, stride = 1; d > 0; --d)
      if (__builtin_mul_overflow(stride, e.shape[size_t(d)], &stride))
        bad_tensor(path, name, "shape ", e.shape, " holds no element but its strides overflow 64 bits");
    if (bytes != e.nbytes())
      bad_tensor(path, name, "byte size mismatch: shape ", e.shape, " of ", jd.get<std::string>(), " needs ", bytes,
                 " bytes but data_offsets [", e.begin, ", ", e.end, "] hold ", e.nbytes());
    if (e.end > buffer_size)
      bad_tensor(path, name, "data_offsets [", e.begin, ", ", e.end, "] run past the end of the byte buffer (",
                 buffer_size, " bytes)");
    index.entries.push_back(std::move(e));
  }

  std::sort(index.entries.begin(), index.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t expected = 0;
  for (size_t i = 0; i < index.entries.size(); ++i) {
    const SafetensorsEntry& e = index.entries[i];
    if (e.begin != expected) {
      if (i == 0)
        bad_tensor(path, e.name, "the first tensor's data_offsets [", e.begin, ", ", e.end,
                   "] do not begin at 0 (the byte buffer must be covered without gaps)");
      const SafetensorsEntry& prev = index.entries[i - 1];
      bad_tensor(path, e.name, "data_offsets [", e.begin, ", ", e.end, "] ",
                 e.begin > expected ? "leave a gap after" : "overlap", " tensor '", prev.name, "' at [", prev.begin,
                 ", ", prev.end, "] (tensors must be contiguous, no gaps or overlaps)");
    }
    expected = e.end;
  }
  if (expected != buffer_size)
    bad_file(path, buffer_size - expected, " trailing bytes after the last tensor (the tensors end at ", expected,
             ", the byte buffer holds ", buffer_size, " bytes)");
  return index;
}

SafetensorsIndex read_index_from(const OpenFile& f, const std::string& path) {
  if (f.size < 8) bad_file(path, "file is ", f.size, " bytes, shorter than the 8-byte header length");
  unsigned char len[8];
  pread_all(f.fd.get(), len, 8, 0, path);
  const uint64_t n = read_le64(len);
  check_header_length(n, f.size, path);
  std::string header(size_t(n), '\0');
  pread_all(f.fd.get(), header.data(), n, 8, path);
  return parse_header(header, f.size, path);
}

// The engine's bool is one byte that must be 0 or 1; a file may hold any non-zero byte for
// true, which is mapped to 1 here instead of reaching kernels as an invalid bool.
bool has_nonstandard_bools(const unsigned char* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i)
    if (p[i] > 1) return true;
  return false;
}
void normalise_bools(unsigned char* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) p[i] = p[i] != 0;
}

// Opens the indexed file again, checking it still has the size the index was read from.
std::unique_ptr<OpenFile> reopen(const SafetensorsIndex& index) {
  auto f = open_for_reading(index.path);
  if (f->size != index.file_size)
    bad_file(index.path, "file is now ", f->size, " bytes but its index was read from ", index.file_size,
             " bytes (changed since read_safetensors_index?)");
  return f;
}

// A read-only view of the whole file; copy-on-write so tensors on it can be written without
// touching the file (and without a SIGSEGV).
struct Mapping {
  void* base = MAP_FAILED;
  size_t size = 0;
  ~Mapping() { if (base != MAP_FAILED) ::munmap(base, size); }
};

}  // namespace

// ---- public: dtypes ----------------------------------------------------------------------

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& d : kDTypes)
    if (d.dtype == dtype) return d.name;
  fail("[safetensors] dtype ", int(dtype), " has no safetensors name");
}

DType parse_safetensors_dtype(const std::string& name, const std::string& what) {
  for (const auto& d : kDTypes)
    if (name == d.name) return d.dtype;
  for (const char* foreign : kForeignDTypes)
    if (name == foreign) fail(what, " dtype '", name, "' is not supported by the engine (supported: ", kSupportedList, ")");
  fail(what, " unknown dtype '", name, "' (supported: ", kSupportedList, ")");
}

// ---- public: index -----------------------------------------------------------------------

const SafetensorsEntry* SafetensorsIndex::find(const std::string& name) const {
  for (const auto& e : entries)
    if (e.name == name) return &e;
  return nullptr;
}

const SafetensorsEntry& SafetensorsIndex::at(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  if (!e) bad_tensor(path, name, "no such tensor in the file (it has ", entries.size(), " tensors)");
  return *e;
}

std::vector<std::string> SafetensorsIndex::names() const {
  std::vector<std::string> out;
  out.reserve(entries.size());
  for (const auto& e : entries) out.push_back(e.name);
  return out;
}

const Tensor& SafetensorsFile::at(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) bad_tensor(path, name, "no such tensor in the file (it has ", tensors.size(), " tensors)");
  return it->second;
}

SafetensorsIndex read_safetensors_index(const std::string& path) {
  auto f = open_for_reading(path);
  return read_index_from(*f, path);
}

SafetensorsIndex parse_safetensors_index(std::string_view file_bytes, const std::string& name) {
  const uint64_t size = file_bytes.size();
  if (size < 8) bad_file(name, "file is ", size, " bytes, shorter than the 8-byte header length");
  const uint64_t n = read_le64(reinterpret_cast<const unsigned char*>(file_bytes.data()));
  check_header_length(n, size, name);
  return parse_header(file_bytes.substr(8, size_t(n)), size, name);
}

// ---- public: partial reads ---------------------------------------------------------------

void read_safetensors_bytes(const SafetensorsIndex& index, const std::string& name, uint64_t offset, uint64_t nbytes,
                            void* dst) {
  const SafetensorsEntry& e = index.at(name);
  if (offset > e.nbytes() || nbytes > e.nbytes() - offset)
    bad_tensor(index.path, name, "byte range [", offset, ", ", offset + nbytes, ") is outside its ", e.nbytes(), " bytes");
  if (nbytes == 0) return;
  auto f = reopen(index);
  pread_all(f->fd.get(), dst, nbytes, index.data_start + e.begin + offset, index.path);
}

Tensor read_safetensors_block(const SafetensorsIndex& index, const std::string& name, const Shape& start,
                              const Shape& sizes) {
  const SafetensorsEntry& e = index.at(name);
  const size_t nd = e.shape.size();
  bool in_bounds = start.size() == nd && sizes.size() == nd;
  for (size_t d = 0; in_bounds && d < nd; ++d)
    in_bounds = start[d] >= 0 && sizes[d] >= 0 && start[d] <= e.shape[d] && sizes[d] <= e.shape[d] - start[d];
  if (!in_bounds)
    bad_tensor(index.path, name, "block start ", start, " sizes ", sizes, " is not inside its shape ", e.shape);

  Tensor out = Tensor::empty(sizes, {.dtype = e.dtype});
  if (out.numel() == 0) return out;
  const uint64_t esize = dtype_size(e.dtype);
  const Shape strides = contiguous_strides(e.shape);
  // The innermost dim the block does not span fully; everything inside it is one contiguous run.
  int64_t cut = int64_t(nd) - 1;
  while (cut >= 0 && sizes[size_t(cut)] == e.shape[size_t(cut)]) --cut;
  const uint64_t run_elems =
      cut < 0 ? uint64_t(numel_of(e.shape)) : uint64_t(sizes[size_t(cut)]) * uint64_t(strides[size_t(cut)]);
  const uint64_t run_bytes = run_elems * esize;

  auto f = reopen(index);
  char* dst = static_cast<char*>(out.data_ptr());
  // Runs close together are read as one span and scattered, so a column block costs a few
  // large reads rather than one tiny read per row.
  constexpr uint64_t kMaxGap = 64 << 10, kMaxSpan = 32 << 20;
  struct Run { uint64_t file_off, dst_off; };
  std::vector<Run> group;
  std::vector<char> scratch;
  auto flush = [&] {
    if (group.empty()) return;
    if (group.size() == 1) {
      pread_all(f->fd.get(), dst + group[0].dst_off, run_bytes, group[0].file_off, index.path);
    } else {
      const uint64_t span = group.back().file_off + run_bytes - group.front().file_off;
      scratch.resize(size_t(span));
      pread_all(f->fd.get(), scratch.data(), span, group.front().file_off, index.path);
      for (const Run& r : group) std::memcpy(dst + r.dst_off, scratch.data() + (r.file_off - group.front().file_off), run_bytes);
    }
    group.clear();
  };

  const size_t outer = cut < 0 ? 0 : size_t(cut);  // dims iterated one index at a time
  Shape idx(outer, 0);
  const uint64_t base = index.data_start + e.begin;
  for (uint64_t dst_off = 0; dst_off < out.nbytes(); dst_off += run_bytes) {
    uint64_t elem = 0;
    for (size_t d = 0; d < nd; ++d) {
      const int64_t i = d < outer ? start[d] + idx[d] : start[d];
      elem += uint64_t(i) * uint64_t(strides[d]);
    }
    const uint64_t off = base + elem * esize;
    if (!group.empty()) {
      const uint64_t prev_end = group.back().file_off + run_bytes;
      if (off - prev_end > kMaxGap || off + run_bytes - group.front().file_off > kMaxSpan) flush();
    }
    group.push_back({off, dst_off});
    for (size_t d = outer; d-- > 0;) {  // odometer over the outer dims of the block
      if (++idx[d] < sizes[d]) break;
      idx[d] = 0;
    }
  }
  flush();
  if (e.dtype == DType::b8) normalise_bools(reinterpret_cast<unsigned char*>(dst), out.nbytes());
  return out;
}

Tensor read_safetensors_tensor(const SafetensorsIndex& index, const std::string& name) {
  const SafetensorsEntry& e = index.at(name);
  return read_safetensors_block(index, name, Shape(e.shape.size(), 0), e.shape);
}

// ---- public: whole files -----------------------------------------------------------------

SafetensorsFile load_safetensors(const std::string& path, SafetensorsLoadOptions options) {
  auto f = open_for_reading(path);
  SafetensorsIndex index = read_index_from(*f, path);
  SafetensorsFile out;
  out.path = path;
  out.metadata = index.metadata;
  out.names = index.names();

  std::shared_ptr<Mapping> map;
  if (options.mmap && !index.entries.empty()) {
    map = std::make_shared<Mapping>();
    map->size = size_t(index.file_size);
    map->base = ::mmap(nullptr, map->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, f->fd.get(), 0);
    if (map->base == MAP_FAILED) bad_file(path, "mmap of ", index.file_size, " bytes failed: ", errno_text(errno));
  }
  for (const SafetensorsEntry& e : index.entries) {
    const Shape strides = contiguous_strides(e.shape);
    if (map) {
      auto* p = static_cast<unsigned char*>(map->base) + index.data_start + e.begin;
      const bool aligned = reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) == 0;
      const bool clean = e.dtype != DType::b8 || !has_nonstandard_bools(p, e.nbytes());
      if (aligned && clean) {
        // The release lambda holds the mapping: it is unmapped when the last tensor goes.
        Storage s = Storage::borrow(p, size_t(e.nbytes()), Device::cpu(), [map] {});
        out.tensors.emplace(e.name, Tensor::from_storage(std::move(s), e.shape, strides, 0, e.dtype));
        continue;
      }
      // Files from writers that do not align (or that store true as 2..255) get a copy.
      Tensor t = Tensor::empty(e.shape, {.dtype = e.dtype});
      if (e.nbytes()) std::memcpy(t.data_ptr(), p, size_t(e.nbytes()));
      if (e.dtype == DType::b8) normalise_bools(static_cast<unsigned char*>(t.data_ptr()), e.nbytes());
      out.tensors.emplace(e.name, std::move(t));
      continue;
    }
    Tensor t = Tensor::empty(e.shape, {.dtype = e.dtype});
    if (e.nbytes()) pread_all(f->fd.get(), t.data_ptr(), e.nbytes(), index.data_start + e.begin, path);
    if (e.dtype == DType::b8) normalise_bools(static_cast<unsigned char*>(t.data_ptr()), e.nbytes());
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

// ---- public: writing ---------------------------------------------------------------------

namespace {

// The temporary file of one save: removed unless commit() renamed it over the target.
class TempFile {
 public:
  explicit TempFile(const std::string& target) : target_(target) {
    namespace fs = std::filesystem;
    const fs::path t(target);
    const fs::path dir = t.has_parent_path() ? t.parent_path() : fs::path(".");
    static std::atomic<uint64_t> counter{0};
    // O_EXCL plus pid and counter make the name unique across processes and threads; a
    // leading dot keeps it out of "*.safetensors" globs while it is incomplete.
    for (int attempt = 0;; ++attempt) {
      std::string name = ".";
      name += t.filename().string();
      name += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
      path_ = (dir / name).string();
      const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd >= 0) {
        fd_ = std::make_unique<Fd>(fd);
        return;
      }
      if (errno == EINTR || (errno == EEXIST && attempt < 100)) continue;
      fail("[save_safetensors] ", target, ": cannot create the temporary file '", path_, "': ", errno_text(errno));
    }
  }
  ~TempFile() {
    if (committed_) return;
    fd_.reset();
    ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  int fd() const { return fd_->get(); }
  const std::string& path() const { return path_; }

  // fsync, close, rename: the target changes only once the bytes are on disk.
  void commit() {
    if (::fsync(fd()) != 0) fail("[save_safetensors] ", target_, ": fsync of '", path_, "' failed: ", errno_text(errno));
    if (fd_->close_checked() != 0)
      fail("[save_safetensors] ", target_, ": close of '", path_, "' failed: ", errno_text(errno));
    if (::rename(path_.c_str(), target_.c_str()) != 0)
      fail("[save_safetensors] ", target_, ": cannot rename '", path_, "' over it: ", errno_text(errno));
    committed_ = true;
    // Make the rename itself durable. The file is complete under its final name already, so
    // a directory that cannot be fsynced (some filesystems refuse) is not an error.
    const std::filesystem::path t(target_);
    const std::string dir = t.has_parent_path() ? t.parent_path().string() : ".";
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::string target_;
  std::string path_;
  std::unique_ptr<Fd> fd_;
  bool committed_ = false;
};

// Calls f(pointer, bytes) for each maximal contiguous run of t's elements in row-major order.
// Byte copies, not the engine's copy kernel: a strided 16-bit float copy goes through float
// and would not keep NaN payloads, and a checkpoint must hold exactly the bits it was given.
template <class F>
void for_each_run(const Tensor& t, F&& f) {
  const Shape& shape = t.shape();
  const Shape& strides = t.strides();
  const int64_t es = int64_t(t.element_size());
  // Trailing dims whose strides are row-major contiguous form one run.
  size_t first = shape.size();
  int64_t run = 1;
  while (first > 0 && (shape[first - 1] == 1 || strides[first - 1] == run)) {
    run *= shape[first - 1];
    --first;
  }
  const char* base = static_cast<const char*>(t.data_ptr());
  Shape idx(first, 0);
  const int64_t runs = numel_of(Shape(shape.begin(), shape.begin() + int64_t(first)));
  for (int64_t r = 0; r < runs; ++r) {
    int64_t off = 0;
    for (size_t d = 0; d < first; ++d) off += idx[d] * strides[d];
    f(base + off * es, size_t(run * es));
    for (size_t d = first; d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

// `t` with its bytes readable on the host. A contiguous device tensor is copied as is; a
// strided one has the storage span it touches copied (a plain byte copy), and is viewed on
// the host with the same strides, so no copy kernel ever touches the values.
Tensor host_view(const Tensor& t) {
  if (t.device().is_cpu() || t.is_contiguous()) return t.device().is_cpu() ? t : t.to(Device::cpu());
  int64_t lo = t.offset(), hi = t.offset();
  for (size_t d = 0; d < t.shape().size(); ++d) {
    const int64_t reach = (t.shape()[d] - 1) * t.strides()[d];
    (reach < 0 ? lo : hi) += reach;
  }
  Tensor span = as_strided(t, {hi - lo + 1}, {1}, lo).to(Device::cpu());
  return as_strided(span, t.shape(), t.strides(), t.offset() - lo);
}

void check_utf8(const std::string& s, const std::string& path, const std::string& what) {
  if (const size_t bad = first_invalid_utf8(s); bad != std::string::npos)
    fail("[save_safetensors] ", path, ": ", what, " is not valid UTF-8 (byte ", bad, ")");
}

}  // namespace

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string op = "[save_safetensors] " + path + ": ";
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    QUILT_CHECK(name != "__metadata__", op, "'__metadata__' is reserved and cannot name a tensor");
    QUILT_CHECK(seen.insert(name).second, op, "duplicate tensor name '", name, "'");
    QUILT_CHECK(t.defined(), op, "tensor '", name, "' is undefined");
    QUILT_CHECK(!t.is_distributed(), op, "tensor '", name,
                "' is distributed; save its full tensor or its local shard explicitly");
    check_utf8(name, path, "tensor name '" + name + "'");
  }
  for (const auto& [k, v] : metadata) {
    check_utf8(k, path, "__metadata__ key '" + k + "'");
    check_utf8(v, path, "__metadata__ value of '" + k + "'");
  }

  // Largest element size first: with the header padded to 8 bytes, every tensor then starts
  // at a multiple of its element size, so mapped tensors are aligned.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tensors[a].second.element_size() > tensors[b].second.element_size();
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    const uint64_t bytes = t.nbytes();
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = safetensors_dtype_name(t.dtype());
    entry["shape"] = t.shape();
    entry["data_offsets"] = {offset, offset + bytes};
    header[name] = std::move(entry);
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  TempFile tmp(path);
  // Small pieces are gathered into one buffer so a file of many tiny tensors is a few writes.
  constexpr size_t kBuffer = 4 << 20;
  std::vector<char> buf;
  buf.reserve(kBuffer);
  auto put = [&](const void* p, size_t n) {
    if (buf.size() + n > kBuffer) {
      write_all(tmp.fd(), buf.data(), buf.size(), path);
      buf.clear();
    }
    if (n >= kBuffer) write_all(tmp.fd(), p, n, path);
    else buf.insert(buf.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
  };
  unsigned char len[8];
  for (int b = 0; b < 8; ++b) len[b] = static_cast<unsigned char>(uint64_t(text.size()) >> (8 * b));
  put(len, 8);
  put(text.data(), text.size());
  std::vector<char> gather;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    if (t.numel() == 0) continue;
    // One tensor at a time on the host, so a device checkpoint never needs a second full copy.
    Tensor host = host_view(t.detach());
    if (host.is_contiguous()) {
      put(host.data_ptr(), host.nbytes());
      continue;
    }
    for_each_run(host, [&](const char* p, size_t n) {
      if (gather.size() + n > kBuffer) {
        put(gather.data(), gather.size());
        gather.clear();
      }
      gather.insert(gather.end(), p, p + n);
    });
    put(gather.data(), gather.size());
    gather.clear();
  }
  write_all(tmp.fd(), buf.data(), buf.size(), path);
  tmp.commit();
}

}  // namespace quilt
