// Token shards (llm.c / nanoGPT formats), the memory-mapped dataset, the data loader and
// `quilt data prepare`.
#include "tools/data.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "engine/error.h"
#include "tools/tokenizer.h"

namespace quilt {

namespace fs = std::filesystem;

namespace {

const char* nanogpt_hint = "for raw nanoGPT uint16 .bin files set data.format: nanogpt";

// ---- a keyed permutation of [0, n) without storing it ----------------------------------------

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A balanced Feistel network over 2h bits (2^2h >= n) with cycle-walking back into [0, n): a
// bijection of [0, n) computed per element, so an epoch of any size costs no memory and any
// position can be looked up directly (resume, dp slicing).
class Permutation {
 public:
  Permutation(uint64_t n, uint64_t key) : n_(n) {
    int bits = 1;
    while (bits < 64 && (uint64_t(1) << bits) < n) ++bits;
    half_ = (bits + 1) / 2;
    mask_ = (uint64_t(1) << half_) - 1;
    for (int i = 0; i < kRounds; ++i) keys_[i] = mix64(key + 0x632be59bd9b4e019ull * (i + 1));
  }
  uint64_t operator()(uint64_t x) const {
    do x = encrypt(x);
    while (x >= n_);
    return x;
  }

 private:
  static constexpr int kRounds = 4;
  uint64_t encrypt(uint64_t x) const {
    uint64_t l = x >> half_, r = x & mask_;
    for (int i = 0; i < kRounds; ++i) {
      uint64_t f = mix64(r ^ keys_[i]) & mask_;
      uint64_t nl = r;
      r = l ^ f;
      l = nl;
    }
    return (l << half_) | r;
  }
  uint64_t n_;
  int half_ = 1;
  uint64_t mask_ = 1;
  uint64_t keys_[kRounds] = {};
};

std::string errno_text() { return std::strerror(errno); }

// Writes bytes to `path` through a temporary name, so readers never see a partial file.
void write_file_atomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& parts) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    QUILT_CHECK(out.good(), "[data] cannot write '", tmp, "': ", errno_text());
    for (const auto& [p, n] : parts) out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
    out.close();
    QUILT_CHECK(out.good(), "[data] writing '", tmp, "' failed: ", errno_text());
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  QUILT_CHECK(!ec, "[data] cannot rename '", tmp, "' to '", path, "': ", ec.message());
}

}  // namespace

// ---- shard files -------------------------------------------------------------------------------

void write_token_shard(const std::string& path, std::span<const uint32_t> tokens, bool force_u32) {
  QUILT_CHECK(tokens.size() <= static_cast<size_t>(INT32_MAX), "[data] ", path, ": ", tokens.size(),
              " tokens do not fit one shard (the header's count is an int32); write several shards");
  bool wide = force_u32;
  for (uint32_t t : tokens) wide = wide || t > 0xffffu;
  std::vector<int32_t> header(kShardHeaderInts, 0);
  header[0] = wide ? kShardMagicU32 : kShardMagicU16;
  header[1] = wide ? kShardVersionU32 : kShardVersionU16;
  header[2] = static_cast<int32_t>(tokens.size());
  if (wide) {
    write_file_atomically(path, {{header.data(), header.size() * 4}, {tokens.data(), tokens.size() * 4}});
  } else {
    std::vector<uint16_t> narrow(tokens.begin(), tokens.end());
    write_file_atomically(path, {{header.data(), header.size() * 4}, {narrow.data(), narrow.size() * 2}});
  }
}

