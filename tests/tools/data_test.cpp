// Token shards, the dataset, the data loader (determinism, dp slicing, resume) and data prepare.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>

#include "engine/error.h"
#include "tools/data.h"
#include "tools/tokenizer.h"

using namespace quilt;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed afterwards.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    path = fs::temp_directory_path() / ("quilt_tools_test_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& f) const { return (path / f).string(); }
};

std::vector<uint32_t> iota_tokens(size_t n, uint32_t start = 0, uint32_t mod = 1000) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = (start + static_cast<uint32_t>(i)) % mod;
  return t;
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_bytes(const std::string& path, const void* data, size_t n) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}

void write_text(const std::string& path, const std::string& text) { write_bytes(path, text.data(), text.size()); }

std::vector<int64_t> rows(const Tensor& t) { return {t.data<int64_t>(), t.data<int64_t>() + t.numel()}; }

// A dataset of two shards whose tokens encode their own position, so windows are recognisable.
std::shared_ptr<TokenDataset> make_dataset(const TempDir& dir, int64_t n0 = 1001, int64_t n1 = 650) {
  write_token_shard(dir / "train_000000.bin", iota_tokens(static_cast<size_t>(n0), 0, 60000));
  write_token_shard(dir / "train_000001.bin", iota_tokens(static_cast<size_t>(n1), 30000, 60000));
  return std::make_shared<TokenDataset>(dir / "train_*.bin", DataFormat::kLlmc);
}

}  // namespace

TEST_CASE("data: a uint16 shard has llm.c's header and reads back token for token") {
  TempDir dir("u16");
  std::vector<uint32_t> tokens = iota_tokens(5000, 7, 65536);
  write_token_shard(dir / "a.bin", tokens);
  std::vector<char> bytes = read_bytes(dir / "a.bin");
  REQUIRE(bytes.size() == 1024 + 5000 * 2);
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof(header));
  CHECK(header[0] == 20240520);
  CHECK(header[1] == 1);
  CHECK(header[2] == 5000);
  TokenShard shard(dir / "a.bin", DataFormat::kLlmc);
  CHECK(shard.info().token_bytes == 2);
  CHECK(shard.size() == 5000);
  std::vector<int64_t> back(5000);
  shard.read(0, 5000, back.data());
  CHECK(std::equal(back.begin(), back.end(), tokens.begin()));
  CHECK(shard[4999] == tokens[4999]);
  CHECK_THROWS_WITH_AS(shard.read(4990, 20, back.data()), doctest::Contains("tokens [4990, 5010) are outside"), Error);
}

TEST_CASE("data: tokens above 65535 (or force_u32) make a uint32 shard with magic 20240801 version 7") {
  TempDir dir("u32");
  std::vector<uint32_t> tokens = {1, 70000, 128255, 0};
  write_token_shard(dir / "w.bin", tokens);
  ShardInfo info = read_shard_info(dir / "w.bin", DataFormat::kLlmc);
  CHECK(info.token_bytes == 4);
  CHECK(info.num_tokens == 4);
  std::vector<char> bytes = read_bytes(dir / "w.bin");
  int32_t header[2];
  std::memcpy(header, bytes.data(), sizeof(header));
  CHECK(header[0] == 20240801);
  CHECK(header[1] == 7);
  TokenShard shard(dir / "w.bin", DataFormat::kLlmc);
  CHECK(shard[1] == 70000);
  CHECK(shard[2] == 128255);
  write_token_shard(dir / "f.bin", std::vector<uint32_t>{1, 2, 3}, /*force_u32=*/true);
  CHECK(read_shard_info(dir / "f.bin", DataFormat::kLlmc).token_bytes == 4);
  CHECK(fs::file_size(dir / "f.bin") == 1024 + 12);
}

TEST_CASE("data: bad magic, wrong version, truncation and trailing bytes are errors naming the file") {
  TempDir dir("bad");
  std::vector<int32_t> header(256, 0);
  std::vector<uint16_t> toks(10, 5);
  auto write_shard = [&](const std::string& name, int32_t magic, int32_t version, int32_t count, size_t ntok) {
    header[0] = magic, header[1] = version, header[2] = count;
    std::ofstream out(dir / name, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    out.write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(ntok * 2));
  };
  write_shard("magic.bin", 12345, 1, 10, 10);
  CHECK_THROWS_WITH_AS(TokenShard(dir / "magic.bin", DataFormat::kLlmc),
                       doctest::Contains((dir / "magic.bin" + ": bad magic 12345 (expected 20240520").c_str()), Error);
  CHECK_THROWS_WITH_AS(TokenShard(dir / "magic.bin", DataFormat::kLlmc), doctest::Contains("data.format: nanogpt"),
                       Error);
  write_shard("version.bin", 20240520, 2, 10, 10);
  CHECK_THROWS_WITH_AS(TokenShard(dir / "version.bin", DataFormat::kLlmc),
                       doctest::Contains("version.bin: magic 20240520 (uint16 tokens) with version 2; expected version 1"),
                       Error);
  write_shard("v32.bin", 20240801, 1, 5, 10);
  CHECK_THROWS_WITH_AS(TokenShard(dir / "v32.bin", DataFormat::kLlmc), doctest::Contains("expected version 7"), Error);
  write_shard("short.bin", 20240520, 1, 10, 7);
  CHECK_THROWS_WITH_AS(TokenShard(dir / "short.bin", DataFormat::kLlmc),
                       doctest::Contains("short.bin: truncated: the header declares 10 tokens (1044 bytes with the "
                                         "header) but the file is 1038 bytes"),
                       Error);
  write_shard("long.bin", 20240520, 1, 8, 10);
  CHECK_THROWS_WITH_AS(TokenShard(dir / "long.bin", DataFormat::kLlmc),
                       doctest::Contains("long.bin: 4 bytes follow the 8 tokens"), Error);
  write_bytes(dir / "tiny.bin", toks.data(), 20);
  CHECK_THROWS_WITH_AS(TokenShard(dir / "tiny.bin", DataFormat::kLlmc),
                       doctest::Contains("tiny.bin: file is 20 bytes, shorter than the 1024-byte llm.c shard header"),
                       Error);
  CHECK_THROWS_WITH_AS(TokenShard(dir / "missing.bin", DataFormat::kLlmc),
                       doctest::Contains(("cannot open token shard '" + dir / "missing.bin").c_str()), Error);
}

