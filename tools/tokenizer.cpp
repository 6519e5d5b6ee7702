// The byte tokenizer and the tokenizer factory.
#include "tools/tokenizer.h"

#include "engine/error.h"

namespace quilt {

void ByteTokenizer::encode(std::string_view text, std::vector<uint32_t>& out) const {
  out.reserve(out.size() + text.size());
  for (char c : text) out.push_back(static_cast<unsigned char>(c));
}

std::string ByteTokenizer::decode(std::span<const uint32_t> ids) const {
  std::string out;
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    if (id < 256) {
      out.push_back(static_cast<char>(id));
    } else if (id == kEot) {
      out += "<|endoftext|>";
    } else {
      fail("[tokenizer] byte tokenizer: id ", id, " at position ", i, " is outside the vocabulary of 257");
    }
  }
  return out;
}

const std::vector<std::string>& tokenizer_names() {
  static const std::vector<std::string> names = {"byte"};
  return names;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name) {
  if (name == "byte") return std::make_unique<ByteTokenizer>();
  fail("[data] data.tokenizer '", name, "' is not one of: byte");
}

}  // namespace quilt