ShardInfo read_shard_info(const std::string& path, DataFormat format) {
  std::error_code ec;
  const auto size = static_cast<int64_t>(fs::file_size(path, ec));
  QUILT_CHECK(!ec, "[data] cannot open token shard '", path, "': ", ec.message());
  ShardInfo info;
  info.path = path;
  if (format == DataFormat::kNanogpt) {
    QUILT_CHECK(size % 2 == 0, "[data] ", path, ": ", size, " bytes is not a whole number of uint16 tokens "
                "(truncated nanoGPT file?)");
    info.token_bytes = 2;
    info.num_tokens = size / 2;
    info.data_offset = 0;
    return info;
  }
  QUILT_CHECK(size >= kShardHeaderBytes, "[data] ", path, ": file is ", size, " bytes, shorter than the ",
              kShardHeaderBytes, "-byte llm.c shard header (truncated? ", nanogpt_hint, ")");
  int32_t header[3] = {};
  {
    std::ifstream in(path, std::ios::binary);
    QUILT_CHECK(in.good(), "[data] cannot open token shard '", path, "'");
    in.read(reinterpret_cast<char*>(header), sizeof(header));
    QUILT_CHECK(in.good(), "[data] cannot read the header of '", path, "'");
  }
  if (header[0] == kShardMagicU16) {
    QUILT_CHECK(header[1] == kShardVersionU16, "[data] ", path, ": magic ", kShardMagicU16, " (uint16 tokens) with ",
                "version ", header[1], "; expected version ", kShardVersionU16);
    info.token_bytes = 2;
  } else if (header[0] == kShardMagicU32) {
    QUILT_CHECK(header[1] == kShardVersionU32, "[data] ", path, ": magic ", kShardMagicU32, " (uint32 tokens) with ",
                "version ", header[1], "; expected version ", kShardVersionU32);
    info.token_bytes = 4;
  } else {
    fail("[data] ", path, ": bad magic ", header[0], " (expected ", kShardMagicU16, " for uint16 tokens or ",
         kShardMagicU32, " for uint32 tokens; ", nanogpt_hint, ")");
  }
  QUILT_CHECK(header[2] >= 0, "[data] ", path, ": negative token count ", header[2], " in the header");
  info.num_tokens = header[2];
  info.data_offset = kShardHeaderBytes;
  const int64_t expected = kShardHeaderBytes + info.num_tokens * info.token_bytes;
  QUILT_CHECK(size >= expected, "[data] ", path, ": truncated: the header declares ", info.num_tokens, " tokens (",
              expected, " bytes with the header) but the file is ", size, " bytes");
  QUILT_CHECK(size == expected, "[data] ", path, ": ", size - expected, " bytes follow the ", info.num_tokens,
              " tokens the header declares (", expected, " bytes); the file is not one llm.c shard");
  return info;
}

TokenShard::TokenShard(const std::string& path, DataFormat format) : info_(read_shard_info(path, format)) {
  const size_t bytes = static_cast<size_t>(info_.data_offset + info_.num_tokens * info_.token_bytes);
  if (info_.num_tokens == 0) return;
  int fd = ::open(path.c_str(), O_RDONLY);
  QUILT_CHECK(fd >= 0, "[data] cannot open token shard '", path, "': ", errno_text());
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string err = p == MAP_FAILED ? errno_text() : "";
  ::close(fd);
  QUILT_CHECK(p != MAP_FAILED, "[data] cannot map token shard '", path, "': ", err);
  map_ = p;
  map_bytes_ = bytes;
  tokens_ = static_cast<const unsigned char*>(p) + info_.data_offset;
}

TokenShard::~TokenShard() {
  if (map_) ::munmap(map_, map_bytes_);
}

TokenShard::TokenShard(TokenShard&& o) noexcept
    : info_(std::move(o.info_)), map_(o.map_), map_bytes_(o.map_bytes_), tokens_(o.tokens_) {
  o.map_ = nullptr;
  o.map_bytes_ = 0;
  o.tokens_ = nullptr;
}

uint32_t TokenShard::operator[](int64_t i) const {
  // Shards are little-endian on disk, as is every host Quilt runs on.
  if (info_.token_bytes == 2) {
    uint16_t v;
    std::memcpy(&v, tokens_ + i * 2, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, tokens_ + i * 4, 4);
  return v;
}

void TokenShard::read(int64_t start, int64_t count, int64_t* out) const {
  QUILT_CHECK(start >= 0 && count >= 0 && start + count <= info_.num_tokens, "[data] ", info_.path,
              ": tokens [", start, ", ", start + count, ") are outside the shard's ", info_.num_tokens);
  if (info_.token_bytes == 2) {
    for (int64_t i = 0; i < count; ++i) {
      uint16_t v;
      std::memcpy(&v, tokens_ + (start + i) * 2, 2);
      out[i] = v;
    }
  } else {
    for (int64_t i = 0; i < count; ++i) {
      uint32_t v;
      std::memcpy(&v, tokens_ + (start + i) * 4, 4);
      out[i] = v;
    }
  }
}

// ---- the dataset ------------------------------------------------------------------------------

std::vector<std::string> resolve_data_files(const std::string& path) {
  std::vector<std::string> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec))
      if (e.path().extension() == ".bin" && fs::is_regular_file(e.path())) files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    QUILT_CHECK(!files.empty(), "[data] directory '", path, "' holds no *.bin token shards "
                "(make them with `quilt data prepare`)");
    return files;
  }
  if (path.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    int rc = ::glob(path.c_str(), 0, nullptr, &g);
    if (rc == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i)
        if (fs::is_regular_file(g.gl_pathv[i])) files.push_back(g.gl_pathv[i]);
    ::globfree(&g);
    std::sort(files.begin(), files.end());
    QUILT_CHECK(!files.empty(), "[data] '", path, "' matches no files (make them with `quilt data prepare`)");
    return files;
  }
  QUILT_CHECK(fs::is_regular_file(path, ec), "[data] '", path, "' is neither a file, a directory nor a glob "
              "that matches files (make shards with `quilt data prepare`)");
  return {path};
}