TEST_CASE("data: raw nanoGPT uint16 files read without a header") {
  TempDir dir("nanogpt");
  std::vector<uint16_t> raw(777);
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint16_t>(50000 + i);
  write_bytes(dir / "train.bin", raw.data(), raw.size() * 2);
  TokenDataset data(dir / "train.bin", DataFormat::kNanogpt);
  CHECK(data.num_tokens() == 777);
  CHECK(data.shard(0)[0] == 50000);
  CHECK(data.shard(0)[776] == 50776);
  std::vector<int64_t> w(65);
  data.read_window(1, 64, w.data());  // tokens [64, 129)
  CHECK(w.front() == 50064);
  CHECK(w.back() == 50128);
  write_bytes(dir / "odd.bin", raw.data(), 5);
  CHECK_THROWS_WITH_AS(TokenShard(dir / "odd.bin", DataFormat::kNanogpt),
                       doctest::Contains("odd.bin: 5 bytes is not a whole number of uint16 tokens"), Error);
}

TEST_CASE("data: a data path may be a directory, a glob or a file, and matching nothing is an error") {
  TempDir dir("resolve");
  write_token_shard(dir / "b.bin", iota_tokens(10));
  write_token_shard(dir / "a.bin", iota_tokens(10));
  write_text(dir / "notes.txt", "not a shard");
  CHECK(resolve_data_files(dir.path.string()) == std::vector<std::string>{dir / "a.bin", dir / "b.bin"});
  CHECK(resolve_data_files(dir / "b*.bin") == std::vector<std::string>{dir / "b.bin"});
  CHECK(resolve_data_files(dir / "a.bin") == std::vector<std::string>{dir / "a.bin"});
  CHECK_THROWS_WITH_AS(resolve_data_files(dir / "val_*.bin"), doctest::Contains("matches no files"), Error);
  CHECK_THROWS_WITH_AS(resolve_data_files(dir / "none.bin"), doctest::Contains("is neither a file, a directory"),
                       Error);
  TempDir empty("resolve_empty");
  CHECK_THROWS_WITH_AS(resolve_data_files(empty.path.string()), doctest::Contains("holds no *.bin token shards"),
                       Error);
}

TEST_CASE("data: windows of seq_len + 1 tokens tile each shard and never cross shards") {
  TempDir dir("windows");
  auto data = make_dataset(dir);  // 1001 and 650 tokens
  CHECK(data->num_shards() == 2);
  CHECK(data->num_tokens() == 1651);
  // (1001 - 1) / 100 = 10 windows in shard 0, (650 - 1) / 100 = 6 in shard 1.
  CHECK(data->num_windows(100) == 16);
  std::vector<int64_t> w(101);
  data->read_window(9, 100, w.data());
  CHECK(w.front() == 900);
  CHECK(w.back() == 1000);  // the last window ends exactly at the shard's last token
  data->read_window(10, 100, w.data());
  CHECK(w.front() == 30000);  // the next window starts the next shard
  data->read_window(15, 100, w.data());
  CHECK(w.back() == 30600);
  CHECK_THROWS_WITH_AS(data->read_window(16, 100, w.data()), doctest::Contains("window 16 is past the 16 windows"),
                       Error);
  CHECK_THROWS_WITH_AS(data->check_vocab(257), doctest::Contains("holds token 1000 (at position 1000), outside "
                                                                 "model.vocab_size 257"),
                       Error);
  CHECK_NOTHROW(data->check_vocab(60000));
}

TEST_CASE("data: a batch's targets are its inputs shifted by one token") {
  TempDir dir("shift");
  DataLoader loader(make_dataset(dir), {.seq_len = 50, .global_batch_size = 4, .micro_batch_size = 2, .seed = 3});
  Batch b = loader.batch_at(0, 1);
  CHECK(b.inputs.shape() == Shape{2, 50});
  CHECK(b.targets.shape() == Shape{2, 50});
  CHECK(b.inputs.dtype() == DType::i64);
  std::vector<int64_t> in = rows(b.inputs), tg = rows(b.targets);
  std::vector<int64_t> ids = loader.rank_windows(0, 1);
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<int64_t> w(51);
    TokenDataset(dir / "train_*.bin", DataFormat::kLlmc).read_window(ids[r], 50, w.data());
    for (int64_t t = 0; t < 50; ++t) {
      CHECK(in[r * 50 + t] == w[t]);
      CHECK(tg[r * 50 + t] == w[t + 1]);
    }
  }
}

TEST_CASE("data: every epoch is a permutation of all windows, different per epoch and per seed") {
  TempDir dir("perm");
  auto data = make_dataset(dir);
  for (int64_t seq : {100, 7, 1}) {
    DataLoader loader(data, {.seq_len = seq, .global_batch_size = 1, .seed = 42});
    const int64_t n = loader.num_windows();
    std::vector<int64_t> e0, e1;
    for (int64_t p = 0; p < n; ++p) e0.push_back(loader.window_at(p));
    for (int64_t p = n; p < 2 * n; ++p) e1.push_back(loader.window_at(p));
    std::vector<int64_t> sorted0 = e0, sorted1 = e1, all(static_cast<size_t>(n));
    std::sort(sorted0.begin(), sorted0.end());
    std::sort(sorted1.begin(), sorted1.end());
    std::iota(all.begin(), all.end(), 0);
    CHECK(sorted0 == all);
    CHECK(sorted1 == all);
    CHECK(e0 != e1);
    CHECK(e0 != all);  // shuffled
    DataLoader other(data, {.seq_len = seq, .global_batch_size = 1, .seed = 43});
    std::vector<int64_t> o0;
    for (int64_t p = 0; p < n; ++p) o0.push_back(other.window_at(p));
    CHECK(o0 != e0);
  }
}

