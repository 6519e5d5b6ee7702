// Sharded checkpoints (per-rank safetensors + index, committed by rename), resharding loads that
// read only the needed blocks, and Hugging Face consolidated export/import (with per-expert
// tensors mapped to grouped ones).
//
// Integrity. Every chunk's bytes carry an XXH3-64 checksum, computed on the rank that writes
// the chunk and stored in the shard file's metadata and in the index. A rank verifies a chunk
// the first time a load reads any block of it: it reads that chunk whole (once per load, so a
// resharding load may read more than its block), hashes it and cuts its block from it; later
// blocks of the same chunk are read alone. So every byte a rank uses was verified, with one
// checksum per chunk. On that first use the chunk is also cross-checked against the shard
// file's own header and metadata (tensor, dtype, offset, shape, checksum), which catches an
// index that points at the wrong file. Every floating block read is checked finite. index.json
// is parsed strictly (each field type-checked, named in errors). Checkpoints of format
// quilt-dcp/1 (before checksums) still load, unverified, with a note. A failed save removes
// "<dir>.tmp" and leaves earlier checkpoints as they were.
#include "dtensor/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <xxhash.h>

#include <algorithm>
#include <cassert>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "collectives/agree.h"
#include "collectives/launch.h"
#include "dtensor/dtensor.h"
#include "dtensor/sharding.h"
#include "engine/autograd.h"
#include "engine/io/safetensors.h"
#include "engine/ops/creation.h"
#include "engine/ops/view.h"

namespace quilt::dtensor {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using quilt::detail::concat;

constexpr const char* kIndexFile = "index.json";
constexpr const char* kFormat = "quilt-dcp/2";       // chunks carry checksums
constexpr const char* kFormatV1 = "quilt-dcp/1";     // before checksums: loads unverified
constexpr const char* kChunksKey = "quilt.chunks";   // shard metadata: tensor -> its chunk's offset
constexpr const char* kSumsKey = "quilt.xxh3_64";    // shard metadata: tensor -> its chunk's checksum
constexpr const char* kSumField = "xxh3_64";         // index: a chunk's checksum, 16 hex digits
constexpr const char* kTensorsKey = "quilt.tensors";  // shard metadata: the writing rank's tensor list
constexpr const char* kMetadataKey = "quilt.metadata";  // shard metadata: the writing rank's metadata

// ---- the fault hook (tests) ----

struct Hook {
  std::mutex mu;
  std::function<void(const std::string&, int)> fn;
};
Hook& fault_hook() {
  static Hook h;
  return h;
}
struct ReadHook {
  std::mutex mu;
  std::function<void(const std::string&, const Shape&, const Shape&, int)> fn;
};
ReadHook& read_hook() {
  static ReadHook h;
  return h;
}

// ---- files ----

std::string strip_slash(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

std::string rank_file(int r) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.safetensors", r);
  return buf;
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Writes `text` to `path` through a temporary name, fsynced, then renamed.
void write_text_atomic(const std::string& path, const std::string& text, const char* op) {
  const std::string part = path + ".part";
  {
    std::ofstream f(part, std::ios::binary | std::ios::trunc);
    QUILT_CHECK(f.good(), "[", op, "] cannot write ", part);
    f << text;
    f.flush();
    QUILT_CHECK(f.good(), "[", op, "] writing ", part, " failed");
  }
  fsync_path(part, false);
  std::error_code ec;
  fs::rename(part, path, ec);
  QUILT_CHECK(!ec, "[", op, "] cannot rename ", part, " to ", path, ": ", ec.message());
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// ---- the source of a load: every tensor's chunks, from an index or a Hugging Face file ----

struct ChunkRec {
  std::string file;  // relative to Source::dir
  Shape offset, shape;
  // One expert of a StackedName: the file entry that holds the chunk, which lacks the chunk's
  // leading dim (of size 1; offset[0] is the expert). Otherwise the entry is the tensor's name.
  std::string entry;
  bool drops_dim0 = false;
  std::string xxh3;  // the checksum of the chunk's bytes (hex); empty: none to verify
};
struct TensorRec {
  Shape shape;
  DType dtype = DType::f32;
  std::string placements;
  std::vector<ChunkRec> chunks;
};
struct Source {
  std::string dir;
  std::string what;  // "checkpoint <dir>" or "<file>" for messages
  bool checkpoint = false;  // ours: the chunks are cross-checked against the shard files' metadata
  std::vector<std::string> order;
  std::map<std::string, TensorRec> tensors;
  int world_size = 0;
  std::map<std::string, std::string> metadata;
};

Shape shape_of(const json& j) { return j.get<std::vector<int64_t>>(); }

// j as a shape or offset (an array of non-negative integers), or nullopt.
std::optional<Shape> as_shape(const json& j) {
  if (!j.is_array()) return std::nullopt;
  Shape s;
  for (const json& x : j) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0) return std::nullopt;
    s.push_back(x.get<int64_t>());
  }
  return s;
}

// As checksum() writes them: 16 lowercase hex digits.
bool is_checksum(const std::string& s) {
  const auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
  return s.size() == 16 && std::all_of(s.begin(), s.end(), hex);
}

// Typed reads of index.json fields; each error names the file and the field ("tensors[3].chunks[0].offset").
struct IndexFields {
  std::string where;  // "[op] <dir>/index.json: "