TokenDataset::TokenDataset(const std::string& path, DataFormat format) : path_(path) {
  for (const std::string& f : resolve_data_files(path)) shards_.emplace_back(f, format);
}

int64_t TokenDataset::num_tokens() const {
  int64_t n = 0;
  for (const TokenShard& s : shards_) n += s.size();
  return n;
}

int64_t TokenDataset::num_windows(int64_t seq_len) const {
  QUILT_CHECK(seq_len >= 1, "[data] seq_len must be >= 1, got ", seq_len);
  int64_t n = 0;
  for (const TokenShard& s : shards_) n += s.size() > 0 ? (s.size() - 1) / seq_len : 0;
  return n;
}

void TokenDataset::read_window(int64_t w, int64_t seq_len, int64_t* out) const {
  QUILT_CHECK(w >= 0, "[data] window ", w, " is negative");
  int64_t left = w;
  for (const TokenShard& s : shards_) {
    const int64_t n = s.size() > 0 ? (s.size() - 1) / seq_len : 0;
    if (left < n) {
      s.read(left * seq_len, seq_len + 1, out);
      return;
    }
    left -= n;
  }
  fail("[data] window ", w, " is past the ", num_windows(seq_len), " windows of ", path_);
}

std::vector<int64_t> TokenDataset::document_starts(int64_t document_token) const {
  std::vector<int64_t> starts;
  int64_t base = 0;
  for (const TokenShard& s : shards_) {
    for (int64_t i = 0; i < s.size(); ++i)
      if (base + i == 0 || int64_t(s[i]) == document_token) starts.push_back(base + i);
    base += s.size();
  }
  return starts;
}

void TokenDataset::read_tokens(int64_t start, int64_t count, int64_t* out) const {
  QUILT_CHECK(start >= 0 && count >= 0 && start + count <= num_tokens(), "[data] tokens [", start, ", ",
              start + count, ") are outside the ", num_tokens(), " tokens of ", path_);
  int64_t base = 0;
  for (const TokenShard& s : shards_) {
    if (count == 0) return;
    if (start < base + s.size()) {
      const int64_t n = std::min(count, base + s.size() - start);
      s.read(start - base, n, out);
      out += n, start += n, count -= n;
    }
    base += s.size();
  }
}

void TokenDataset::check_vocab(int64_t vocab_size, const std::string& key) const {
  for (const TokenShard& s : shards_) {
    uint32_t hi = 0;
    int64_t at = 0;
    for (int64_t i = 0; i < s.size(); ++i) {
      const uint32_t t = s[i];
      if (t > hi) hi = t, at = i;
    }
    QUILT_CHECK(s.size() == 0 || hi < vocab_size, "[data] ", s.info().path, " holds token ", hi, " (at position ",
                at, "), outside ", key, " ", vocab_size);
  }
}

// ---- the loader -------------------------------------------------------------------------------

std::string LoaderState::to_json() const {
  nlohmann::json j = {{"position", position}, {"seed", seed},       {"seq_len", seq_len},
                      {"num_windows", num_windows}, {"shuffle", shuffle}};
  if (packed_sequence_size > 0) {
    j["packed_sequence_size"] = packed_sequence_size;
    j["num_documents"] = num_documents;
    j["offset"] = offset;
  }
  return j.dump();
}

LoaderState LoaderState::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("[data] loader state is not valid JSON: ", e.what());
  }
  QUILT_CHECK(j.is_object(), "[data] loader state must be a JSON object, got ", j.dump());
  LoaderState s;
  auto field = [&](const char* name, auto& out) {
    QUILT_CHECK(j.contains(name), "[data] loader state has no field '", name, "'");
    try {
      j.at(name).get_to(out);
    } catch (const nlohmann::json::exception&) {
      fail("[data] loader state field '", name, "' has the wrong type: ", j.at(name).dump());
    }
  };
  field("position", s.position);
  field("seed", s.seed);
  field("seq_len", s.seq_len);
  field("num_windows", s.num_windows);
  field("shuffle", s.shuffle);
  // States without packing (and those saved before it existed) have none of these.
  if (j.contains("packed_sequence_size")) {
    field("packed_sequence_size", s.packed_sequence_size);
    field("num_documents", s.num_documents);
    field("offset", s.offset);
  }
  QUILT_CHECK(s.position >= 0, "[data] loader state position must be >= 0, got ", s.position);
  QUILT_CHECK(s.offset >= 0, "[data] loader state offset must be >= 0, got ", s.offset);
  return s;
}