TEST_CASE("data: two loaders with the same seed produce the same batches") {
  TempDir dir("determinism");
  auto data = make_dataset(dir);
  LoaderOptions o{.seq_len = 64, .global_batch_size = 8, .micro_batch_size = 2, .dp_rank = 1, .dp_size = 2, .seed = 9};
  DataLoader a(data, o), b(data, o);
  for (int step = 0; step < 5; ++step) {
    std::vector<Batch> x = a.next_step(), y = b.next_step();
    REQUIRE(x.size() == 2);
    for (size_t m = 0; m < x.size(); ++m) {
      CHECK(rows(x[m].inputs) == rows(y[m].inputs));
      CHECK(rows(x[m].targets) == rows(y[m].targets));
    }
  }
  CHECK(a.position() == 40);
}

TEST_CASE("data: the union over dp ranks of a step's batches is the one-rank batch, for dp 1, 2 and 4") {
  TempDir dir("dp_slicing");
  auto data = make_dataset(dir);
  const int64_t global = 8, mb = 2;
  // The one-rank reference: 4 micro-steps of 2 windows, in order.
  DataLoader one(data, {.seq_len = 32, .global_batch_size = global, .micro_batch_size = mb, .seed = 5});
  for (int64_t step = 0; step < 12; ++step) {  // 12 * 8 > 51 windows: crosses epochs too
    const int64_t pos = step * global;
    std::vector<int64_t> ref_windows, ref_tokens;
    for (int64_t m = 0; m < one.accumulation_steps(); ++m) {
      for (int64_t w : one.rank_windows(pos, m)) ref_windows.push_back(w);
      for (int64_t t : rows(one.batch_at(pos, m).inputs)) ref_tokens.push_back(t);
    }
    CHECK(ref_windows == one.global_windows(pos));
    for (int64_t dp : {2, 4}) {
      CAPTURE(dp);
      std::vector<int64_t> got_windows, got_tokens;
      for (int64_t m = 0; m < global / (mb * dp); ++m) {
        for (int64_t r = 0; r < dp; ++r) {
          DataLoader rank(data, {.seq_len = 32, .global_batch_size = global, .micro_batch_size = mb, .dp_rank = r,
                                 .dp_size = dp, .seed = 5});
          for (int64_t w : rank.rank_windows(pos, m)) got_windows.push_back(w);
          for (int64_t t : rows(rank.batch_at(pos, m).inputs)) got_tokens.push_back(t);
        }
      }
      // Same windows in the same global order, hence the same tokens: every layout sees the one-rank batch.
      CHECK(got_windows == ref_windows);
      CHECK(got_tokens == ref_tokens);
    }
  }
}

TEST_CASE("data: a restored loader continues exactly, even under another dp size") {
  TempDir dir("resume");
  auto data = make_dataset(dir);
  LoaderOptions o{.seq_len = 40, .global_batch_size = 4, .micro_batch_size = 2, .seed = 11};
  DataLoader a(data, o);
  for (int i = 0; i < 7; ++i) a.next_step();
  const std::string saved = a.state().to_json();
  LoaderState st = LoaderState::from_json(saved);
  CHECK(st == a.state());
  CHECK(st.position == 28);
  std::vector<int64_t> expect;
  for (const Batch& b : a.next_step())
    for (int64_t t : rows(b.inputs)) expect.push_back(t);

  DataLoader same(data, o);
  same.load_state(st);
  std::vector<int64_t> got;
  for (const Batch& b : same.next_step())
    for (int64_t t : rows(b.inputs)) got.push_back(t);
  CHECK(got == expect);

  // Two dp ranks resumed from the one-rank state read that same global batch between them.
  got.clear();
  for (int64_t r = 0; r < 2; ++r) {
    LoaderOptions o2 = o;
    o2.dp_rank = r, o2.dp_size = 2;
    DataLoader rank(data, o2);
    rank.load_state(st);
    for (const Batch& b : rank.next_step())
      for (int64_t t : rows(b.inputs)) got.push_back(t);
  }
  CHECK(got == expect);
}

TEST_CASE("data: a saved state from other data or settings is rejected naming the field") {
  TempDir dir("resume_bad");
  auto data = make_dataset(dir);
  DataLoader a(data, {.seq_len = 40, .global_batch_size = 4, .seed = 11});
  LoaderState s = a.state();
  s.seq_len = 64;
  CHECK_THROWS_WITH_AS(a.load_state(s), doctest::Contains("seq_len 64 but this run has train.seq_len 40"), Error);
  s = a.state();
  s.num_windows += 1;
  CHECK_THROWS_WITH_AS(a.load_state(s), doctest::Contains("the data changed since the checkpoint"), Error);
  s = a.state();
  s.seed = 12;
  CHECK_THROWS_WITH_AS(a.load_state(s), doctest::Contains("seed 12 but this run has 11 (train.seed)"), Error);
  CHECK_THROWS_WITH_AS(LoaderState::from_json("{\"position\": 3}"), doctest::Contains("has no field 'seed'"), Error);
  CHECK_THROWS_WITH_AS(LoaderState::from_json("{\"position\": \"x\", \"seed\": 1, \"seq_len\": 2, \"num_windows\": 3, "
                                              "\"shuffle\": true}"),
                       doctest::Contains("field 'position' has the wrong type"), Error);
  CHECK_THROWS_WITH_AS(LoaderState::from_json("not json"), doctest::Contains("not valid JSON"), Error);
}