  static std::string field(const std::string& parent, const std::string& key) {
    return parent.empty() ? key : parent + "." + key;
  }
  const json& get(const json& obj, const std::string& parent, const std::string& key) const {
    QUILT_CHECK(obj.contains(key), where, field(parent, key), " is missing");
    return obj.at(key);
  }
  std::string string(const json& obj, const std::string& parent, const std::string& key) const {
    const json& v = get(obj, parent, key);
    QUILT_CHECK(v.is_string(), where, field(parent, key), " must be a string");
    return v.get<std::string>();
  }
  Shape shape(const json& obj, const std::string& parent, const std::string& key) const {
    const std::optional<Shape> s = as_shape(get(obj, parent, key));
    QUILT_CHECK(s.has_value(), where, field(parent, key), " must be an array of non-negative integers");
    return *s;
  }
  const json& of_type(const json& v, json::value_t type, const std::string& name, const char* what) const {
    QUILT_CHECK(v.type() == type, where, name, " must be ", what);
    return v;
  }
};

Source read_index(const std::string& dir_in, const char* op) {
  const std::string dir = strip_slash(dir_in);
  const std::string path = dir + "/" + kIndexFile;
  QUILT_CHECK(fs::is_regular_file(path), "[", op, "] ", dir, " is not a complete checkpoint (no ", kIndexFile,
              "; an interrupted save leaves only ", dir, ".tmp)");
  Source s;
  s.dir = dir;
  s.what = "checkpoint " + dir;
  s.checkpoint = true;
  json j;
  try {
    j = json::parse(read_text(path));
  } catch (const json::exception& e) {
    fail("[", op, "] ", path, " is not a valid checkpoint index: ", e.what());
  }
  const IndexFields f{concat("[", op, "] ", path, ": ")};
  f.of_type(j, json::value_t::object, "the index", "a JSON object");
  const std::string format = f.string(j, "", "format");
  QUILT_CHECK(format == kFormat || format == kFormatV1, f.where, "format '", format, "' is not one this build reads (",
              kFormat, ", or ", kFormatV1, " without checksums)");
  if (format == kFormatV1) {
    static std::once_flag note;
    std::call_once(note, [&] {
      log_line("[", op, "] ", dir, " predates chunk checksums (", kFormatV1, "): loading it unverified");
    });
  }
  const json& world = f.get(j, "", "world_size");
  QUILT_CHECK(world.is_number_integer() && world.get<int64_t>() > 0 && world.get<int64_t>() <= INT32_MAX, f.where,
              "world_size must be a positive integer");
  s.world_size = world.get<int>();
  const json& meta = f.of_type(f.get(j, "", "metadata"), json::value_t::object, "metadata", "an object");
  for (const auto& [k, v] : meta.items()) s.metadata[k] = f.string(meta, "metadata", k);
  const json& tensors = f.of_type(f.get(j, "", "tensors"), json::value_t::array, "tensors", "an array");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string ti = "tensors[" + std::to_string(i) + "]";
    const json& t = f.of_type(tensors[i], json::value_t::object, ti, "an object");
    const std::string name = f.string(t, ti, "name");
    QUILT_CHECK(!s.tensors.count(name), f.where, ti, ".name '", name, "' appears twice");
    TensorRec r;
    r.shape = f.shape(t, ti, "shape");
    r.dtype = parse_safetensors_dtype(f.string(t, ti, "dtype"), f.where + ti + ".dtype");
    r.placements = f.string(t, ti, "placements");
    const json& chunks = f.of_type(f.get(t, ti, "chunks"), json::value_t::array, ti + ".chunks", "an array");
    int64_t held = 0;
    for (size_t k = 0; k < chunks.size(); ++k) {
      const std::string ci = ti + ".chunks[" + std::to_string(k) + "]";
      const json& cj = f.of_type(chunks[k], json::value_t::object, ci, "an object");
      ChunkRec c{f.string(cj, ci, "file"), f.shape(cj, ci, "offset"), f.shape(cj, ci, "shape"), "", false, ""};
      QUILT_CHECK(!c.file.empty() && c.file.find('/') == std::string::npos && c.file != "." && c.file != "..", f.where,
                  ci, ".file must name a file in ", dir, ", not '", c.file, "'");
      bool inside = c.offset.size() == r.shape.size() && c.shape.size() == r.shape.size();
      for (size_t d = 0; inside && d < r.shape.size(); ++d) inside = c.shape[d] <= r.shape[d] - c.offset[d];
      QUILT_CHECK(inside, f.where, ci, " (", c.file, ", offset ", c.offset, ", shape ", c.shape,
                  ") is not inside the tensor's shape ", r.shape);
      if (format == kFormat) {
        c.xxh3 = f.string(cj, ci, kSumField);
        QUILT_CHECK(is_checksum(c.xxh3), f.where, ci, ".", kSumField, " must be 16 lowercase hex digits, not '",
                    c.xxh3, "'");
      }
      held += numel_of(c.shape);
      r.chunks.push_back(std::move(c));
    }
    QUILT_CHECK(held == numel_of(r.shape), f.where, ti, ".chunks hold ", held, " of the tensor's ", numel_of(r.shape),
                " elements");
    s.order.push_back(name);
    s.tensors[name] = std::move(r);
  }
  return s;
}

