// Token data for the trainer: shard files, the dataset over them, and the data loader.
//
// Shards use llm.c's format: a header of 256 int32 (magic 20240520 + version 1 for uint16
// tokens, or magic 20240801 + version 7 for uint32 tokens, then the token count), followed by
// the tokens. Raw nanoGPT files (uint16 tokens, no header) are read with DataFormat::kNanogpt.
// Files are memory-mapped, so a dataset costs no memory up front.
//
// The loader cuts every shard into windows of seq_len + 1 tokens (window k of a shard starts
// at token k * seq_len; windows never cross shards) and walks an endless stream of them: epoch
// e is a permutation of all windows keyed by (seed, e). Global step s reads stream positions
// [s * G, (s + 1) * G) with G = global_batch_size, whatever the layout; data-parallel rank r
// takes, in micro-step m, the contiguous slice [m * mb * dp + r * mb, ... + mb) of it. So the
// union over ranks of a step is the same set of windows for any dp, which is what lets every
// layout follow the one-rank loss curve. Resuming needs only the stream position.
//
// With packing (packed_sequence_size = seq_len) the stream is of documents instead: a document
// begins at each `document_token` (the tokenizer's EOT, which prepare puts before every
// document), the shards read end to end; epoch e is a permutation of all documents keyed by
// (seed, e). A step packs global_batch_size rows greedily from the stream, each with whole
// documents in stream order until the next one does not fit; a document longer than a row is
// cut into rows of seq_len tokens (each piece its own document); the rest of a row is padding.
// Every rank packs the same global rows (document lengths only) and reads its slice of them, as
// above. The cursor (documents consumed, tokens taken from the next one) is the state, so
// resume works under any dp and any document_multiple.
//
//   auto data = std::make_shared<TokenDataset>("data/fortunes/train_*.bin", DataFormat::kLlmc);
//   DataLoader loader(data, {.seq_len = 128, .global_batch_size = 8, .micro_batch_size = 2,
//                            .dp_rank = r, .dp_size = 2, .seed = 1234});
//   for (Batch& b : loader.next_step()) { /* b.inputs, b.targets: i64 (2, 128) */ }
//   std::string saved = loader.state().to_json();   // later: loader.load_state(LoaderState::from_json(saved))
//   DataLoader packed(data, {.seq_len = 128, .global_batch_size = 8, .packed_sequence_size = 128,
//                            .document_token = 256});  // b.positions, b.document_ids: i64 (1, 128)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/tensor.h"
#include "tools/config.h"

namespace quilt {

inline constexpr int32_t kShardMagicU16 = 20240520;
inline constexpr int32_t kShardVersionU16 = 1;
inline constexpr int32_t kShardMagicU32 = 20240801;
inline constexpr int32_t kShardVersionU32 = 7;
inline constexpr int64_t kShardHeaderInts = 256;
inline constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

/// Writes `tokens` as one llm.c shard, to a temporary name then renamed (never half-written).
/// Tokens are stored as uint16 unless one needs more bits or `force_u32` is set.
void write_token_shard(const std::string& path, std::span<const uint32_t> tokens, bool force_u32 = false);

/// Where the tokens of one file are: token width, count and byte offset.
struct ShardInfo {
  std::string path;
  int token_bytes = 2;  // 2 (uint16) or 4 (uint32)
  int64_t num_tokens = 0;
  int64_t data_offset = 0;  // bytes before the first token
};

/// Reads and checks a shard's header (llmc) or size (nanogpt); throws naming the file.
ShardInfo read_shard_info(const std::string& path, DataFormat format);

/// One shard, memory-mapped read-only.
class TokenShard {
 public:
  TokenShard(const std::string& path, DataFormat format);
  ~TokenShard();
  TokenShard(TokenShard&& o) noexcept;
  TokenShard& operator=(TokenShard&&) = delete;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const ShardInfo& info() const { return info_; }
  int64_t size() const { return info_.num_tokens; }
  /// Token i (no bounds check: callers index within size()).
  uint32_t operator[](int64_t i) const;
  /// Copies tokens [start, start + count) into `out`, widened to int64; throws if out of range.
  void read(int64_t start, int64_t count, int64_t* out) const;

 private:
  ShardInfo info_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
};

/// The files a data path names, sorted: a directory -> its *.bin files, a glob -> its matches,
/// a file -> itself. Throws naming the path when nothing matches.
std::vector<std::string> resolve_data_files(const std::string& path);

/// Every shard a data path names, read as one collection of windows.
class TokenDataset {
 public:
  /// Opens (maps) every file `path` names; throws naming the file on any bad header.
  TokenDataset(const std::string& path, DataFormat format);