TEST_CASE("data: validation reads windows in file order, the same for every layout") {
  TempDir dir("validation");
  auto data = make_dataset(dir);
  const int64_t n = data->num_windows(100);
  for (int64_t dp : {1, 2, 4}) {
    std::vector<int64_t> seen;
    for (int64_t m = 0; m < 8 / (2 * dp); ++m)
      for (int64_t r = 0; r < dp; ++r) {
        DataLoader v(data, {.seq_len = 100, .global_batch_size = 8, .micro_batch_size = 2, .dp_rank = r,
                            .dp_size = dp, .seed = 99, .shuffle = false});
        for (int64_t w : v.rank_windows(8, m)) seen.push_back(w);
      }
    std::vector<int64_t> expect;
    for (int64_t p = 8; p < 16; ++p) expect.push_back(p % n);
    CHECK(seen == expect);
  }
}

TEST_CASE("data: a loader rejects batches that do not split and data too short for one window") {
  TempDir dir("loader_bad");
  auto data = make_dataset(dir);
  CHECK_THROWS_WITH_AS(DataLoader(data, {.seq_len = 10, .global_batch_size = 6, .micro_batch_size = 2, .dp_size = 2}),
                       doctest::Contains("global_batch_size 6 is not divisible by micro_batch_size * dp_size = 2 * 2"),
                       Error);
  CHECK_THROWS_WITH_AS(DataLoader(data, {.seq_len = 10, .dp_rank = 2, .dp_size = 2}),
                       doctest::Contains("dp_rank 2 is outside [0, dp_size 2)"), Error);
  CHECK_THROWS_WITH_AS(DataLoader(data, {.seq_len = 1001}), doctest::Contains("make no window of seq_len + 1 = 1002"),
                       Error);
}

TEST_CASE("data: fortune files split on lines holding only %, text on blank lines or not at all") {
  const std::string fortunes = "First one.\n  -- someone\n%\nSecond\nspans lines.\n%\n%\n\nThird.\n%\n";
  std::vector<std::string> docs = split_documents(fortunes, DocSplit::kAuto);
  CHECK(docs == std::vector<std::string>{"First one.\n  -- someone\n", "Second\nspans lines.\n", "Third.\n"});
  CHECK(split_documents("a\r\n%\r\nb", DocSplit::kFortune).size() == 2);
  CHECK(split_documents("one\n\ntwo\nlines\n\n\n", DocSplit::kParagraph) ==
        std::vector<std::string>{"one\n", "two\nlines\n"});
  CHECK(split_documents("one\n\ntwo\n", DocSplit::kAuto) == std::vector<std::string>{"one\n\ntwo\n"});
  CHECK(split_documents("\n\n", DocSplit::kFile).empty());
  CHECK(parse_doc_split("paragraph") == DocSplit::kParagraph);
  CHECK_THROWS_WITH_AS(parse_doc_split("lines"), doctest::Contains("--split 'lines' is not one of"), Error);
}

TEST_CASE("data: prepare writes train and val shards of EOT-separated documents, every 20th held out") {
  TempDir dir("prepare");
  std::string a, b;
  for (int i = 0; i < 30; ++i) a += "fortune " + std::to_string(i) + "\n%\n";
  for (int i = 30; i < 50; ++i) b += "fortune " + std::to_string(i) + "\n%\n";
  fs::create_directories(dir.path / "in");
  write_text(dir / "in/a", a);
  write_text(dir / "in/b", b);
  write_text(dir / "in/a.dat", std::string("\0\0\1index", 8));  // fortune's strfile index
  fs::create_symlink(dir / "in/a", dir / "in/a.u8");              // an alias, as the fortunes package has
  fs::create_directories(dir.path / "out");
  write_token_shard(dir / "out/train_000007.bin", iota_tokens(3));  // stale, from an earlier run
  PrepareStats st = prepare_dataset({.inputs = {dir / "in"}, .output_dir = dir / "out"});
  CHECK(st.files == 2);
  CHECK(st.documents == 50);
  CHECK(st.val_documents == 2);  // documents 19 and 39
  CHECK(st.train_documents == 48);
  CHECK(st.shards == std::vector<std::string>{dir / "out/train_000000.bin", dir / "out/val_000000.bin"});
  CHECK_FALSE(fs::exists(dir / "out/train_000007.bin"));
  CHECK(fs::exists(dir / "out/dataset.json"));
  CHECK(st.skipped.size() == 1);  // a.dat; the symlink is not even listed in a directory walk

  ByteTokenizer tok;
  TokenDataset val(dir / "out/val_*.bin", DataFormat::kLlmc);
  std::vector<uint32_t> ids;
  for (int64_t i = 0; i < val.num_tokens(); ++i) ids.push_back(val.shard(0)[i]);
  CHECK(tok.decode(ids) == "<|endoftext|>fortune 19\n<|endoftext|>fortune 39\n");
  CHECK(st.val_tokens == static_cast<int64_t>(ids.size()));
  TokenDataset train(dir / "out/train_*.bin", DataFormat::kLlmc);
  CHECK(train.num_tokens() == st.train_tokens);
  CHECK(train.shard(0)[0] == ByteTokenizer::kEot);
}

TEST_CASE("data: prepare splits the token stream over shards of at most --shard-tokens") {
  TempDir dir("prepare_shards");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + "\n\n";
  write_text(dir / "book.txt", text);
  PrepareStats one = prepare_dataset({.inputs = {dir / "book.txt"}, .output_dir = dir / "one",
                                      .split = DocSplit::kParagraph, .val_fraction = 0.1});
  PrepareStats many = prepare_dataset({.inputs = {dir / "book.txt"}, .output_dir = dir / "many",
                                       .split = DocSplit::kParagraph, .val_fraction = 0.1, .shard_tokens = 100});
  CHECK(one.documents == 200);
  CHECK(one.val_documents == 20);
  TokenDataset a(dir / "one/train_*.bin", DataFormat::kLlmc), b(dir / "many/train_*.bin", DataFormat::kLlmc);
  CHECK(b.num_shards() == static_cast<size_t>((one.train_tokens + 99) / 100));
  for (size_t i = 0; i + 1 < b.num_shards(); ++i) CHECK(b.shard(i).size() == 100);
  std::vector<uint32_t> x, y;
  for (int64_t i = 0; i < a.num_tokens(); ++i) x.push_back(a.shard(0)[i]);
  for (size_t s = 0; s < b.num_shards(); ++s)
    for (int64_t i = 0; i < b.shard(s).size(); ++i) y.push_back(b.shard(s)[i]);
  CHECK(x == y);
}