DataLoader::DataLoader(std::shared_ptr<const TokenDataset> data, LoaderOptions options)
    : data_(std::move(data)), opts_(options) {
  QUILT_CHECK(data_ != nullptr, "[data] DataLoader needs a dataset");
  const LoaderOptions& o = opts_;
  QUILT_CHECK(o.seq_len >= 1 && o.micro_batch_size >= 1 && o.global_batch_size >= 1 && o.dp_size >= 1,
              "[data] seq_len, micro_batch_size, global_batch_size and dp_size must be >= 1, got ", o.seq_len, ", ",
              o.micro_batch_size, ", ", o.global_batch_size, ", ", o.dp_size);
  QUILT_CHECK(o.dp_rank >= 0 && o.dp_rank < o.dp_size, "[data] dp_rank ", o.dp_rank, " is outside [0, dp_size ",
              o.dp_size, ")");
  QUILT_CHECK(o.global_batch_size % (o.micro_batch_size * o.dp_size) == 0, "[data] global_batch_size ",
              o.global_batch_size, " is not divisible by micro_batch_size * dp_size = ", o.micro_batch_size, " * ",
              o.dp_size, " = ", o.micro_batch_size * o.dp_size);
  if (packed()) {
    QUILT_CHECK(o.packed_sequence_size == o.seq_len, "[data] packed_sequence_size ", o.packed_sequence_size,
                " differs from seq_len ", o.seq_len, ": packed rows are seq_len tokens");
    QUILT_CHECK(o.document_token >= 0, "[data] packing needs document_token, the token that begins every "
                "document (the tokenizer's end-of-text), got ", o.document_token);
    QUILT_CHECK(o.document_multiple >= 1 && o.seq_len % o.document_multiple == 0, "[data] document_multiple ",
                o.document_multiple, " does not divide the packed row length ", o.seq_len);
    starts_ = data_->document_starts(o.document_token);
    bool any = false;  // a lone token has no target: a stream of only those would pack nothing
    for (int64_t d = 0; d < num_documents() && !any; ++d) any = document(d).second >= 2;
    QUILT_CHECK(any, "[data] ", data_->path(), ": ", data_->num_tokens(), " tokens in ", num_documents(),
                " document(s) (split at token ", o.document_token, ") hold no document of two tokens or more");
    return;
  }
  num_windows_ = data_->num_windows(o.seq_len);
  QUILT_CHECK(num_windows_ > 0, "[data] ", data_->path(), ": ", data_->num_tokens(), " tokens in ",
              data_->num_shards(), " shard(s) make no window of seq_len + 1 = ", o.seq_len + 1, " tokens");
}

namespace {

// Item of stream position p over n items: epoch p / n is a permutation keyed by (seed, epoch).
int64_t stream_item(int64_t p, int64_t n, uint64_t seed, bool shuffle) {
  QUILT_CHECK(p >= 0, "[data] stream position ", p, " is negative");
  const int64_t idx = p % n;
  if (!shuffle) return idx;
  const uint64_t epoch = static_cast<uint64_t>(p / n);
  Permutation perm(static_cast<uint64_t>(n), mix64(seed ^ mix64(epoch + 0x5851f42d4c957f2dull)));
  return static_cast<int64_t>(perm(static_cast<uint64_t>(idx)));
}

}  // namespace

int64_t DataLoader::window_at(int64_t p) const {
  QUILT_CHECK(!packed(), "[data] a packing loader reads documents, not windows (use document_at)");
  return stream_item(p, num_windows_, opts_.seed, opts_.shuffle);
}

int64_t DataLoader::document_at(int64_t p) const {
  QUILT_CHECK(packed(), "[data] a loader without packing reads windows, not documents (use window_at)");
  return stream_item(p, num_documents(), opts_.seed, opts_.shuffle);
}

std::pair<int64_t, int64_t> DataLoader::document(int64_t id) const {
  const int64_t start = starts_[size_t(id)];
  const int64_t end = id + 1 < num_documents() ? starts_[size_t(id + 1)] : data_->num_tokens();
  return {start, end - start};
}

