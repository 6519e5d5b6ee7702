// Sequence packing through the model: the per-document mask and restarted positions make a
// packed row compute exactly what its documents compute one at a time.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>

#include "engine/engine.h"
#include "models/llama/llama.h"
#include "tests/parallel/tiny_llama.h"
#include "tools/data.h"

using namespace quilt;
namespace fs = std::filesystem;

namespace {

constexpr uint32_t kDocToken = 49;  // the tiny model's last vocabulary entry stands for EOT

// 24 documents of 2..14 tokens, every fifth of 40 (random content in [0, 49)), each opening
// with kDocToken, over two shards; with rows of 32 tokens the long ones are cut.
std::shared_ptr<TokenDataset> random_documents(const fs::path& dir) {
  fs::create_directories(dir);
  std::vector<uint32_t> all;
  Tensor content = randint(0, 49, {24 * 40}, RngKey(7, "docs"));
  for (int64_t k = 0; k < 24; ++k) {
    all.push_back(kDocToken);
    const int64_t len = k % 5 == 0 ? 40 : 2 + (k * 29) % 13;
    for (int64_t j = 1; j < len; ++j) all.push_back(uint32_t(content.data<int64_t>()[k * 40 + j]));
  }
  const auto half = static_cast<std::ptrdiff_t>(all.size() / 2);
  write_token_shard((dir / "train_000000.bin").string(), std::vector<uint32_t>(all.begin(), all.begin() + half));
  write_token_shard((dir / "train_000001.bin").string(), std::vector<uint32_t>(all.begin() + half, all.end()));
  return std::make_shared<TokenDataset>((dir / "train_*.bin").string(), DataFormat::kLlmc);
}

Tensor loss_sum(LlamaForCausalLM& m, const Tensor& inputs, const Tensor& positions, const Tensor& docs,
                const Tensor& targets) {
  Tensor logits = m(inputs, positions, docs);
  return cross_entropy(logits.reshape({-1, m.config().vocab_size}), targets.reshape({-1}), -100, Reduction::sum);
}

std::map<std::string, std::vector<double>> grads_of(LlamaForCausalLM& m) {
  std::map<std::string, std::vector<double>> g;
  for (auto& [name, p] : m.named_parameters())
    if (p.grad().defined()) g[name] = p.grad().to_vector();
  return g;
}

// Largest |a - b| over every gradient, relative to the largest |a|.
double relative_grad_diff(const std::map<std::string, std::vector<double>>& a,
                          const std::map<std::string, std::vector<double>>& b) {
  double diff = 0, scale = 0;
  for (const auto& [name, va] : a) {
    const std::vector<double>& vb = b.at(name);
    for (size_t i = 0; i < va.size(); ++i) diff = std::max(diff, std::abs(va[i] - vb[i])), scale = std::max(scale, std::abs(va[i]));
  }
  return diff / scale;
}

struct Compared {
  double packed = 0, separate = 0, grad_diff = 0;
  int64_t documents = 0;
};

// The first step from stream position 0 on whose first row holds at least three documents.
PackedStep busy_step(const DataLoader& loader) {
  for (int64_t p = 0;; ++p) {
    PackedStep s = loader.packed_step(p, 0);
    if (s.rows[0].size() >= 3) return s;
  }
}

// One packed row (the first of busy_step) against its documents, each its own unpadded row at
// positions 0..L-1: summed losses and summed gradients.
Compared packed_vs_separate(LlamaForCausalLM& m, const DataLoader& loader, const TokenDataset& data) {
  const PackedStep step = busy_step(loader);
  const Batch b = loader.packed_batch(step, 0);
  Compared c;
  m.zero_grad();
  Tensor packed = loss_sum(m, b.inputs, b.positions, b.document_ids, b.targets);
  packed.backward();
  c.packed = packed.item<double>();
  const auto packed_grads = grads_of(m);
  m.zero_grad();
  for (const PackedPiece& p : step.rows[0]) {
    std::vector<int64_t> tok(static_cast<size_t>(p.length)), tgt(static_cast<size_t>(p.length), -100);
    data.read_tokens(p.start, p.length, tok.data());
    std::copy(tok.begin() + 1, tok.end(), tgt.begin());
    auto as_row = [&](const std::vector<int64_t>& v) {
      return from_vector(std::vector<double>(v.begin(), v.end()), {1, p.length}, {.dtype = DType::i64});
    };
    Tensor l = loss_sum(m, as_row(tok), arange(0, double(p.length)), Tensor(), as_row(tgt));
    l.backward();  // gradients accumulate over the documents
    c.separate += l.item<double>();
    ++c.documents;
  }
  c.grad_diff = relative_grad_diff(packed_grads, grads_of(m));
  return c;
}

}  // namespace

TEST_CASE("packing: a packed row's summed loss and gradients equal its documents' computed one at a time") {
  const fs::path dir = fs::temp_directory_path() / ("quilt_packing_test_" + std::to_string(::getpid()));
  auto data = random_documents(dir);
  for (DType dtype : {DType::f32, DType::f64}) {
    for (int64_t multiple : {1, 4}) {
      CAPTURE(float_dtype_name(dtype));
      CAPTURE(multiple);
      LlamaForCausalLM m(test::tiny_llama());
      m.init_weights(11);
      if (dtype == DType::f64) m.to(DType::f64);
      DataLoader loader(data, {.seq_len = 32, .global_batch_size = 2, .seed = 5, .packed_sequence_size = 32,
                               .document_token = kDocToken, .document_multiple = multiple});
      const Compared c = packed_vs_separate(m, loader, *data);
      CHECK(c.documents >= 3);  // the row really packs several documents
      const double tol = dtype == DType::f64 ? 1e-12 : 1e-5;
      CHECK(std::abs(c.packed - c.separate) <= tol * std::abs(c.separate));
      CHECK(c.grad_diff <= (dtype == DType::f64 ? 1e-10 : 1e-4));
    }
  }
  // Control: the same packed row without its document ids (one causal row) attends across
  // documents and loses that equality, so the check above does see the mask.
  LlamaForCausalLM m(test::tiny_llama());
  m.init_weights(11);
  DataLoader loader(data, {.seq_len = 32, .global_batch_size = 2, .seed = 5, .packed_sequence_size = 32,
                           .document_token = kDocToken});
  const Batch b = loader.packed_batch(busy_step(loader), 0);
  const double masked = loss_sum(m, b.inputs, b.positions, b.document_ids, b.targets).item<double>();
  const double unmasked = loss_sum(m, b.inputs, b.positions, Tensor(), b.targets).item<double>();
  CHECK(std::abs(masked - unmasked) > 1e-3 * std::abs(masked));
  fs::remove_all(dir);
}