void add_file_entries(Source& s, const std::string& file, const std::vector<std::string>* only, const char* op) {
  const SafetensorsIndex idx = read_safetensors_index(s.dir + "/" + file);
  for (const SafetensorsEntry& e : idx.entries) {
    if (only && std::find(only->begin(), only->end(), e.name) == only->end()) continue;
    TensorRec r;
    r.shape = e.shape;
    r.dtype = e.dtype;
    r.placements = "plain";
    r.chunks.push_back({file, Shape(e.shape.size(), 0), e.shape, "", false, ""});
    s.order.push_back(e.name);
    s.tensors[e.name] = std::move(r);
  }
}

Source read_hf(const std::string& path, const char* op) {
  Source s;
  s.dir = fs::path(path).parent_path().string();
  if (s.dir.empty()) s.dir = ".";
  s.what = path;
  QUILT_CHECK(fs::is_regular_file(path), "[", op, "] ", path, " does not exist");
  if (path.size() >= 5 && path.substr(path.size() - 5) == ".json") {
    std::map<std::string, std::vector<std::string>> by_file;
    try {
      const json j = json::parse(read_text(path));
      for (const auto& [name, file] : j.at("weight_map").items()) by_file[file.get<std::string>()].push_back(name);
    } catch (const json::exception& e) {
      fail("[", op, "] ", path, " is not a valid safetensors index: ", e.what());
    }
    for (const auto& [file, names] : by_file) add_file_entries(s, file, &names, op);
  } else {
    add_file_entries(s, fs::path(path).filename().string(), nullptr, op);
  }
  return s;
}

// ---- Hugging Face per-expert tensors as the chunks of one grouped tensor ----

std::string expert_name(const StackedName& rule, int64_t e) {
  const size_t at = rule.pattern.find("{}");
  return rule.pattern.substr(0, at) + std::to_string(e) + rule.pattern.substr(at + 2);
}

void check_stacks(const std::vector<StackedName>& stacks, const char* op) {
  std::set<std::string> seen;
  for (const StackedName& rule : stacks) {
    const size_t at = rule.pattern.find("{}");
    QUILT_CHECK(at != std::string::npos && rule.pattern.find("{}", at + 2) == std::string::npos, "[", op,
                "] the rule for '", rule.name, "' has pattern '", rule.pattern,
                "', which must hold \"{}\" exactly once");
    QUILT_CHECK(rule.count > 0, "[", op, "] the rule for '", rule.name, "' stacks ", rule.count,
                " experts; it needs at least one");
    QUILT_CHECK(seen.insert(rule.name).second, "[", op, "] two rules stack '", rule.name, "'");
  }
}

// Makes src's record of rule.name the stack of the rule's file tensors: expert e is the chunk
// (1, *rest) at (e, 0, ...), so fill() reads of each expert only the rows a block covers. Every
// expert must be there with the target's shape[1:] and expert 0's dtype, also those this rank
// does not read: a checkpoint missing one is damaged, whichever rank notices.
void stack_experts(Source& src, const StackedName& rule, const Shape& target_shape, int rank, const char* op) {
  QUILT_CHECK(!target_shape.empty() && target_shape[0] == rule.count, "[", op, "] target '", rule.name, "' has shape ",
              target_shape, " but its rule stacks ", rule.count, " experts along dim 0 (rank ", rank, ")");
  const Shape rest(target_shape.begin() + 1, target_shape.end());
  TensorRec rec;
  rec.shape = target_shape;
  rec.placements = "plain";
  for (int64_t e = 0; e < rule.count; ++e) {
    const std::string n = expert_name(rule, e);
    const auto it = src.tensors.find(n);
    QUILT_CHECK(it != src.tensors.end(), "[", op, "] tensor '", n, "' (expert ", e, " of '", rule.name, "') is not in ",
                src.what, " (rank ", rank, ")");
    const TensorRec& x = it->second;
    QUILT_CHECK(x.shape == rest, "[", op, "] tensor '", n, "' (expert ", e, " of '", rule.name, "') has shape ",
                x.shape, " in ", src.what, " but the target's shape ", target_shape, " needs ", rest,
                " per expert (rank ", rank, ")");
    if (e == 0) rec.dtype = x.dtype;
    QUILT_CHECK(x.dtype == rec.dtype, "[", op, "] tensor '", n, "' (expert ", e, " of '", rule.name, "') has dtype ",
                dtype_name(x.dtype), " in ", src.what, " but expert 0 ('", expert_name(rule, 0), "') has dtype ",
                dtype_name(rec.dtype), " (rank ", rank, ")");
    assert(x.chunks.size() == 1);  // a Hugging Face file holds each tensor whole
    ChunkRec c{x.chunks[0].file, Shape(target_shape.size(), 0), target_shape, n, true, ""};
    c.offset[0] = e;
    c.shape[0] = 1;
    rec.chunks.push_back(std::move(c));
  }
  if (!src.tensors.count(rule.name)) src.order.push_back(rule.name);
  src.tensors[rule.name] = std::move(rec);
}

// ---- integrity: checksums, cross-checks, finite values ----

// The XXH3-64 of a contiguous CPU tensor's bytes, as 16 hex digits.
std::string checksum(const Tensor& t) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(XXH3_64bits(t.data_ptr(), t.nbytes())));
  return buf;
}

