// Fuzzes the token-shard reader: the input's first byte picks the format (even: llm.c, odd:
// nanoGPT) and the window length; the rest is one shard file. A shard that opens is read
// through the dataset and a loader, every window of one epoch. quilt::Error is the expected
// answer to a bad shard; anything else (another exception, a sanitizer report) is a bug.
#include "tests/fuzz/fuzz_util.h"
#include "tools/data.h"

using namespace quilt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const std::string path = fuzz::scratch_dir("data") + "/shard.bin";
  const DataFormat format = data[0] % 2 ? DataFormat::kNanogpt : DataFormat::kLlmc;
  const int64_t seq_len = 1 + (data[0] >> 1) % 16;
  fuzz::write_file(path, data + 1, size - 1);
  try {
    auto ds = std::make_shared<TokenDataset>(path, format);
    ds->check_vocab(1 << 16);
    DataLoader loader(ds, {.seq_len = seq_len, .global_batch_size = 2, .micro_batch_size = 1, .dp_rank = 1,
                           .dp_size = 2, .seed = data[0]});
    for (int64_t p = 0; p < loader.num_windows(); p += 2) loader.batch_at(p, 0);
    LoaderState s = LoaderState::from_json(loader.state().to_json());
    loader.load_state(s);
  } catch (const Error&) {
  }
  return 0;
}