  const std::string& path() const { return path_; }
  size_t num_shards() const { return shards_.size(); }
  const TokenShard& shard(size_t i) const { return shards_[i]; }
  int64_t num_tokens() const;
  /// Windows of seq_len + 1 tokens in the whole dataset (they overlap by one token).
  int64_t num_windows(int64_t seq_len) const;
  /// Copies window `w` (seq_len + 1 tokens) into `out`.
  void read_window(int64_t w, int64_t seq_len, int64_t* out) const;
  /// Where each document starts, as offsets into the shards read end to end: 0 and every later
  /// occurrence of `document_token` (a document may continue into the next shard).
  std::vector<int64_t> document_starts(int64_t document_token) const;
  /// Copies tokens [start, start + count) of the shards read end to end into `out`.
  void read_tokens(int64_t start, int64_t count, int64_t* out) const;
  /// Throws naming the shard if any token is >= vocab_size (`key` names the setting in the error).
  void check_vocab(int64_t vocab_size, const std::string& key = "model.vocab_size") const;

 private:
  std::string path_;
  std::vector<TokenShard> shards_;
};

/// What a loader reads: windows of one stream, sliced for one data-parallel rank.
struct LoaderOptions {
  int64_t seq_len = 128;
  int64_t global_batch_size = 8;  // windows per step over all data-parallel ranks
  int64_t micro_batch_size = 1;   // windows per rank per micro-step
  int64_t dp_rank = 0;
  int64_t dp_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;  // false: windows in file order, as validation reads them
  // Packing (packed_sequence.packed_sequence_size): rows of whole documents. 0: windows; else
  // it must equal seq_len, the row length.
  int64_t packed_sequence_size = 0;
  int64_t document_token = -1;    // packing: the token that begins every document (the tokenizer's EOT)
  int64_t document_multiple = 1;  // packing: each document padded to a multiple of this (2 * cp_size under cp)
};

/// A loader's position, saved in checkpoints. Layout-free: it may be restored under any dp.
struct LoaderState {
  int64_t position = 0;  // windows consumed by all ranks together
  uint64_t seed = 0;
  int64_t seq_len = 0;
  int64_t num_windows = 0;
  bool shuffle = true;
  // Packing only (to_json leaves them out when packed_sequence_size is 0): position counts
  // documents, and `offset` tokens of the next one were taken by a row already (a long document).
  int64_t packed_sequence_size = 0;
  int64_t num_documents = 0;
  int64_t offset = 0;

  /// One-line JSON object.
  std::string to_json() const;
  /// Parses to_json()'s output; throws naming the missing or mistyped field.
  static LoaderState from_json(const std::string& json);
  friend bool operator==(const LoaderState&, const LoaderState&) = default;
};

/// One micro-batch: i64 tensors of shape (micro_batch_size, seq_len); targets are inputs shifted
/// by one (-100 where no target counts: a packed document's last token, padding). `positions`
/// (undefined: 0..seq_len-1 in every row) restart at each document of a packed row;
/// `document_ids` (undefined: one document per row) keep attention inside each document.
struct Batch {
  Tensor inputs;
  Tensor targets;
  Tensor positions;
  Tensor document_ids;
};

/// One document (or a piece of a long one) in a packed row.
struct PackedPiece {
  int64_t start = 0;   // offset of its first token in the shards read end to end
  int64_t length = 0;  // its tokens (>= 2: a lone token has no target and is left out)
  int64_t padded = 0;  // what it takes of the row: length rounded up to document_multiple
};

/// The rows of one global step of a packing loader, and the stream cursor after them.
struct PackedStep {
  std::vector<std::vector<PackedPiece>> rows;  // global_batch_size rows, each at most seq_len tokens
  int64_t end_position = 0;                    // documents consumed after the step
  int64_t end_offset = 0;                      // tokens taken from the next document
};

/// Deterministic, resumable batches for one data-parallel rank.
class DataLoader {
 public:
  /// Throws if the batch does not split over dp ranks or the data holds no window.
  DataLoader(std::shared_ptr<const TokenDataset> data, LoaderOptions options);