PackedStep DataLoader::packed_step(int64_t position, int64_t offset) const {
  QUILT_CHECK(packed(), "[data] packed_step needs packing (packed_sequence_size > 0)");
  const int64_t n = opts_.seq_len, multiple = opts_.document_multiple;
  PackedStep step;
  step.rows.resize(size_t(opts_.global_batch_size));
  int64_t start = 0, length = 0;
  std::tie(start, length) = document(document_at(position));
  QUILT_CHECK(offset >= 0 && offset < length, "[data] offset ", offset, " is outside document ",
              document_at(position), " (", length, " tokens) at stream position ", position);
  auto advance = [&](int64_t taken) {
    offset += taken;
    if (offset == length) {
      ++position, offset = 0;
      std::tie(start, length) = document(document_at(position));
    }
  };
  for (std::vector<PackedPiece>& row : step.rows) {
    int64_t used = 0;
    while (used < n) {
      // A lone token (a one-token document, a long document's last token) has no target.
      if (length - offset == 1) {
        advance(1);
        continue;
      }
      const int64_t piece = std::min(length - offset, n);
      const int64_t padded = (piece + multiple - 1) / multiple * multiple;
      if (used + padded > n) break;
      row.push_back({start + offset, piece, padded});
      used += padded;
      advance(piece);
    }
  }
  step.end_position = position;
  step.end_offset = offset;
  return step;
}

Batch DataLoader::packed_batch(const PackedStep& step, int64_t micro) const {
  QUILT_CHECK(micro >= 0 && micro < accumulation_steps(), "[data] micro-step ", micro, " is outside [0, ",
              accumulation_steps(), ")");
  QUILT_CHECK(int64_t(step.rows.size()) == opts_.global_batch_size, "[data] a packed step of ", step.rows.size(),
              " rows for global_batch_size ", opts_.global_batch_size);
  const int64_t mb = opts_.micro_batch_size, t = opts_.seq_len;
  Batch b;
  b.inputs = Tensor::empty({mb, t}, {.dtype = DType::i64});
  b.targets = Tensor::empty({mb, t}, {.dtype = DType::i64});
  b.positions = Tensor::empty({mb, t}, {.dtype = DType::i64});
  b.document_ids = Tensor::empty({mb, t}, {.dtype = DType::i64});
  std::vector<int64_t> tokens(static_cast<size_t>(t));
  const int64_t first = micro * mb * opts_.dp_size + opts_.dp_rank * mb;
  for (int64_t i = 0; i < mb; ++i) {
    int64_t* in = b.inputs.data<int64_t>() + i * t;
    int64_t* tg = b.targets.data<int64_t>() + i * t;
    int64_t* pos = b.positions.data<int64_t>() + i * t;
    int64_t* doc = b.document_ids.data<int64_t>() + i * t;
    // Padding: the document token as input, no target; a document's own padding keeps its id
    // and continues its positions, so it comes after every real token of it and none sees it.
    std::fill(in, in + t, opts_.document_token);
    std::fill(tg, tg + t, int64_t(-100));
    int64_t at = 0, id = 0;
    for (const PackedPiece& p : step.rows[size_t(first + i)]) {
      data_->read_tokens(p.start, p.length, tokens.data());
      std::copy(tokens.begin(), tokens.begin() + p.length, in + at);
      std::copy(tokens.begin() + 1, tokens.begin() + p.length, tg + at);
      for (int64_t j = 0; j < p.padded; ++j) pos[at + j] = j, doc[at + j] = id;
      at += p.padded, ++id;
    }
    for (int64_t j = at; j < t; ++j) pos[j] = j - at, doc[j] = id;  // the row's tail: a document of its own
  }
  return b;
}

std::vector<int64_t> DataLoader::global_windows(int64_t position) const {
  std::vector<int64_t> w(static_cast<size_t>(opts_.global_batch_size));
  for (int64_t j = 0; j < opts_.global_batch_size; ++j) w[j] = window_at(position + j);
  return w;
}

std::vector<int64_t> DataLoader::rank_windows(int64_t position, int64_t micro) const {
  QUILT_CHECK(micro >= 0 && micro < accumulation_steps(), "[data] micro-step ", micro, " is outside [0, ",
              accumulation_steps(), ")");
  const int64_t mb = opts_.micro_batch_size;
  const int64_t first = position + micro * mb * opts_.dp_size + opts_.dp_rank * mb;
  std::vector<int64_t> w(static_cast<size_t>(mb));
  for (int64_t i = 0; i < mb; ++i) w[i] = window_at(first + i);
  return w;
}