// Index of the first NaN or Inf (all exponent bits set) among the n values at p, or -1.
template <class U>
int64_t first_non_finite(const void* p, int64_t n, U exponent) {
  const U* v = static_cast<const U*>(p);
  int64_t first = n;
#pragma omp parallel for reduction(min : first) if (n > (int64_t(1) << 16))
  for (int64_t i = 0; i < n; ++i)
    if ((v[i] & exponent) == exponent) first = std::min(first, i);
  return first < n ? first : -1;
}
int64_t first_non_finite(const Tensor& t) {  // t contiguous on the CPU
  switch (t.dtype()) {
    case DType::f32: return first_non_finite<uint32_t>(t.data_ptr(), t.numel(), 0x7f800000u);
    case DType::f64: return first_non_finite<uint64_t>(t.data_ptr(), t.numel(), 0x7ff0000000000000ull);
    case DType::bf16: return first_non_finite<uint16_t>(t.data_ptr(), t.numel(), 0x7f80);
    case DType::f16: return first_non_finite<uint16_t>(t.data_ptr(), t.numel(), 0x7c00);
    default: return -1;
  }
}

// Throws naming the first NaN or Inf of `piece`, read at `start` in the chunk at `offset` in its tensor.
void check_finite(const Tensor& piece, const Shape& offset, const Shape& start, const std::string& where) {
  const int64_t bad = is_floating(piece.dtype()) ? first_non_finite(piece) : -1;
  if (bad < 0) return;
  Shape at(piece.dim());  // the element's place in the tensor
  for (int64_t i = bad, d = piece.dim() - 1; d >= 0; i /= piece.shape()[size_t(d)], --d)
    at[size_t(d)] = offset[size_t(d)] + start[size_t(d)] + i % piece.shape()[size_t(d)];
  const double v = piece.reshape({-1}).narrow(0, bad, 1).item<double>();
  fail(where, ": element ", at, " is ", std::isnan(v) ? "NaN" : v > 0 ? "Inf" : "-Inf",
       " (a floating tensor must load finite values)");
}

// A file a load has opened: its header and, for a shard of a checkpoint, its chunk metadata.
struct OpenFile {
  SafetensorsIndex header;
  json offsets, sums;  // kChunksKey and kSumsKey parsed (tensor -> value); null when absent or malformed
};
// The files a load has opened, and the chunks of them it has checked (see the header comment).
struct OpenFiles {
  std::map<std::string, OpenFile> open;
  std::set<std::string> checked;  // "<file>/<entry>"
};

// Runs f, prefixing `where` to the message of an error it throws.
template <class F>
auto at_chunk(const std::string& where, F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    fail(where, ": ", e.what());
  }
}

const OpenFile& open_file(const Source& src, const std::string& file, OpenFiles& files, const std::string& where) {
  auto it = files.open.find(file);
  if (it != files.open.end()) return it->second;
  OpenFile f{at_chunk(where, [&] { return read_safetensors_index(src.dir + "/" + file); }), nullptr, nullptr};
  auto parse = [&](const char* key) {
    const auto m = f.header.metadata.find(key);
    const json j = m == f.header.metadata.end() ? json(nullptr) : json::parse(m->second, nullptr, false);
    return j.is_object() ? j : json(nullptr);  // a malformed map is discarded (no exception)
  };
  if (src.checkpoint) {
    f.offsets = parse(kChunksKey);
    f.sums = parse(kSumsKey);
  }
  return files.open.emplace(file, std::move(f)).first->second;
}

// The chunk as its shard file describes itself (header and metadata) must be the index's chunk:
// this catches an index that points at the wrong file, e.g. two `file` entries swapped.
void cross_check(const Source& src, const TensorRec& rec, const std::string& name, const ChunkRec& c,
                 const OpenFile& file, const std::string& where) {
  const std::string index = src.dir + "/" + kIndexFile;
  auto disagree = [&](const char* what, const std::string& in_index, const std::string& in_file) {
    fail(where, ": ", index, " and this file disagree on the chunk's ", what, ": ", in_index, " in the index, ",
         in_file, " in the file");
  };
  auto of = [&](const json& map) { return map.is_object() && map.contains(name) ? map.at(name) : json(nullptr); };
  const SafetensorsEntry* e = file.header.find(name);
  if (!e) fail(where, ": ", index, " places the chunk in this file, which holds no tensor '", name, "'");
  if (e->dtype != rec.dtype) disagree("dtype", dtype_name(rec.dtype), dtype_name(e->dtype));
  const std::optional<Shape> offset = as_shape(of(file.offsets));
  if (offset != c.offset) disagree("offset", concat(c.offset), offset ? concat(*offset) : "none");
  if (e->shape != c.shape) disagree("shape", concat(c.shape), concat(e->shape));
  const json sum = of(file.sums);
  if (!c.xxh3.empty() && sum != c.xxh3) disagree("checksum", c.xxh3, sum.is_string() ? sum.get<std::string>() : "none");
}

// ---- filling a target's block from a source ----

int rank_label(const Tensor& t) {
  if (t.is_distributed()) {
    const DeviceMesh& m = mesh_of(t);
    return m.ranks()[size_t(m.rank())];
  }
  return is_initialized() ? launch_info().rank : 0;
}

// "[op] rank R: <file>: tensor 'name' chunk at offset (...)" (or "expert E ('entry')"): the
// place every error about one chunk starts with.
std::string chunk_where(const Source& src, const std::string& name, const ChunkRec& c, const std::string& entry,
                        int rank, const char* op) {
  const std::string part =
      c.drops_dim0 ? concat("expert ", c.offset[0], " ('", entry, "')") : concat("chunk at offset ", c.offset);
  return concat("[", op, "] rank ", rank, ": ", src.dir, "/", c.file, ": tensor '", name, "' ", part);
}