TEST_CASE("data: inputs named twice or through a symlink are read once and binary files are skipped") {
  TempDir dir("inputs");
  write_text(dir / "t.txt", "text\n");
  fs::create_symlink(dir / "t.txt", dir / "link.txt");
  write_text(dir / "bin", std::string("ab\0cd", 5));
  std::vector<std::string> skipped;
  std::vector<std::string> files = expand_inputs({dir / "t.txt", dir / "link.txt", dir / "t.txt", dir / "bin"}, &skipped);
  CHECK(files == std::vector<std::string>{dir / "t.txt"});
  CHECK(skipped.size() == 3);
  CHECK(skipped.back().find("binary file") != std::string::npos);
  CHECK_THROWS_WITH_AS(expand_inputs({dir / "nope"}, nullptr), doctest::Contains("is neither a file nor a directory"),
                       Error);
  CHECK_THROWS_WITH_AS(prepare_dataset({.inputs = {dir / "bin"}, .output_dir = dir / "o"}),
                       doctest::Contains("no text files among the inputs"), Error);
  write_text(dir / "single.txt", "only one document\n");
  CHECK_THROWS_WITH_AS(prepare_dataset({.inputs = {dir / "single.txt"}, .output_dir = dir / "o"}),
                       doctest::Contains("too few to keep any for training"), Error);
}

TEST_CASE("data: the installed fortune corpus prepares into a real dataset") {
  const std::string corpus = "/usr/share/games/fortunes";
  if (!fs::is_directory(corpus)) {
    MESSAGE("skipped: " << corpus << " is absent (tools/setup-deps.sh installs the fortunes package)");
    return;
  }
  TempDir dir("fortunes");
  PrepareStats st = prepare_dataset({.inputs = {corpus}, .output_dir = dir / "out"});
  CHECK(st.documents > 1000);
  CHECK(st.val_documents == st.documents / 20);
  CHECK(st.train_tokens > 1'000'000);
  TokenDataset train(dir / "out/train_*.bin", DataFormat::kLlmc);
  CHECK_NOTHROW(train.check_vocab(257));
  DataLoader loader(std::make_shared<TokenDataset>(dir / "out/train_*.bin", DataFormat::kLlmc),
                    {.seq_len = 128, .global_batch_size = 8, .micro_batch_size = 2});
  CHECK(loader.num_windows() > 5000);
}

// ---- sequence packing -------------------------------------------------------------------------

namespace {

constexpr uint32_t kEot = 999;

// Six documents A..F of 3, 5, 2, 20, 1 and 4 tokens, each opening with kEot; document k's other
// tokens are 100 * (k + 1) + 1, + 2, ... The second shard begins inside D.
std::shared_ptr<TokenDataset> six_documents(const TempDir& dir) {
  std::vector<uint32_t> all;
  const int lengths[] = {3, 5, 2, 20, 1, 4};
  for (int k = 0; k < 6; ++k) {
    all.push_back(kEot);
    for (int j = 1; j < lengths[k]; ++j) all.push_back(uint32_t(100 * (k + 1) + j));
  }
  const size_t cut = 3 + 5 + 2 + 10;
  write_token_shard(dir / "train_000000.bin", std::vector<uint32_t>(all.begin(), all.begin() + cut));
  write_token_shard(dir / "train_000001.bin", std::vector<uint32_t>(all.begin() + cut, all.end()));
  return std::make_shared<TokenDataset>(dir / "train_*.bin", DataFormat::kLlmc);
}

// 80 documents of 1..45 tokens over three shards (documents cross them), document k's tokens
// after its kEot are 1000 + 50 * k + j.
std::shared_ptr<TokenDataset> many_documents(const TempDir& dir) {
  std::vector<uint32_t> all;
  for (uint32_t k = 0; k < 80; ++k) {
    all.push_back(kEot);
    for (uint32_t j = 1; j < 1 + (k * 37) % 45; ++j) all.push_back(1000 + 50 * k + j);
  }
  const size_t a = all.size() / 3, b = 2 * all.size() / 3 + 7;
  write_token_shard(dir / "train_000000.bin", std::vector<uint32_t>(all.begin(), all.begin() + long(a)));
  write_token_shard(dir / "train_000001.bin", std::vector<uint32_t>(all.begin() + long(a), all.begin() + long(b)));
  write_token_shard(dir / "train_000002.bin", std::vector<uint32_t>(all.begin() + long(b), all.end()));
  return std::make_shared<TokenDataset>(dir / "train_*.bin", DataFormat::kLlmc);
}

LoaderOptions packing(int64_t n, int64_t global, int64_t multiple = 1) {
  return {.seq_len = n, .global_batch_size = global, .seed = 21, .packed_sequence_size = n,
          .document_token = kEot, .document_multiple = multiple};
}

std::vector<int64_t> row(const Tensor& t, int64_t r) {
  const int64_t n = t.size(1);
  return {t.data<int64_t>() + r * n, t.data<int64_t>() + (r + 1) * n};
}

// Every row of `b` against the pieces packed for it: tokens from the data, targets within the
// piece, -100 at its end and on padding, positions from 0 per piece, ids counting the pieces,
// the row's tail one more document. Returns the real (non-padding) tokens of the batch.
int64_t check_packed_rows(const Batch& b, const std::vector<std::vector<PackedPiece>>& pieces,
                          const TokenDataset& data, int64_t doc_token) {
  const int64_t n = b.inputs.size(1);
  int64_t real = 0;
  for (int64_t r = 0; r < b.inputs.size(0); ++r) {
    CAPTURE(r);
    const std::vector<int64_t> in = row(b.inputs, r), tg = row(b.targets, r), pos = row(b.positions, r),
                               doc = row(b.document_ids, r);
    int64_t at = 0, id = 0;
    for (const PackedPiece& p : pieces[size_t(r)]) {
      std::vector<int64_t> tok(static_cast<size_t>(p.length));
      data.read_tokens(p.start, p.length, tok.data());
      for (int64_t j = 0; j < p.padded; ++j) {
        const bool pad = j >= p.length;
        CHECK(in[at + j] == (pad ? doc_token : tok[j]));
        CHECK(tg[at + j] == (j + 1 < p.length ? tok[j + 1] : -100));
        CHECK(pos[at + j] == j);
        CHECK(doc[at + j] == id);
      }
      real += p.length, at += p.padded, ++id;
    }
    for (int64_t j = at; j < n; ++j) {
      CHECK(in[j] == doc_token);
      CHECK(tg[j] == -100);
      CHECK(pos[j] == j - at);
      CHECK(doc[j] == id);
    }
  }
  return real;
}

}  // namespace