Batch DataLoader::batch_at(int64_t position, int64_t micro) const {
  if (packed()) return packed_batch(packed_step(position, 0), micro);
  const int64_t mb = opts_.micro_batch_size, t = opts_.seq_len;
  Batch b;
  b.inputs = Tensor::empty({mb, t}, {.dtype = DType::i64});
  b.targets = Tensor::empty({mb, t}, {.dtype = DType::i64});
  int64_t* in = b.inputs.data<int64_t>();
  int64_t* tg = b.targets.data<int64_t>();
  std::vector<int64_t> window(static_cast<size_t>(t + 1));
  const std::vector<int64_t> ids = rank_windows(position, micro);
  for (int64_t i = 0; i < mb; ++i) {
    data_->read_window(ids[i], t, window.data());
    std::copy(window.begin(), window.end() - 1, in + i * t);
    std::copy(window.begin() + 1, window.end(), tg + i * t);
  }
  return b;
}

std::vector<Batch> DataLoader::next_step() {
  std::vector<Batch> out;
  if (packed()) {
    const PackedStep step = packed_step(position_, offset_);
    for (int64_t m = 0; m < accumulation_steps(); ++m) out.push_back(packed_batch(step, m));
    position_ = step.end_position, offset_ = step.end_offset;
    return out;
  }
  for (int64_t m = 0; m < accumulation_steps(); ++m) out.push_back(batch_at(position_, m));
  position_ += opts_.global_batch_size;
  return out;
}

LoaderState DataLoader::state() const {
  return {position_, opts_.seed, opts_.seq_len, num_windows_, opts_.shuffle, opts_.packed_sequence_size,
          packed() ? num_documents() : 0, offset_};
}

void DataLoader::load_state(const LoaderState& s) {
  QUILT_CHECK(s.seq_len == opts_.seq_len, "[data] the saved loader state has seq_len ", s.seq_len,
              " but this run has train.seq_len ", opts_.seq_len);
  QUILT_CHECK(s.packed_sequence_size == opts_.packed_sequence_size, "[data] the saved loader state has "
              "packed_sequence_size ", s.packed_sequence_size, " but this run has packed_sequence.packed_sequence_size ",
              opts_.packed_sequence_size);
  QUILT_CHECK(s.num_windows == num_windows_, "[data] the saved loader state covers ", s.num_windows,
              " windows but ", data_->path(), " has ", num_windows_, " (the data changed since the checkpoint)");

  QUILT_CHECK(s.seed == opts_.seed, "[data] the saved loader state has seed ", s.seed, " but this run has ",
              opts_.seed, " (train.seed)");
  QUILT_CHECK(s.shuffle == opts_.shuffle, "[data] the saved loader state has shuffle ", s.shuffle ? "on" : "off",
              " but this loader has it ", opts_.shuffle ? "on" : "off");
  QUILT_CHECK(s.position >= 0, "[data] the saved loader position ", s.position, " is negative");
  if (packed()) {
    QUILT_CHECK(s.num_documents == num_documents(), "[data] the saved loader state covers ", s.num_documents,
                " documents but ", data_->path(), " has ", num_documents(), " (the data changed since the checkpoint)");
    const int64_t length = document(document_at(s.position)).second;
    QUILT_CHECK(s.offset >= 0 && s.offset < length, "[data] the saved loader offset ", s.offset,
                " is outside the ", length, " tokens of the document at stream position ", s.position);
  } else {
    QUILT_CHECK(s.offset == 0, "[data] the saved loader state has offset ", s.offset, " but this loader reads windows");
  }
  position_ = s.position;
  offset_ = s.offset;
}

// ---- data prepare ---------------------------------------------------------------------------------

DocSplit parse_doc_split(const std::string& s) {
  if (s == "auto") return DocSplit::kAuto;
  if (s == "fortune") return DocSplit::kFortune;
  if (s == "paragraph") return DocSplit::kParagraph;
  if (s == "file") return DocSplit::kFile;
  fail("[data] --split '", s, "' is not one of auto, fortune, paragraph, file");
}

namespace {

// Lines of `text` without their newline; the last one may lack it.
std::vector<std::string_view> lines_of(std::string_view text) {
  std::vector<std::string_view> lines;
  size_t b = 0;
  while (b < text.size()) {
    size_t e = text.find('\n', b);
    if (e == std::string_view::npos) e = text.size();
    lines.push_back(text.substr(b, e - b));
    b = e + 1;
  }
  return lines;
}

std::string_view strip_cr(std::string_view l) { return !l.empty() && l.back() == '\r' ? l.substr(0, l.size() - 1) : l; }

bool is_blank(std::string_view l) { return l.find_first_not_of(" \t\r") == std::string_view::npos; }

// Joins a run of lines into a document, dropping blank lines at either end.
void flush(std::vector<std::string_view>& run, std::vector<std::string>& docs) {
  size_t b = 0, e = run.size();
  while (b < e && is_blank(run[b])) ++b;
  while (e > b && is_blank(run[e - 1])) --e;
  if (b < e) {
    std::string doc;
    for (size_t i = b; i < e; ++i) (doc += run[i]) += '\n';
    docs.push_back(std::move(doc));
  }
  run.clear();
}

}  // namespace

