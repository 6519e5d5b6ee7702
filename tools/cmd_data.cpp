// `quilt data prepare`: tokenizes text files into llm.c token shards with a held-out
// validation shard (train_NNNNNN.bin / val_NNNNNN.bin in the output directory).
#include <algorithm>
#include <cstdio>

#include "tools/command.h"
#include "tools/data.h"
#include "tools/progress.h"

namespace quilt {
namespace {

int data_prepare(const CommandArgs& a) {
  PrepareOptions o;
  o.inputs = a.list("--input");
  o.output_dir = a.get("--output");
  o.tokenizer = a.get("--tokenizer");
  o.split = parse_doc_split(a.get("--split"));
  o.val_fraction = a.get_double("--val-fraction");
  o.shard_tokens = a.get_int("--shard-tokens");
  // Bytes, documents, tokens/s and ETA: in place on a terminal, plain lines in a log.
  ProgressLine line("data prepare");
  o.progress = [&](const PrepareProgress& p) {
    char detail[128];
    const double secs = std::max(1e-9, line.elapsed());
    std::snprintf(detail, sizeof detail, "%lld documents, %lld tokens, %.0f tokens/s",
                  static_cast<long long>(p.documents), static_cast<long long>(p.tokens), double(p.tokens) / secs);
    if (p.done) line.finish(p.bytes, p.total_bytes, detail);
    else line.update(p.bytes, p.total_bytes, detail);
  };
  PrepareStats st = prepare_dataset(o);
  if (a.flag("--verbose"))
    for (const std::string& s : st.skipped) std::printf("skipped %s\n", s.c_str());
  for (const std::string& s : st.shards) std::printf("wrote %s\n", s.c_str());
  std::printf("data prepare: %lld files (%zu skipped), %lld documents; train %lld documents / %lld tokens, "
              "val %lld documents / %lld tokens (%s tokenizer)\n",
              static_cast<long long>(st.files), st.skipped.size(), static_cast<long long>(st.documents),
              static_cast<long long>(st.train_documents), static_cast<long long>(st.train_tokens),
              static_cast<long long>(st.val_documents), static_cast<long long>(st.val_tokens), o.tokenizer.c_str());
  return 0;
}

CommandRegistrar reg({
    .path = {"data", "prepare"},
    .help = "Tokenize text files into llm.c token shards with a held-out validation shard",
    .options = {{.name = "-i,--input", .help = "text files or directories (e.g. /usr/share/games/fortunes)",
                 .kind = OptionKind::kList, .required = true},
                {.name = "-o,--output", .help = "output directory", .required = true},
                {.name = "--tokenizer", .help = "tokenizer", .default_value = "byte"},
                {.name = "--split", .help = "documents: auto | fortune | paragraph | file", .default_value = "auto"},
                {.name = "--val-fraction", .help = "share of documents held out for validation",
                 .default_value = "0.05"},
                {.name = "--shard-tokens", .help = "tokens per shard file at most", .default_value = "100000000"},
                {.name = "-v,--verbose", .help = "list skipped inputs", .kind = OptionKind::kFlag}},
    .run = data_prepare,
});

}  // namespace
}  // namespace quilt