// Reads the block [start, start + sizes) of chunk c, both in the chunk's coordinates (dim 0
// included for an expert, whose file entry lacks it); the result has the block's shape.
Tensor read_block(const SafetensorsIndex& file, const ChunkRec& c, const std::string& entry, Shape start, Shape sizes,
                  int rank, const std::string& where) {
  if (c.drops_dim0) {
    start.erase(start.begin());
    sizes.erase(sizes.begin());
  }
  std::function<void(const std::string&, const Shape&, const Shape&, int)> hook;
  {
    std::lock_guard<std::mutex> lock(read_hook().mu);
    hook = read_hook().fn;
  }
  if (hook) hook(entry, start, sizes, rank);
  Tensor piece = at_chunk(where, [&] { return read_safetensors_block(file, entry, start, sizes); });
  return c.drops_dim0 ? piece.unsqueeze(0) : piece;
}

// Fills `target` with tensor `name` of `src`, or, for a plain target, with the block `region` of it.
void fill(const Source& src, const std::string& name, const Tensor& target, OpenFiles& files, const char* op,
          const Block* region = nullptr) {
  const int rank = rank_label(target);
  QUILT_CHECK(target.defined(), "[", op, "] target '", name, "' is undefined (rank ", rank, ")");
  auto it = src.tensors.find(name);
  if (it == src.tensors.end()) {
    std::string some;
    for (size_t i = 0; i < src.order.size() && i < 8; ++i) some += (i ? ", " : "") + src.order[i];
    fail("[", op, "] tensor '", name, "' is not in ", src.what, " (rank ", rank, "); it holds ", src.order.size(),
         " tensors: ", some, src.order.size() > 8 ? ", ..." : "");
  }
  const TensorRec& rec = it->second;
  QUILT_CHECK(region || rec.shape == target.shape(), "[", op, "] tensor '", name, "' has shape ", rec.shape, " in ",
              src.what, " but the target has shape ", target.shape(), " (rank ", rank, ")");
  assert(!region || (!target.is_distributed() && target.shape() == region->shape));
  NoGradGuard ng;
  Block block = region ? *region : Block{Shape(rec.shape.size(), 0), rec.shape};
  Tensor local = target;
  if (target.is_distributed()) {
    const DistSpec& spec = *target.dist_spec();
    local = target.local();
    block = local_block(spec.shape, spec.mesh.shape(), spec.placements, spec.mesh.coordinate());
    for (size_t a = 0; a < spec.placements.size(); ++a)
      if (spec.placements[a].is_partial(ReduceOp::sum) && spec.mesh.coordinate(int64_t(a)) != 0) {
        local.zero_();  // R -> P(sum): the value lives on coordinate 0
        return;
      }
  }
  int64_t covered = 0;
  for (const ChunkRec& c : rec.chunks) {
    Block inter{block.offset, block.shape};
    bool empty = false;
    for (size_t d = 0; d < block.shape.size(); ++d) {
      const int64_t lo = std::max(block.offset[d], c.offset[d]);
      const int64_t hi = std::min(block.offset[d] + block.shape[d], c.offset[d] + c.shape[d]);
      if (hi <= lo) { empty = true; break; }
      inter.offset[d] = lo;
      inter.shape[d] = hi - lo;
    }
    if (empty || numel_of(inter.shape) == 0) continue;
    const std::string& entry = c.entry.empty() ? name : c.entry;
    const std::string where = chunk_where(src, name, c, entry, rank, op);
    const OpenFile& file = open_file(src, c.file, files, where);
    // The first block of a chunk a load reads: cross-check the chunk and, when it has a checksum,
    // read it whole to verify it (later blocks of it are read alone).
    const bool first = files.checked.insert(c.file + "/" + entry).second;
    if (first && src.checkpoint) cross_check(src, rec, name, c, file, where);
    const bool whole = first && !c.xxh3.empty();
    Shape start(block.shape.size());  // of the intersection, in the chunk
    for (size_t d = 0; d < start.size(); ++d) start[d] = inter.offset[d] - c.offset[d];
    const Shape read_start = whole ? Shape(start.size(), 0) : start;
    Tensor piece = read_block(file.header, c, entry, read_start, whole ? c.shape : inter.shape, rank, where);
    if (whole && checksum(piece) != c.xxh3)
      fail(where, ": checksum mismatch (the file is damaged or was changed after saving)");
    check_finite(piece, c.offset, read_start, where);
    for (size_t d = 0; d < start.size(); ++d)
      piece = piece.narrow(int64_t(d), start[d] - read_start[d], inter.shape[d]);
    Tensor dst = local;
    for (size_t d = 0; d < block.shape.size(); ++d)
      dst = dst.narrow(int64_t(d), inter.offset[d] - block.offset[d], inter.shape[d]);
    dst.copy_(piece);
    covered += numel_of(inter.shape);
  }
  QUILT_CHECK(covered == numel_of(block.shape), "[", op, "] tensor '", name, "' (rank ", rank, "): the chunks in ",
              src.what, " cover ", covered, " of the ", numel_of(block.shape), " elements this rank needs");
}