TEST_CASE("packing: rows hold whole documents greedily (long ones cut into rows), positions restart and targets stop at each end") {
  TempDir dir("pack_six");
  LoaderOptions o = packing(8, 5);
  o.shuffle = false;
  DataLoader loader(six_documents(dir), o);
  CHECK(loader.num_documents() == 6);
  std::vector<Batch> step = loader.next_step();
  REQUIRE(step.size() == 5);
  const int64_t x = -100, e = kEot;
  // A and B fill row 0; D does not fit after C, so row 1 is C and padding (its own document, id 1).
  CHECK(row(step[0].inputs, 0) == std::vector<int64_t>{e, 101, 102, e, 201, 202, 203, 204});
  CHECK(row(step[0].targets, 0) == std::vector<int64_t>{101, 102, x, 201, 202, 203, 204, x});
  CHECK(row(step[0].positions, 0) == std::vector<int64_t>{0, 1, 2, 0, 1, 2, 3, 4});
  CHECK(row(step[0].document_ids, 0) == std::vector<int64_t>{0, 0, 0, 1, 1, 1, 1, 1});
  CHECK(row(step[1].inputs, 0) == std::vector<int64_t>{e, 301, e, e, e, e, e, e});
  CHECK(row(step[1].targets, 0) == std::vector<int64_t>{301, x, x, x, x, x, x, x});
  CHECK(row(step[1].positions, 0) == std::vector<int64_t>{0, 1, 0, 1, 2, 3, 4, 5});
  CHECK(row(step[1].document_ids, 0) == std::vector<int64_t>{0, 0, 1, 1, 1, 1, 1, 1});
  // D (20 tokens, across the shard boundary) is cut into 8 + 8 + 4, each piece its own document.
  CHECK(row(step[2].inputs, 0) == std::vector<int64_t>{e, 401, 402, 403, 404, 405, 406, 407});
  CHECK(row(step[2].targets, 0) == std::vector<int64_t>{401, 402, 403, 404, 405, 406, 407, x});
  CHECK(row(step[3].inputs, 0) == std::vector<int64_t>{408, 409, 410, 411, 412, 413, 414, 415});
  CHECK(row(step[3].targets, 0) == std::vector<int64_t>{409, 410, 411, 412, 413, 414, 415, x});
  CHECK(row(step[3].positions, 0) == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7});
  // E is one token (no target): left out; D's last piece and F share row 4.
  CHECK(row(step[4].inputs, 0) == std::vector<int64_t>{416, 417, 418, 419, e, 601, 602, 603});
  CHECK(row(step[4].targets, 0) == std::vector<int64_t>{417, 418, 419, x, 601, 602, 603, x});
  CHECK(row(step[4].positions, 0) == std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3});
  CHECK(row(step[4].document_ids, 0) == std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1});
  CHECK(step[0].inputs.dtype() == DType::i64);
  CHECK(step[0].positions.dtype() == DType::i64);
  CHECK(step[0].document_ids.dtype() == DType::i64);
  // The step went through all six documents: the next one starts epoch 1.
  CHECK(loader.position() == 6);
  CHECK(loader.offset() == 0);
  CHECK(loader.epoch() == 1);
}

TEST_CASE("packing: document_multiple pads each document at its end, keeping its id and continuing its positions") {
  TempDir dir("pack_multiple");
  LoaderOptions o = packing(8, 6, 4);
  o.shuffle = false;
  DataLoader loader(six_documents(dir), o);
  std::vector<Batch> step = loader.next_step();
  REQUIRE(step.size() == 6);
  const int64_t x = -100, e = kEot;
  // A (3) takes 4; B (5 -> 8) does not fit after it.
  CHECK(row(step[0].inputs, 0) == std::vector<int64_t>{e, 101, 102, e, e, e, e, e});
  CHECK(row(step[0].targets, 0) == std::vector<int64_t>{101, 102, x, x, x, x, x, x});
  CHECK(row(step[0].positions, 0) == std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3});
  CHECK(row(step[0].document_ids, 0) == std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1});
  CHECK(row(step[1].inputs, 0) == std::vector<int64_t>{e, 201, 202, 203, 204, e, e, e});
  CHECK(row(step[1].targets, 0) == std::vector<int64_t>{201, 202, 203, 204, x, x, x, x});
  CHECK(row(step[1].positions, 0) == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(row(step[1].document_ids, 0) == std::vector<int64_t>{0, 0, 0, 0, 0, 0, 0, 0});
  CHECK(row(step[2].inputs, 0) == std::vector<int64_t>{e, 301, e, e, e, e, e, e});
  CHECK(row(step[2].positions, 0) == std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3});
  CHECK(row(step[2].document_ids, 0) == std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1});
  CHECK(row(step[5].inputs, 0) == std::vector<int64_t>{416, 417, 418, 419, e, 601, 602, 603});
  CHECK(row(step[5].document_ids, 0) == std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1});
  // Without shuffling epoch 1 starts at A again.
  CHECK(row(loader.next_step()[0].inputs, 0) == row(step[0].inputs, 0));
  // Every piece's padded length is a multiple of 4, so every document splits into 2 * cp chunks at cp 2.
  const PackedStep s = loader.packed_step(0, 0);
  for (const auto& r : s.rows)
    for (const PackedPiece& p : r) CHECK(p.padded % 4 == 0);
}

