// Tokenizers turn text into token ids for `quilt data prepare` and back for samples in logs.
// The byte tokenizer needs no vocabulary file: bytes 0..255 are tokens 0..255 and token 256
// (end of text) separates documents, so its vocabulary has 257 entries. Models pad their
// embedding to a round size (recipes use vocab_size 320, a multiple of 64): the extra rows are
// never targets, so they only cost memory.
//
//   auto tok = make_tokenizer("byte");
//   std::vector<uint32_t> ids;  tok->encode("hi", ids);   // ids == {104, 105}
//   tok->decode(ids) == "hi";
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace quilt {

/// Text <-> token ids.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// The name a recipe uses for it (data.tokenizer).
  virtual std::string name() const = 0;
  /// Number of distinct token ids (ids are in [0, vocab_size)).
  virtual int64_t vocab_size() const = 0;
  /// The end-of-text id placed before every document.
  virtual uint32_t eot_token() const = 0;
  /// Appends the ids of `text` to `out`.
  virtual void encode(std::string_view text, std::vector<uint32_t>& out) const = 0;
  /// Text of `ids`; the end-of-text id becomes "<|endoftext|>". Throws on ids outside the vocabulary.
  virtual std::string decode(std::span<const uint32_t> ids) const = 0;
};

/// Bytes as tokens plus one end-of-text token (256).
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr uint32_t kEot = 256;
  std::string name() const override { return "byte"; }
  int64_t vocab_size() const override { return 257; }
  uint32_t eot_token() const override { return kEot; }
  void encode(std::string_view text, std::vector<uint32_t>& out) const override;
  std::string decode(std::span<const uint32_t> ids) const override;
};

/// Names make_tokenizer accepts.
const std::vector<std::string>& tokenizer_names();
/// The tokenizer called `name`; throws naming data.tokenizer and the available names.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name);

}  // namespace quilt