  const LoaderOptions& options() const { return opts_; }
  int64_t num_windows() const { return num_windows_; }
  /// Micro-steps per global step: global_batch_size / (micro_batch_size * dp_size).
  int64_t accumulation_steps() const { return opts_.global_batch_size / (opts_.micro_batch_size * opts_.dp_size); }
  /// Window id at stream position `p` (epoch p / num_windows, shuffled by (seed, epoch)).
  int64_t window_at(int64_t p) const;
  /// Window ids of the global batch that starts at stream position `position`.
  std::vector<int64_t> global_windows(int64_t position) const;
  /// Window ids this rank reads in micro-step `micro` of the global batch at `position`.
  std::vector<int64_t> rank_windows(int64_t position, int64_t micro) const;
  /// This rank's micro-batch `micro` of the global batch at `position` (does not move the loader);
  /// packing: at document stream position `position`, offset 0.
  Batch batch_at(int64_t position, int64_t micro) const;
  /// Packing: documents in the data (the stream's unit).
  int64_t num_documents() const { return static_cast<int64_t>(starts_.size()); }
  /// Packing: document id at stream position `p` (epoch p / num_documents, shuffled by (seed, epoch)).
  int64_t document_at(int64_t p) const;
  /// Packing: the global step's rows, packed from the cursor (position, offset).
  PackedStep packed_step(int64_t position, int64_t offset) const;
  /// Packing: this rank's micro-batch `micro` of `step`, with positions and document ids.
  Batch packed_batch(const PackedStep& step, int64_t micro) const;
  /// This rank's micro-batches of the next global step; advances by global_batch_size.
  std::vector<Batch> next_step();

  /// Windows (packing: documents) consumed so far by all ranks together.
  int64_t position() const { return position_; }
  /// Packing: tokens of the document at position() already taken by a row.
  int64_t offset() const { return offset_; }
  /// Current epoch (how many times the stream has gone through every window or document).
  int64_t epoch() const { return position_ / stream_size(); }
  /// Back to the start of the stream (validation restarts every evaluation).
  void reset() { position_ = 0, offset_ = 0; }
  LoaderState state() const;
  /// Continues from a saved state; throws naming the field if it belongs to other data or settings.
  void load_state(const LoaderState& s);

 private:
  std::shared_ptr<const TokenDataset> data_;
  LoaderOptions opts_;
  int64_t stream_size() const { return packed() ? num_documents() : num_windows_; }
  bool packed() const { return opts_.packed_sequence_size > 0; }
  // Packing: a document's first token and its length.
  std::pair<int64_t, int64_t> document(int64_t id) const;

  int64_t num_windows_ = 0;    // 0 when packing
  int64_t position_ = 0;
  int64_t offset_ = 0;         // packing only
  std::vector<int64_t> starts_;  // packing: where each document begins
};

/// How `quilt data prepare` cuts input text into documents.
enum class DocSplit {
  kAuto,       // fortune when the file has a line holding only "%", else file
  kFortune,    // fortune(6) files: documents separated by lines holding only "%"
  kParagraph,  // blank lines separate documents
  kFile,       // each file is one document
};

/// Options of `quilt data prepare`.
/// How far `quilt data prepare` has come: input bytes read of all, documents and tokens so far.
struct PrepareProgress {
  int64_t bytes = 0, total_bytes = 0, documents = 0, tokens = 0;
  bool done = false;
};

struct PrepareOptions {
  std::vector<std::string> inputs;  // files or directories (their regular files; *.dat skipped)
  std::string output_dir;
  std::string tokenizer = "byte";
  DocSplit split = DocSplit::kAuto;
  double val_fraction = 0.05;           // every round(1 / val_fraction)-th document is held out
  int64_t shard_tokens = 100'000'000;   // tokens per shard file at most
  /// Called after every document (and once at the end, with done set): for progress lines.
  std::function<void(const PrepareProgress&)> progress;
};

/// What `quilt data prepare` read and wrote.
struct PrepareStats {
  int64_t files = 0;
  int64_t documents = 0;
  int64_t train_documents = 0;
  int64_t val_documents = 0;
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  std::vector<std::string> shards;   // files written
  std::vector<std::string> skipped;  // inputs left out, with the reason
};

/// Parses "auto", "fortune", "paragraph" or "file"; throws naming `--split`.
DocSplit parse_doc_split(const std::string& s);
/// Cuts text into documents; empty documents are dropped.
std::vector<std::string> split_documents(std::string_view text, DocSplit split);
/// The input files `inputs` name, in order, duplicates (e.g. through symlinks) removed; binary
/// files and fortune index files (*.dat) go to `skipped` with the reason.
std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs, std::vector<std::string>* skipped);
/// Tokenizes the inputs into DIR/train_NNNNNN.bin and DIR/val_NNNNNN.bin (each document preceded
/// by the end-of-text token) plus DIR/dataset.json; old train_/val_ shards in DIR are removed first.
PrepareStats prepare_dataset(const PrepareOptions& options);

}  // namespace quilt