TEST_CASE("packing: the stream visits every document once per epoch in the shuffled order, rows filled greedily") {
  TempDir dir("pack_stream");
  auto data = many_documents(dir);
  for (int64_t multiple : {1, 2, 4}) {
    CAPTURE(multiple);
    const int64_t n = 16;
    DataLoader loader(data, packing(n, 4, multiple));
    const int64_t docs = loader.num_documents();
    REQUIRE(docs == 80);
    const std::vector<int64_t> starts = data->document_starts(kEot);
    // The order: a permutation per epoch, not file order, different per epoch.
    std::vector<int64_t> e0, e1, all(static_cast<size_t>(docs));
    for (int64_t p = 0; p < docs; ++p) e0.push_back(loader.document_at(p)), e1.push_back(loader.document_at(p + docs));
    std::iota(all.begin(), all.end(), 0);
    CHECK(e0 != all);
    CHECK(e0 != e1);
    std::sort(e0.begin(), e0.end());
    CHECK(e0 == all);
    // Expected pieces, in stream order, for two epochs and a bit: each document cut every n
    // tokens, lone tokens left out.
    std::vector<std::pair<int64_t, int64_t>> expect, got;
    for (int64_t p = 0; p < 2 * docs + 40; ++p) {
      const int64_t d = loader.document_at(p);
      const int64_t begin = starts[size_t(d)];
      const int64_t len = (d + 1 < docs ? starts[size_t(d + 1)] : data->num_tokens()) - begin;
      for (int64_t off = 0; off < len; off += n)
        if (std::min(n, len - off) >= 2) expect.emplace_back(begin + off, std::min(n, len - off));
    }
    std::vector<std::vector<PackedPiece>> rows_seen;
    int64_t position = 0, offset = 0;
    while (position < 2 * docs) {
      PackedStep s = loader.packed_step(position, offset);
      for (int64_t m = 0; m < loader.accumulation_steps(); ++m)
        check_packed_rows(loader.packed_batch(s, m), {s.rows[size_t(m)]}, *data, kEot);
      for (const auto& r : s.rows) rows_seen.push_back(r);
      position = s.end_position, offset = s.end_offset;
    }
    for (const auto& r : rows_seen)
      for (const PackedPiece& p : r) got.emplace_back(p.start, p.length);
    REQUIRE(got.size() <= expect.size());
    CHECK(std::equal(got.begin(), got.end(), expect.begin()));
    // Greedy: each row is full up to what the next row's first piece would need.
    for (size_t i = 0; i + 1 < rows_seen.size(); ++i) {
      int64_t used = 0;
      for (const PackedPiece& p : rows_seen[i]) {
        used += p.padded;
        const bool aligned = p.padded % multiple == 0;
        CHECK(aligned);
      }
      CHECK(used <= n);
      REQUIRE(!rows_seen[i + 1].empty());
      CHECK(used + rows_seen[i + 1].front().padded > n);
    }
  }
}

TEST_CASE("packing: two loaders agree, and dp ranks read disjoint rows whose union is the one-rank step") {
  TempDir dir("pack_dp");
  auto data = many_documents(dir);
  for (int64_t mb : {1, 2}) {
    CAPTURE(mb);
    LoaderOptions o = packing(16, 8, 2);
    o.micro_batch_size = mb;
    DataLoader one(data, o), again(data, o);
    for (int step = 0; step < 12; ++step) {  // 12 * 8 rows pass the 80 documents: crosses an epoch
      const LoaderState before = one.state();
      std::vector<Batch> a = one.next_step(), b = again.next_step();
      REQUIRE(a.size() == size_t(8 / mb));
      std::vector<int64_t> ref;
      for (size_t m = 0; m < a.size(); ++m) {
        CHECK(rows(a[m].inputs) == rows(b[m].inputs));
        CHECK(rows(a[m].targets) == rows(b[m].targets));
        CHECK(rows(a[m].positions) == rows(b[m].positions));
        CHECK(rows(a[m].document_ids) == rows(b[m].document_ids));
        for (int64_t t : rows(a[m].inputs)) ref.push_back(t);
      }
      for (int64_t dp : {2, 4}) {
        if (8 % (mb * dp) != 0) continue;
        CAPTURE(dp);
        std::vector<std::vector<Batch>> per_rank;
        for (int64_t r = 0; r < dp; ++r) {
          LoaderOptions ro = o;
          ro.dp_rank = r, ro.dp_size = dp;
          DataLoader rank(data, ro);
          rank.load_state(before);
          per_rank.push_back(rank.next_step());
          CHECK(rank.state() == one.state());  // every rank's cursor moves past the whole global step
        }
        // Micro-step m of rank r holds rows [m * mb * dp + r * mb, ... + mb) of the global step,
        // so taking them micro-step by micro-step, rank by rank, gives the one-rank rows in order.
        std::vector<int64_t> got;
        for (size_t m = 0; m < per_rank[0].size(); ++m)
          for (int64_t r = 0; r < dp; ++r)
            for (int64_t t : rows(per_rank[size_t(r)][m].inputs)) got.push_back(t);
        CHECK(got == ref);
        CHECK(rows(per_rank[0][0].inputs) != rows(per_rank[1][0].inputs));
      }
    }
  }
}