std::vector<std::string> split_documents(std::string_view text, DocSplit split) {
  std::vector<std::string_view> lines = lines_of(text);
  auto is_percent = [](std::string_view l) { return strip_cr(l) == "%"; };
  if (split == DocSplit::kAuto)
    split = std::any_of(lines.begin(), lines.end(), is_percent) ? DocSplit::kFortune : DocSplit::kFile;
  std::vector<std::string> docs;
  std::vector<std::string_view> run;
  for (std::string_view l : lines) {
    const bool boundary = split == DocSplit::kFortune ? is_percent(l) : split == DocSplit::kParagraph && is_blank(l);
    if (boundary) flush(run, docs);
    else run.push_back(l);
  }
  flush(run, docs);
  return docs;
}

std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs, std::vector<std::string>* skipped) {
  std::vector<std::string> files;
  std::set<std::string> seen;
  auto skip = [&](const std::string& f, const std::string& why) {
    if (skipped) skipped->push_back(f + " (" + why + ")");
  };
  auto add = [&](const fs::path& p) {
    std::error_code ec;
    const std::string canon = fs::canonical(p, ec).string();
    QUILT_CHECK(!ec, "[data] cannot read input '", p.string(), "': ", ec.message());
    if (!seen.insert(canon).second) return skip(p.string(), "same file as an earlier input");
    if (p.extension() == ".dat") return skip(p.string(), "fortune index file");
    // Text only: a NUL byte in the first 8 KiB marks a binary file.
    std::ifstream in(p, std::ios::binary);
    char buf[8192];
    in.read(buf, sizeof(buf));
    if (std::memchr(buf, 0, static_cast<size_t>(in.gcount())) != nullptr) return skip(p.string(), "binary file");
    files.push_back(p.string());
  };
  for (const std::string& in : inputs) {
    std::error_code ec;
    if (fs::is_directory(in, ec)) {
      std::vector<fs::path> entries;
      for (const auto& e : fs::directory_iterator(in, ec)) {
        const std::string name = e.path().filename().string();
        // Symlinks in a directory are aliases (fortune's *.u8); hidden files are not corpus.
        if (name.empty() || name[0] == '.' || e.is_symlink() || !e.is_regular_file()) continue;
        entries.push_back(e.path());
      }
      std::sort(entries.begin(), entries.end());
      for (const fs::path& p : entries) add(p);
    } else {
      QUILT_CHECK(fs::is_regular_file(in, ec), "[data] input '", in, "' is neither a file nor a directory");
      add(in);
    }
  }
  return files;
}