// Every rank learns whether all succeeded; the failing ranks' own messages are kept. On a
// failure rank 0 removes "<dir>.tmp" (every rank is done writing there), so nothing of it stays.
void agree(Communicator& comm, bool ok, const std::string& msg, const std::string& dir, const std::string& phase) {
  Tensor flag = full({1}, ok ? 1.0 : 0.0, {.dtype = DType::i32, .device = comm.device()});
  comm.all_reduce(flag, ReduceOp::min);
  if (flag.item<int>() == 1) return;
  if (comm.rank() == 0) {
    std::error_code ec;
    fs::remove_all(dir + ".tmp", ec);
  }
  if (!ok) fail("[save_checkpoint] ", dir, ": rank ", comm.rank(), " failed while ", phase, ": ", msg,
                " (nothing was committed)");
  fail("[save_checkpoint] ", dir, ": another rank failed while ", phase, " (nothing was committed)");
}

// Runs f, recording the message of an exception it throws in ok and msg (for agree()).
template <class F>
void attempt(bool& ok, std::string& msg, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    ok = false;
    msg = e.what();
  }
}

// Moves "<dir>.tmp" to dir, replacing an earlier dir, which comes back if the move fails.
void commit(const std::string& tmp, const std::string& dir) {
  const std::string old = dir + ".old";
  const bool replacing = fs::exists(dir);
  std::error_code ec;
  if (replacing) {
    fs::remove_all(old, ec);
    fs::rename(dir, old);
  }
  fs::rename(tmp, dir, ec);
  if (ec) {
    std::error_code back;
    if (replacing) fs::rename(old, dir, back);
    fail("[save_checkpoint] cannot rename ", tmp, " to ", dir, ": ", ec.message());
  }
  if (replacing) fs::remove_all(old, ec);
  const std::string parent = fs::path(dir).parent_path().string();
  fsync_path(parent.empty() ? "." : parent, true);
}

int64_t trailing_number(const std::string& s, bool* has) {
  size_t i = s.size();
  while (i > 0 && std::isdigit(static_cast<unsigned char>(s[i - 1]))) --i;
  *has = i < s.size() && s.size() - i < 19;
  return *has ? std::stoll(s.substr(i)) : 0;
}

}  // namespace

namespace detail {
void set_checkpoint_fault_hook(std::function<void(const std::string& path, int rank)> hook) {
  std::lock_guard<std::mutex> lock(fault_hook().mu);
  fault_hook().fn = std::move(hook);
}
void set_checkpoint_read_hook(
    std::function<void(const std::string& entry, const Shape& start, const Shape& sizes, int rank)> hook) {
  std::lock_guard<std::mutex> lock(read_hook().mu);
  read_hook().fn = std::move(hook);
}
}  // namespace detail