TEST_CASE("packing: a restored loader continues exactly, also inside a long document and under another dp") {
  TempDir dir("pack_resume");
  auto data = many_documents(dir);
  const LoaderOptions o = packing(16, 4, 2);
  DataLoader a(data, o);
  int inside = 0;  // saved states that fall inside a cut document
  for (int step = 0; step < 30; ++step) {
    const LoaderState st = LoaderState::from_json(a.state().to_json());
    CHECK(st == a.state());
    inside += st.offset > 0;
    std::vector<Batch> expect = a.next_step();
    DataLoader b(data, o);
    b.load_state(st);
    std::vector<Batch> got = b.next_step();
    REQUIRE(got.size() == expect.size());
    for (size_t m = 0; m < got.size(); ++m) {
      CHECK(rows(got[m].inputs) == rows(expect[m].inputs));
      CHECK(rows(got[m].targets) == rows(expect[m].targets));
      CHECK(rows(got[m].positions) == rows(expect[m].positions));
      CHECK(rows(got[m].document_ids) == rows(expect[m].document_ids));
    }
    // Under dp 2 the ranks' rows are that same step, split.
    std::vector<int64_t> split, whole;
    for (const Batch& e : expect)
      for (int64_t t : rows(e.inputs)) whole.push_back(t);
    for (int64_t m = 0; m < 2; ++m)
      for (int64_t r = 0; r < 2; ++r) {
        LoaderOptions ro = o;
        ro.dp_rank = r, ro.dp_size = 2;
        DataLoader rank(data, ro);
        rank.load_state(st);
        for (int64_t t : rows(rank.next_step()[size_t(m)].inputs)) split.push_back(t);
      }
    CHECK(split == whole);
  }
  CHECK(inside > 0);
  // The cursor is layout-free: another document_multiple (another cp) resumes from it too.
  LoaderOptions other = o;
  other.document_multiple = 4;
  DataLoader c(data, other);
  CHECK_NOTHROW(c.load_state(a.state()));
  CHECK(c.position() == a.position());
  CHECK(c.offset() == a.offset());
  // A state without packing writes no packing fields (checkpoints stay as they were).
  DataLoader windows(data, {.seq_len = 16, .global_batch_size = 4});
  CHECK(windows.state().to_json().find("offset") == std::string::npos);
  CHECK(a.state().to_json().find("\"offset\"") != std::string::npos);
}

TEST_CASE("packing: validation reads documents in file order and restarts on reset") {
  TempDir dir("pack_validation");
  auto data = many_documents(dir);
  LoaderOptions o = packing(16, 4);
  o.shuffle = false;
  DataLoader v(data, o);
  for (int64_t p = 0; p < 80; ++p) CHECK(v.document_at(p) == p);
  std::vector<Batch> first = v.next_step();
  v.next_step();
  v.reset();
  CHECK(v.position() == 0);
  CHECK(rows(v.next_step()[0].inputs) == rows(first[0].inputs));
}

TEST_CASE("packing: bad options and saved states from other settings are refused, naming them") {
  TempDir dir("pack_bad");
  auto data = many_documents(dir);
  LoaderOptions o = packing(16, 4);
  o.seq_len = 32;
  CHECK_THROWS_WITH_AS(DataLoader(data, o), doctest::Contains("packed_sequence_size 16 differs from seq_len 32"), Error);
  o = packing(16, 4);
  o.document_token = -1;
  CHECK_THROWS_WITH_AS(DataLoader(data, o), doctest::Contains("packing needs document_token"), Error);
  CHECK_THROWS_WITH_AS(DataLoader(data, packing(16, 4, 3)),
                       doctest::Contains("document_multiple 3 does not divide the packed row length 16"), Error);
  // Only one-token documents: nothing to learn from.
  write_token_shard(dir / "eot.bin", std::vector<uint32_t>(10, kEot));
  auto lone = std::make_shared<TokenDataset>(dir / "eot.bin", DataFormat::kLlmc);
  CHECK_THROWS_WITH_AS(DataLoader(lone, packing(16, 4)),
                       doctest::Contains("10 document(s) (split at token 999) hold no document of two tokens or more"),
                       Error);

  DataLoader packed(data, packing(16, 4)), windows(data, {.seq_len = 16, .global_batch_size = 4, .seed = 21});
  CHECK_THROWS_WITH_AS(windows.load_state(packed.state()),
                       doctest::Contains("packed_sequence_size 16 but this run has packed_sequence.packed_sequence_size 0"),
                       Error);
  CHECK_THROWS_WITH_AS(packed.load_state(windows.state()),
                       doctest::Contains("packed_sequence_size 0 but this run has packed_sequence.packed_sequence_size 16"),
                       Error);
  LoaderState s = packed.state();
  s.num_documents = 81;
  CHECK_THROWS_WITH_AS(packed.load_state(s), doctest::Contains("covers 81 documents but"), Error);
  s = packed.state();
  s.offset = 1000;
  CHECK_THROWS_WITH_AS(packed.load_state(s), doctest::Contains("offset 1000 is outside the"), Error);
  CHECK_THROWS_WITH_AS(LoaderState::from_json("{\"position\": 0, \"seed\": 1, \"seq_len\": 16, \"num_windows\": 0, "
                                              "\"shuffle\": true, \"packed_sequence_size\": 16}"),
                       doctest::Contains("has no field 'num_documents'"), Error);
  CHECK_THROWS_WITH_AS(packed.window_at(0), doctest::Contains("a packing loader reads documents"), Error);
  CHECK_THROWS_WITH_AS(windows.document_at(0), doctest::Contains("reads windows, not documents"), Error);
}