PrepareStats prepare_dataset(const PrepareOptions& o) {
  QUILT_CHECK(!o.inputs.empty(), "[data] --input names no files");
  QUILT_CHECK(!o.output_dir.empty(), "[data] --output is required");
  QUILT_CHECK(o.val_fraction >= 0 && o.val_fraction <= 0.5, "[data] --val-fraction must be in [0, 0.5], got ",
              o.val_fraction);
  QUILT_CHECK(o.shard_tokens >= 2 && o.shard_tokens <= INT32_MAX, "[data] --shard-tokens must be in [2, ",
              INT32_MAX, "], got ", o.shard_tokens);
  std::unique_ptr<Tokenizer> tok = make_tokenizer(o.tokenizer);
  PrepareStats st;
  const std::vector<std::string> files = expand_inputs(o.inputs, &st.skipped);
  QUILT_CHECK(!files.empty(), "[data] no text files among the inputs (", st.skipped.size(), " skipped)");
  st.files = static_cast<int64_t>(files.size());

  std::error_code ec;
  fs::create_directories(o.output_dir, ec);
  QUILT_CHECK(!ec, "[data] cannot create output directory '", o.output_dir, "': ", ec.message());
  // Stale shards from an earlier run would be picked up by the train_*.bin glob.
  for (const auto& e : fs::directory_iterator(o.output_dir, ec)) {
    const std::string name = e.path().filename().string();
    auto is_shard = [&](const std::string& prefix) {
      return name.size() == prefix.size() + 10 && name.rfind(prefix, 0) == 0 && name.ends_with(".bin") &&
             std::all_of(name.begin() + prefix.size(), name.end() - 4, [](char c) { return c >= '0' && c <= '9'; });
    };
    if (is_shard("train_") || is_shard("val_")) fs::remove(e.path(), ec);
  }

  const int64_t every = o.val_fraction > 0 ? std::max<int64_t>(2, std::llround(1.0 / o.val_fraction)) : 0;
  struct Out {
    std::string prefix;
    std::vector<uint32_t> buf;
    int64_t index = 0;
    int64_t tokens = 0;
  };
  Out train, val;
  train.prefix = "train_";
  val.prefix = "val_";
  auto flush_shard = [&](Out& out) {
    if (out.buf.empty()) return;
    char name[32];
    std::snprintf(name, sizeof(name), "%s%06lld.bin", out.prefix.c_str(), static_cast<long long>(out.index++));
    const std::string path = (fs::path(o.output_dir) / name).string();
    write_token_shard(path, out.buf);
    st.shards.push_back(path);
    out.buf.clear();
  };
  std::vector<uint32_t> ids;
  auto emit = [&](Out& out, const std::string& doc) {
    ids.clear();
    ids.push_back(tok->eot_token());
    tok->encode(doc, ids);
    for (size_t i = 0; i < ids.size();) {
      const size_t room = static_cast<size_t>(o.shard_tokens) - out.buf.size();
      const size_t n = std::min(room, ids.size() - i);
      out.buf.insert(out.buf.end(), ids.begin() + static_cast<std::ptrdiff_t>(i),
                     ids.begin() + static_cast<std::ptrdiff_t>(i + n));
      i += n;
      if (out.buf.size() == static_cast<size_t>(o.shard_tokens)) flush_shard(out);
    }
    out.tokens += static_cast<int64_t>(ids.size());
  };

  // The last document is held back so that a small corpus still gets one validation document.
  std::string pending;
  bool have_pending = false;
  PrepareProgress progress;
  for (const std::string& f : files) progress.total_bytes += int64_t(fs::file_size(f, ec));
  for (const std::string& f : files) {
    std::ifstream in(f, std::ios::binary);
    QUILT_CHECK(in.good(), "[data] cannot read input '", f, "'");
    std::stringstream ss;
    ss << in.rdbuf();
    const int64_t file_start = progress.bytes, file_bytes = int64_t(ss.view().size());
    for (std::string& doc : split_documents(ss.str(), o.split)) {
      if (have_pending) {
        const bool to_val = every > 0 && st.documents % every == every - 1;
        emit(to_val ? val : train, pending);
        ++(to_val ? st.val_documents : st.train_documents);
        ++st.documents;
      }
      if (o.progress) {  // documents' bytes approximate the position in the file (separators left out)
        progress.bytes = std::min(progress.bytes + int64_t(doc.size()), file_start + file_bytes);
        progress.documents = st.documents;
        progress.tokens = train.tokens + val.tokens;
        o.progress(progress);
      }
      pending = std::move(doc);
      have_pending = true;
    }
    progress.bytes = file_start + file_bytes;
  }
  if (have_pending) {
    const bool to_val = every > 0 && (st.documents % every == every - 1 || st.val_documents == 0);
    emit(to_val ? val : train, pending);
    ++(to_val ? st.val_documents : st.train_documents);
    ++st.documents;
  }
  QUILT_CHECK(st.train_documents > 0, "[data] the inputs hold ", st.documents, " document(s): too few to keep ",
              "any for training after holding out validation (use --val-fraction 0 or more text)");
  flush_shard(train);
  flush_shard(val);
  st.train_tokens = train.tokens;
  st.val_tokens = val.tokens;
  if (o.progress) {
    progress = {progress.total_bytes, progress.total_bytes, st.documents, train.tokens + val.tokens, true};
    o.progress(progress);
  }

  nlohmann::json meta = {{"tokenizer", tok->name()},
                         {"vocab_size", tok->vocab_size()},
                         {"eot_token", tok->eot_token()},
                         {"documents", st.documents},
                         {"train_documents", st.train_documents},
                         {"val_documents", st.val_documents},
                         {"train_tokens", st.train_tokens},
                         {"val_tokens", st.val_tokens},
                         {"shards", st.shards},
                         {"inputs", files}};
  const std::string text = meta.dump(2) + "\n";
  write_file_atomically((fs::path(o.output_dir) / "dataset.json").string(), {{text.data(), text.size()}});
  return st;
}

}  // namespace quilt