void save_checkpoint(const std::string& dir_in, const StateDict& state, Communicator& comm,
                     const std::map<std::string, std::string>& metadata) {
  const std::string dir = strip_slash(dir_in);
  const std::string tmp = dir + ".tmp";
  const int rank = comm.rank();
  bool ok = true;
  std::string msg;
  // Phase 0: the state is whole on every rank (one rank's undefined tensor fails them all, before
  // the collectives below).
  attempt(ok, msg, [&] {
    std::set<std::string> seen;
    for (const auto& [name, t] : state) {
      QUILT_CHECK(t.defined(), "[save_checkpoint] tensor '", name, "' is undefined");
      QUILT_CHECK(seen.insert(name).second, "[save_checkpoint] tensor name '", name, "' appears twice");
    }
  });
  agree(comm, ok, msg, dir, "checking its tensors");
  // Ranks may hold different tensors (pipeline stages): a plain tensor is written by the lowest
  // rank that holds it.
  std::map<std::string, int> plain_writer;
  {
    std::string names;
    for (const auto& [name, t] : state)
      if (!t.is_distributed()) names += name + "\n";
    const std::vector<std::string> all = all_gather_text(comm, names);
    for (int r = 0; r < comm.size(); ++r) {
      std::istringstream in(all[size_t(r)]);
      for (std::string n; std::getline(in, n);) plain_writer.emplace(n, r);
    }
  }
  // Shards this rank writes: one copy of each block (coordinate 0 of every non-Shard axis).
  std::vector<std::pair<std::string, Tensor>> mine;
  json chunks = json::object();
  json tensors = json::array();
  {
    NoGradGuard ng;
    for (const auto& [name, t0] : state) {
      Tensor t = t0.detach();
      json info = {{"name", name}, {"dtype", safetensors_dtype_name(t.dtype())}, {"shape", t.shape()}};
      if (t.is_distributed()) {
        Placements pl = placements_of(t);
        bool partial = false;
        for (Placement& p : pl)
          if (p.is_partial()) { p = Replicate(); partial = true; }
        if (partial) t = redistribute(t, pl);  // collective over t's mesh, the same order on all ranks
        const DeviceMesh& mesh = mesh_of(t);
        info["placements"] = str(pl);
        info["mesh_shape"] = mesh.shape();
        bool writer = true;
        for (size_t a = 0; a < pl.size(); ++a) writer = writer && (pl[a].is_shard() || mesh.coordinate(int64_t(a)) == 0);
        const Block b = local_block(t.shape(), mesh.shape(), pl, mesh.coordinate());
        if (writer && numel_of(b.shape) > 0) {
          mine.emplace_back(name, t.local());
          chunks[name] = b.offset;
        }
      } else {
        info["placements"] = "plain";
        if (plain_writer.at(name) == rank && t.numel() > 0) {
          mine.emplace_back(name, t);
          chunks[name] = Shape(size_t(t.dim()), 0);
        }
      }
      tensors.push_back(std::move(info));
    }
  }

  // Phase 1: rank 0 prepares an empty temporary directory (an interrupted save may have left one).
  if (rank == 0)
    attempt(ok, msg, [&] {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp);
    });
  agree(comm, ok, msg, dir, "preparing " + tmp);

  // Phase 2: every rank writes its own file (atomically too), with each chunk's checksum.
  attempt(ok, msg, [&] {
    const std::string file = tmp + "/" + rank_file(rank);
    std::function<void(const std::string&, int)> hook;
    {
      std::lock_guard<std::mutex> lock(fault_hook().mu);
      hook = fault_hook().fn;
    }
    if (hook) hook(file, rank);
    json sums = json::object();
    for (auto& [name, t] : mine) {
      t = contiguous(t.to(Device::cpu()));  // hashed and written from the same host bytes
      sums[name] = checksum(t);
    }
    save_safetensors(file, mine, {{kChunksKey, chunks.dump()}, {kSumsKey, sums.dump()}, {kTensorsKey, tensors.dump()},
                                  {kMetadataKey, json(metadata).dump()}});
  });
  agree(comm, ok, msg, dir, "writing its shards");

  // Phase 3: rank 0 writes the index from every rank's file and commits by renaming.
  if (rank == 0)
    attempt(ok, msg, [&] {
      std::map<std::string, json> chunk_lists;  // name -> array of chunks
      // The index lists every rank's tensors and metadata (rank 0's first; pipeline stages add theirs).
      json all_tensors = json::array(), all_metadata = json::object();
      std::map<std::string, std::pair<int, json>> listed;  // name -> (rank, its dtype and shape)
      for (int r = 0; r < comm.size(); ++r) {
        const std::string f = rank_file(r);
        const SafetensorsIndex idx = read_safetensors_index(tmp + "/" + f);
        auto meta = [&](const char* key) {
          const auto m = idx.metadata.find(key);
          QUILT_CHECK(m != idx.metadata.end(), "[save_checkpoint] ", tmp, "/", f, " has no ", key, " metadata");
          return json::parse(m->second);
        };
        const json rank_tensors = meta(kTensorsKey), rank_metadata = meta(kMetadataKey);
        for (const json& t : rank_tensors) {
          const std::string name = t.at("name").get<std::string>();
          const json kind = {t.at("dtype"), t.at("shape")};
          auto [it, fresh] = listed.emplace(name, std::make_pair(r, kind));
          QUILT_CHECK(fresh || it->second.second == kind, "[save_checkpoint] tensor '", name, "' is ",
                      it->second.second.dump(), " on rank ", it->second.first, " but ", kind.dump(), " on rank ", r);
          if (fresh) all_tensors.push_back(t);
        }
        for (auto it = rank_metadata.begin(); it != rank_metadata.end(); ++it)
          if (!all_metadata.contains(it.key())) all_metadata[it.key()] = it.value();
        const json offs = meta(kChunksKey), sums = meta(kSumsKey);
        for (const SafetensorsEntry& e : idx.entries) {
          // A tensor on a sub-mesh is replicated over the ranks outside it, which write the same
          // block again: the index keeps the first copy of each block.
          json& list = chunk_lists[e.name];
          const json off = offs.at(e.name);
          const bool dup = std::any_of(list.begin(), list.end(), [&](const json& c) {
            return c.at("offset") == off && c.at("shape") == json(e.shape);
          });
          if (!dup) list.push_back({{"file", f}, {"offset", off}, {"shape", e.shape}, {kSumField, sums.at(e.name)}});
        }
      }
      for (json& t : all_tensors) {
        const std::string name = t.at("name").get<std::string>();
        t["chunks"] = chunk_lists.count(name) ? chunk_lists[name] : json::array();
        int64_t covered = 0;
        for (const json& c : t["chunks"]) covered += numel_of(shape_of(c.at("shape")));
        QUILT_CHECK(covered == numel_of(shape_of(t.at("shape"))), "[save_checkpoint] tensor '", name, "': the ranks wrote ",
                    covered, " of its ", numel_of(shape_of(t.at("shape"))), " elements");
      }
      json index = {{"format", kFormat}, {"world_size", comm.size()}, {"metadata", all_metadata}, {"tensors", all_tensors}};
      write_text_atomic(tmp + "/" + kIndexFile, index.dump(1), "save_checkpoint");
      fsync_path(tmp, true);
      commit(tmp, dir);
    });
  agree(comm, ok, msg, dir, "committing");
}

void load_checkpoint(const std::string& dir, const StateDict& targets) {
  const Source src = read_index(dir, "load_checkpoint");
  OpenFiles files;
  for (const auto& [name, t] : targets) fill(src, name, t, files, "load_checkpoint");
}

CheckpointInfo read_checkpoint_info(const std::string& dir) {
  const Source src = read_index(dir, "read_checkpoint_info");
  CheckpointInfo info;
  info.dir = src.dir;
  info.world_size = src.world_size;
  info.metadata = src.metadata;
  for (const std::string& n : src.order) {
    const TensorRec& r = src.tensors.at(n);
    info.tensors.push_back({n, r.shape, r.dtype, r.placements});
  }
  return info;
}

std::string latest_checkpoint(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return "";
  std::string best;
  bool best_has = false;
  int64_t best_num = 0;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (!e.is_directory()) continue;
    const std::string name = e.path().filename().string();
    auto ends = [&](const char* suf) {
      const size_t n = std::char_traits<char>::length(suf);
      return name.size() >= n && name.compare(name.size() - n, n, suf) == 0;
    };
    if (ends(".tmp") || ends(".old") || !fs::is_regular_file(e.path() / kIndexFile)) continue;
    bool has = false;
    const int64_t num = trailing_number(name, &has);
    const bool better = best.empty() || (has && !best_has) || (has == best_has && (num > best_num || (num == best_num && name > fs::path(best).filename().string())));
    if (better) {
      best = e.path().string();
      best_has = has;
      best_num = num;
    }
  }
  return best;
}

std::vector<std::string> export_consolidated(const std::string& dir, const std::string& out_path,
                                             uint64_t max_shard_bytes, const std::vector<StackedName>& stacks) {
  const char* op = "export_consolidated";
  check_stacks(stacks, op);
  const Source src = read_index(dir, op);
  std::map<std::string, const StackedName*> rule_of;
  for (const StackedName& rule : stacks) {
    const auto it = src.tensors.find(rule.name);
    QUILT_CHECK(it != src.tensors.end(), "[", op, "] the rule for '", rule.name, "' names no tensor of ", src.what);
    const Shape& shape = it->second.shape;
    QUILT_CHECK(!shape.empty() && shape[0] == rule.count, "[", op, "] tensor '", rule.name, "' has shape ", shape, " in ",
                src.what, " but its rule stacks ", rule.count, " experts along dim 0");
    rule_of[rule.name] = &rule;
  }
  // What the files hold, in order: whole tensors, or the experts of a stacked one in its place
  // (expert e is its block (1, *rest) at (e, 0, ...)).
  struct Item {
    std::string out_name, src_name;
    int64_t expert = -1;  // -1: the whole tensor
    uint64_t bytes = 0;
  };
  std::vector<Item> items;
  for (const std::string& n : src.order) {
    const TensorRec& r = src.tensors.at(n);
    const uint64_t bytes = uint64_t(numel_of(r.shape)) * dtype_size(r.dtype);
    const auto ru = rule_of.find(n);
    if (ru == rule_of.end()) {
      items.push_back({n, n, -1, bytes});
      continue;
    }
    for (int64_t e = 0; e < ru->second->count; ++e)
      items.push_back({expert_name(*ru->second, e), n, e, bytes / uint64_t(ru->second->count)});
  }
  {
    std::map<std::string, std::string> from;  // output name -> the tensor it comes from
    for (const Item& it : items) {
      const auto [at, fresh] = from.emplace(it.out_name, it.src_name);
      QUILT_CHECK(fresh, "[", op, "] two tensors would be written as '", it.out_name, "': from '", at->second, "' and '",
                  it.src_name, "' of ", src.what);
    }
  }
  // Files of at most max_shard_bytes (a larger tensor gets a file of its own).
  std::vector<std::vector<const Item*>> groups(1);
  uint64_t in_group = 0, total = 0;
  for (const Item& it : items) {
    if (!groups.back().empty() && in_group + it.bytes > max_shard_bytes) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(&it);
    in_group += it.bytes;
    total += it.bytes;
  }
  const fs::path out(out_path);
  if (!out.parent_path().empty()) fs::create_directories(out.parent_path());
  std::string stem = out.filename().string();
  if (stem.size() > 12 && stem.substr(stem.size() - 12) == ".safetensors") stem = stem.substr(0, stem.size() - 12);
  std::vector<std::string> written;
  json weight_map = json::object();
  OpenFiles files;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const Item* it : groups[g]) {
      const TensorRec& r = src.tensors.at(it->src_name);
      if (it->expert < 0) {
        Tensor t = Tensor::empty(r.shape, {.dtype = r.dtype});
        fill(src, it->src_name, t, files, op);
        tensors.emplace_back(it->out_name, t);
        continue;
      }
      Block region{Shape(r.shape.size(), 0), r.shape};
      region.offset[0] = it->expert;
      region.shape[0] = 1;
      Tensor t = Tensor::empty(region.shape, {.dtype = r.dtype});
      fill(src, it->src_name, t, files, op, &region);
      tensors.emplace_back(it->out_name, t.squeeze(0));
    }
    std::string path = out_path;
    if (groups.size() > 1) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", g + 1, groups.size());
      path = (out.parent_path() / (stem + buf)).string();
      for (const Item* it : groups[g]) weight_map[it->out_name] = fs::path(path).filename().string();
    }
    save_safetensors(path, tensors, {{"format", "pt"}});
    written.push_back(path);
  }
  if (groups.size() > 1) {
    const std::string index_path = (out.parent_path() / (stem + ".safetensors.index.json")).string();
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_text_atomic(index_path, index.dump(2), op);
    written.push_back(index_path);
  }
  return written;
}

void import_consolidated(const std::string& path, const StateDict& targets, const std::vector<StackedName>& stacks) {
  const char* op = "import_consolidated";
  check_stacks(stacks, op);
  Source src = read_hf(path, op);
  for (const StackedName& rule : stacks) {
    const auto t = std::find_if(targets.begin(), targets.end(), [&](const auto& nt) { return nt.first == rule.name; });
    if (t != targets.end() && t->second.defined())
      stack_experts(src, rule, t->second.shape(), rank_label(t->second), op);
  }
  OpenFiles files;
  for (const auto& [name, t] : targets) fill(src, name, t, files, op);
}

}  // namespace quilt::dtensor
