// Recipe parsing: YAML tree -> overrides -> typed structs with every key checked, and back.
#include "tools/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <variant>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "collectives/launch.h"
#include "engine/error.h"
#include "engine/io/safetensors.h"
#include "parallel/context_parallel.h"
#include "parallel/pipeline/schedule.h"
#include "tools/tokenizer.h"

namespace quilt {

// ---- names of enum values ---------------------------------------------------------------

const char* data_format_name(DataFormat f) { return f == DataFormat::kLlmc ? "llmc" : "nanogpt"; }

const char* decay_name(Decay d) { return d == Decay::kCosine ? "cosine" : "linear"; }
const char* train_device_name(TrainDevice d) { return d == TrainDevice::kCpu ? "cpu" : "cuda"; }

const char* backend_name(Backend b) {
  static const char* const kNames[] = {"mpi", "nccl", "threads"};
  return kNames[static_cast<int>(b)];
}

std::optional<DType> parse_float_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32" || s == "f32") return DType::f32;
  if (s == "bfloat16" || s == "bf16") return DType::bf16;
  if (s == "float16" || s == "fp16" || s == "f16" || s == "half") return DType::f16;
  if (s == "float64" || s == "fp64" || s == "f64") return DType::f64;
  return std::nullopt;
}

const char* float_dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::f64: return "float64";
    default: return dtype_name(d);
  }
}

bool ModelConfig::is_sparse_layer(int64_t layer) const {
  if (num_experts <= 0 || layer < first_k_dense_replace || (layer + 1) % std::max<int64_t>(1, decoder_sparse_step) != 0)
    return false;
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

int64_t ModelConfig::num_parameters() const {
  const int64_t h = hidden_size, hd = head_dimension();
  const int64_t attn = h * num_attention_heads * hd * 2 + h * kv_heads() * hd * 2;  // q, o and k, v
  const bool qk = qk_norm.value_or(model_type != "llama");
  int64_t total = vocab_size * h * (tie_word_embeddings ? 1 : 2) + h;
  for (int64_t l = 0; l < num_hidden_layers; ++l) {
    int64_t mlp = 3 * h * intermediate_size;  // gate, up, down
    if (is_sparse_layer(l))                   // router, routed and shared experts
      mlp = num_experts * h + 3 * h * moe_intermediate_size * (num_experts + n_shared_experts);
    total += attn + mlp + 2 * h + (qk ? 2 * hd : 0);  // + two RMSNorms (+ q/k norms)
  }
  return total;
}

namespace {

const std::vector<std::string> kModelTypes = {"llama", "qwen3", "qwen3_moe"};

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

// ---- where a value came from, for error messages --------------------------------------------

struct Context {
  std::string source;
  std::map<std::string, std::string> overrides;  // dotted key -> the --set text that wrote it

  // " (recipe.yaml:12)" or " (from --set train.steps=abc)".
  std::string where(const std::string& key, const YAML::Node& node) const {
    // A --set of a whole section ("distributed.pipeline={...}") covers every key below it.
    for (std::string k = key;;) {
      auto it = overrides.find(k);
      if (it != overrides.end()) return " (from --set " + it->second + ")";
      size_t dot = k.rfind('.');
      if (dot == std::string::npos) break;
      k.resize(dot);
    }
    // A key that exists only because a --set wrote below it ("trian.steps=3" makes "trian").
    auto below = overrides.lower_bound(key + ".");
    if (below != overrides.end() && below->first.rfind(key + ".", 0) == 0)
      return " (from --set " + below->second + ")";
    if (node.IsDefined() && !node.Mark().is_null()) return detail::concat(" (", source, ":", node.Mark().line + 1, ")");
    return "";
  }
};

// What a node holds, for "expected X, got Y" messages.
std::string describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Scalar: return "'" + n.Scalar() + "'";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Null: return "nothing (null)";
    default: return "nothing";
  }
}

bool is_none_word(const std::string& s) {
  return s.empty() || s == "none" || s == "None" || s == "null" || s == "Null" || s == "NULL" || s == "~";
}

// An unquoted none / null / ~ / empty value.
bool is_none(const YAML::Node& n) {
  if (n.IsNull()) return true;
  if (!n.IsScalar() || n.Tag() == "!") return false;  // quoted "none" is the string none
  return !n.Scalar().empty() && is_none_word(n.Scalar());
}

// Shortest text that reads back as the same double.
std::string format_double(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, res.ptr);
}

// ---- one YAML map, read key by key ----------------------------------------------------------

// Reads the keys of one section; finish() rejects any key that no get() asked for, naming the
// full dotted key and listing the valid ones.
class Section {
 public:
  Section(const YAML::Node& node, std::string prefix, const Context& ctx) : prefix_(std::move(prefix)), ctx_(ctx) {
    if (!node.IsDefined() || is_none(node)) return;
    QUILT_CHECK(node.IsMap(), "[config] ", prefix_.empty() ? ctx.source : prefix_, ": expected a map of keys, got ",
                describe(node), ctx.where(prefix_, node));
    for (auto it = node.begin(); it != node.end(); ++it) {
      QUILT_CHECK(it->first.IsScalar(), "[config] ", prefix_, ": keys must be plain names, got ",
                  describe(it->first), ctx.where(prefix_, it->first));
      const std::string name = it->first.Scalar();
      for (const Entry& e : entries_)
        QUILT_CHECK(e.name != name, "[config] key '", full(name), "' appears twice", ctx.where(full(name), it->first));
      entries_.push_back({name, it->first, it->second});
    }
  }

  std::string full(const std::string& key) const { return prefix_.empty() ? key : prefix_ + "." + key; }

  // The node of `key` (undefined when absent); marks the key as known.
  YAML::Node get(const std::string& key) {
    if (std::find(known_.begin(), known_.end(), key) == known_.end()) known_.push_back(key);
    for (const Entry& e : entries_)
      if (e.name == key) return e.value;
    return YAML::Node(YAML::NodeType::Undefined);
  }

  void finish() const {
    for (const Entry& e : entries_) {
      if (std::find(known_.begin(), known_.end(), e.name) != known_.end()) continue;
      fail("[config] unknown key '", full(e.name), "'", ctx_.where(full(e.name), e.key), "; valid keys",
           prefix_.empty() ? "" : " of " + prefix_, ": ", join(known_));
    }
  }

  const Context& ctx() const { return ctx_; }

 private:
  struct Entry {
    std::string name;
    YAML::Node key, value;
  };
  std::string prefix_;
  const Context& ctx_;
  std::vector<Entry> entries_;
  std::vector<std::string> known_;
};

[[noreturn]] void bad_type(const Context& ctx, const std::string& key, const YAML::Node& n, const char* expected) {
  fail("[config] ", key, ": expected ", expected, ", got ", describe(n), ctx.where(key, n));
}

// ---- settings as they are written back ------------------------------------------------------

// One setting as recipe_to_yaml writes it: a scalar, or a map of named settings.
struct Item {
  std::string name, text;
  bool quoted = false;  // a string that would read back as none or auto
  bool is_map = false;
  std::vector<Item> items;
  const char* doc = "";
  const char* ignored = nullptr;  // accepted, but nothing uses it yet: why (inherited by the items)
};

Item scalar(std::string text, bool quoted = false) {
  Item v;
  v.text = std::move(text), v.quoted = quoted;
  return v;
}

// "8" or "{rope_type: llama3, factor: 8}", for messages.
std::string compact(const Item& v) {
  if (!v.is_map) return v.quoted ? "\"" + v.text + "\"" : v.text;
  std::vector<std::string> parts;
  for (const Item& c : v.items) parts.push_back(c.name + ": " + compact(c));
  return "{" + join(parts) + "}";
}

// One leaf of an Item tree: the dotted key, its YAML text, and the notes it inherits.
struct Leaf {
  std::string key, text;
  const char* doc;
  const char* ignored;
  bool operator==(const Leaf& o) const { return key == o.key && text == o.text; }
};

void flatten(const Item& v, const std::string& key, const char* ignored, std::vector<Leaf>& out) {
  const char* note = v.ignored ? v.ignored : ignored;
  if (!v.is_map) return out.push_back({key, compact(v), v.doc, note});
  for (const Item& c : v.items) flatten(c, key.empty() ? c.name : key + "." + c.name, note, out);
}

void emit(YAML::Emitter& out, const Item& v) {
  if (!v.is_map) {
    if (v.quoted) out << YAML::DoubleQuoted;
    out << v.text;
    return;
  }
  out << YAML::BeginMap;
  for (const Item& c : v.items) {
    out << YAML::Key << c.name << YAML::Value;
    emit(out, c);
  }
  out << YAML::EndMap;
}

// ---- the tables: one Field per key -----------------------------------------------------------

// One key of section S: how to read it (type and value rules, errors naming the dotted key),
// how to write it back, and what it means.
template <class S>
struct Field {
  std::string key;
  std::function<void(S&, const YAML::Node&, const std::string& dotted_key, Section&)> read;
  std::function<Item(const S&)> write;
  const char* doc = "";
  const char* ignored = nullptr;  // non-default values are accepted but change nothing yet: why
  bool section = false;           // read even when absent, so the section's own rules run
  std::vector<std::string> aliases;
};

// A section: its fields in recipe order, and the rules between them (run after reading).
template <class S>
struct Table {
  std::vector<Field<S>> fields;
  void (*check)(const S&) = nullptr;
};

template <class S>
Item to_item(const Table<S>& t, const S& s) {
  Item out;
  out.is_map = true;
  for (const Field<S>& f : t.fields) {
    out.items.push_back(f.write(s));
    out.items.back().name = f.key, out.items.back().doc = f.doc, out.items.back().ignored = f.ignored;
  }
  return out;
}

// Reads every field present in `sec` (or its alias: giving both names is an error).
template <class S>
void read_fields(const Table<S>& t, S& s, Section& sec) {
  for (const Field<S>& f : t.fields) {
    YAML::Node n = sec.get(f.key);
    std::string k = sec.full(f.key);
    for (const std::string& a : f.aliases) {
      YAML::Node an = sec.get(a);
      if (!an.IsDefined()) continue;
      QUILT_CHECK(!n.IsDefined(), "[config] ", k, " and ", sec.full(a), " are the same setting; give only one",
                  sec.ctx().where(sec.full(a), an));
      n.reset(an);
      k = sec.full(a);
    }
    if (n.IsDefined() || f.section) f.read(s, n, k, sec);
  }
}

// Value kinds: read(out, node, dotted key, ctx) checks the type and the value rules; write(v)
// is the text that reads back as v.
template <class T>
T parse_number(const Context& c, const YAML::Node& n, const std::string& k, const char* what) {
  if (!n.IsScalar()) bad_type(c, k, n, what);
  const std::string& s = n.Scalar();
  const char* b = s.data() + (!s.empty() && s[0] == '+');
  T v{};
  auto res = std::from_chars(b, s.data() + s.size(), v);
  if (res.ec != std::errc() || res.ptr != s.data() + s.size() || s.empty()) bad_type(c, k, n, what);
  return v;
}

struct Int {
  using type = int64_t;
  int64_t min;
  void read(int64_t& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    out = parse_number<int64_t>(c, n, k, "an integer");
    QUILT_CHECK(out >= min, "[config] ", k, " must be >= ", min, ", got ", out, c.where(k, n));
  }
  Item write(int64_t v) const { return scalar(std::to_string(v)); }
};

// A finite number with an inclusive lower bound, or an exclusive one when `strict`.
struct Real {
  using type = double;
  double min;
  bool strict;
  const char* hint = "";
  void read(double& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    out = parse_number<double>(c, n, k, n.IsScalar() ? "a finite number" : "a number");
    if (!std::isfinite(out)) bad_type(c, k, n, "a finite number");
    QUILT_CHECK(strict ? out > min : out >= min, "[config] ", k, " must be ", strict ? "> " : ">= ",
                format_double(min), hint, ", got ", n.Scalar(), c.where(k, n));
  }
  Item write(double v) const { return scalar(format_double(v)); }
};

struct Bool {
  using type = bool;
  void read(bool& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    std::string s = n.IsScalar() ? n.Scalar() : "";
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
    if (s == "true" || s == "yes" || s == "on") out = true;
    else if (s == "false" || s == "no" || s == "off") out = false;
    else bad_type(c, k, n, "true or false");
  }
  Item write(bool v) const { return scalar(v ? "true" : "false"); }
};

// true, false, or a group size N >= 1 (FSDP2's reshard_after_forward).
struct BoolOrSize {
  using type = std::variant<bool, int64_t>;
  void read(type& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    std::string s = n.IsScalar() ? n.Scalar() : "";
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
    if (s == "true" || s == "yes" || s == "on") return void(out = true);
    if (s == "false" || s == "no" || s == "off") return void(out = false);
    if (!s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char ch) { return std::isdigit(ch); })) {
      const int64_t v = parse_number<int64_t>(c, n, k, "true, false or a group size");
      QUILT_CHECK(v >= 1, "[config] ", k, " must be true, false or a group size >= 1, got ", v, c.where(k, n));
      return void(out = v);
    }
    bad_type(c, k, n, "true, false or a group size");
  }
  Item write(const type& v) const {
    if (const bool* b = std::get_if<bool>(&v)) return scalar(*b ? "true" : "false");
    return scalar(std::to_string(std::get<int64_t>(v)));
  }
};

struct Str {
  using type = std::string;
  const char* nonempty = nullptr;  // set: '' is rejected, this saying what is expected
  void read(std::string& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    if (!n.IsScalar()) bad_type(c, k, n, "a string");
    out = n.Scalar();
    // yaml-cpp reads any bytes but writes U+FFFD for invalid UTF-8, so recipe_to_yaml would change the value.
    if (const size_t bad = first_invalid_utf8(out); bad != std::string::npos)
      fail("[config] ", k, ": the value is not valid UTF-8 (byte ", bad, ")", c.where(k, n));
    QUILT_CHECK(!nonempty || !out.empty(), "[config] ", k, ": expected ", nonempty, ", got ''", c.where(k, n));
  }
  Item write(const std::string& v) const { return scalar(v, is_none_word(v)); }
};

// One of `names`; the error lists them all.
// A list of integers >= min: [1, 3] (a YAML sequence), or [] for none.
struct IntList {
  using type = std::vector<int64_t>;
  int64_t min;
  void read(type& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    // A flow list may also come as one scalar (an --set value, a config.json array).
    YAML::Node seq = n;
    if (n.IsScalar() && !n.Scalar().empty() && n.Scalar().front() == '[') {
      try {
        seq = YAML::Load(n.Scalar());
      } catch (const YAML::Exception&) {
        bad_type(c, k, n, "a list of integers like [1, 3]");
      }
    }
    if (!seq.IsSequence()) bad_type(c, k, n, "a list of integers like [1, 3]");
    out.clear();
    for (size_t i = 0; i < seq.size(); ++i) {
      int64_t v = 0;
      Int{min}.read(v, seq[i], k + "[" + std::to_string(i) + "]", c);
      out.push_back(v);
    }
  }
  Item write(const type& v) const {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return scalar(s + "]");
  }
};

struct Choice {
  using type = std::string;
  std::vector<std::string> names;
  void read(std::string& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    if (n.IsScalar() && std::find(names.begin(), names.end(), n.Scalar()) != names.end()) return void(out = n.Scalar());
    fail("[config] ", k, ": expected one of ", join(names, " | "), ", got ", describe(n), c.where(k, n));
  }
  Item write(const std::string& v) const { return scalar(v); }
};

// An enum spelled by its name function (decay_name, backend_name, ...).
template <class E>
struct Enum {
  using type = E;
  std::vector<E> values;
  const char* (*name)(E);
  void read(E& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    Choice words;
    for (E e : values) words.names.push_back(name(e));
    std::string s;
    words.read(s, n, k, c);
    out = values[std::find(words.names.begin(), words.names.end(), s) - words.names.begin()];
  }
  Item write(E v) const { return scalar(name(v)); }
};

struct Dtype {
  using type = DType;
  bool none_ok = false;  // only for the message: Opt reads none
  void read(DType& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    std::optional<DType> d = n.IsScalar() ? parse_float_dtype(n.Scalar()) : std::nullopt;
    if (!d) bad_type(c, k, n, none_ok ? "float32 | bfloat16 | float16 | float64 | none"
                                      : "float32 | bfloat16 | float16 | float64");
    out = *d;
  }
  Item write(DType v) const { return scalar(float_dtype_name(v)); }
};

// An unquoted none (null, ~) or a value of kind K.
template <class K>
struct Opt {
  using type = std::optional<typename K::type>;
  K inner;
  void read(type& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    if (is_none(n)) return out.reset();
    typename K::type v{};
    inner.read(v, n, k, c);
    out = v;
  }
  Item write(const type& v) const { return v ? inner.write(*v) : scalar("none"); }
};

// A nested section (distributed.pipeline, the sections of a recipe): keys not given keep their defaults.
template <class C>
struct Sub {
  using type = C;
  const Table<C>& (*table)();
  void read(C& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    Section s(n, k, c);
    read_fields(table(), out, s);
    s.finish();
    if (table().check) table().check(out);
  }
  Item write(const C& v) const { return to_item(table(), v); }
};

template <class K>
constexpr bool kIsSub = false;
template <class C>
constexpr bool kIsSub<Sub<C>> = true;

// The Field of member `m` of S, read and written as kind K.
template <class S, class T, class K>
Field<S> field(const char* key, T S::*m, K kind, const char* doc, const char* ignored = nullptr) {
  static_assert(std::is_same_v<T, typename K::type>, "the kind reads another type than the member holds");
  auto read = [m, kind](S& s, const YAML::Node& n, const std::string& k, Section& sec) {
    kind.read(s.*m, n, k, sec.ctx());
  };
  return {key, read, [m, kind](const S& s) { return kind.write(s.*m); }, doc, ignored, kIsSub<K>, {}};
}

const Table<RopeParameters>& rope_table() {
  using R = RopeParameters;
  static const Table<R> t{{
      field("rope_type", &R::rope_type, Choice{{"default", "llama3"}}, "default: plain RoPE"),
      field("factor", &R::factor, Real{1, false}, "wavelength scaling of the low frequencies"),
      field("low_freq_factor", &R::low_freq_factor, Real{0, true}, "llama3 band edge (low)"),
      field("high_freq_factor", &R::high_freq_factor, Real{0, true}, "llama3 band edge (high)"),
      field("original_max_position_embeddings", &R::original_max_position_embeddings, Int{1}, "trained context"),
  }};
  return t;
}

// model.rope_parameters (HF's older name: rope_scaling). HF v5 may keep rope_theta inside it.
Field<ModelConfig> rope_field() {
  Field<ModelConfig> f;
  f.key = "rope_parameters";
  f.aliases = {"rope_scaling"};
  f.doc = "RoPE frequency scaling {rope_type: llama3, factor, ...}; none: plain RoPE";
  f.read = [](ModelConfig& m, const YAML::Node& n, const std::string& k, Section& s) {
    if (is_none(n)) return m.rope_parameters.reset();
    Section r(n, k, s.ctx());
    RopeParameters p;
    read_fields(rope_table(), p, r);
    YAML::Node inner = r.get("rope_theta");
    r.finish();
    if (inner.IsDefined()) {
      double theta = 0;
      Real{0, true}.read(theta, inner, k + ".rope_theta", s.ctx());
      QUILT_CHECK(!s.get("rope_theta").IsDefined() || theta == m.rope_theta, "[config] ", k, ".rope_theta ",
                  format_double(theta), " differs from model.rope_theta ", format_double(m.rope_theta),
                  "; give it once");
      m.rope_theta = theta;
    }
    QUILT_CHECK(p.high_freq_factor > p.low_freq_factor, "[config] ", k, ".high_freq_factor ",
                format_double(p.high_freq_factor), " must be greater than low_freq_factor ",
                format_double(p.low_freq_factor), s.ctx().where(k, n));
    if (p.rope_type == "default") m.rope_parameters.reset();
    else m.rope_parameters = p;
  };
  f.write = [](const ModelConfig& m) {
    return m.rope_parameters ? to_item(rope_table(), *m.rope_parameters) : scalar("none");
  };
  return f;
}

const Table<ModelConfig>& model_table() {
  using M = ModelConfig;
  static const Table<M> t{{
      field("model_type", &M::model_type, Choice{kModelTypes}, "decoder family (HF model_type)"),
      field("hidden_size", &M::hidden_size, Int{1}, "width of the residual stream"),
      field("intermediate_size", &M::intermediate_size, Int{1}, "width of the MLP"),
      field("num_hidden_layers", &M::num_hidden_layers, Int{1}, "decoder blocks"),
      field("num_attention_heads", &M::num_attention_heads, Int{1}, "query heads"),
      field("num_key_value_heads", &M::num_key_value_heads, Opt<Int>{{1}}, "key/value heads; none: no GQA"),
      field("head_dim", &M::head_dim, Opt<Int>{{1}}, "none: hidden_size / num_attention_heads"),
      field("rms_norm_eps", &M::rms_norm_eps, Real{0, true}, "RMSNorm epsilon"),
      field("rope_theta", &M::rope_theta, Real{0, true}, "RoPE base"),
      rope_field(),
      field("vocab_size", &M::vocab_size, Int{1}, "embedding rows; at least the tokenizer's ids"),
      field("tie_word_embeddings", &M::tie_word_embeddings, Bool{}, "the LM head reuses the embedding"),
      field("max_position_embeddings", &M::max_position_embeddings, Int{1}, "longest sequence"),
      field("initializer_range", &M::initializer_range, Real{0, true}, "std of the random init"),
      field("pretrained", &M::pretrained, Opt<Str>{{"a directory with HF config.json and model.safetensors"}},
            "HF checkpoint directory to start from (config.json + model.safetensors[.index.json]); none: random"),
      field("qk_norm", &M::qk_norm, Opt<Bool>{}, "RMSNorm of each head's q and k; none: qwen3* yes, llama no"),
      field("num_experts", &M::num_experts, Int{0}, "routed experts of an MoE layer; 0: dense"),
      field("num_experts_per_tok", &M::num_experts_per_tok, Int{1}, "experts each token is routed to (top-k)"),
      field("moe_intermediate_size", &M::moe_intermediate_size, Int{0}, "width of each expert's MLP"),
      field("norm_topk_prob", &M::norm_topk_prob, Bool{}, "renormalise the k chosen scores"),
      field("decoder_sparse_step", &M::decoder_sparse_step, Int{1}, "layer i is MoE when (i + 1) % step == 0"),
      field("mlp_only_layers", &M::mlp_only_layers, IntList{0}, "layers kept dense"),
      field("first_k_dense_replace", &M::first_k_dense_replace, Int{0}, "the first k layers stay dense"),
      field("scoring_func", &M::scoring_func, Choice{{"softmax", "sigmoid"}}, "router scores"),
      field("n_group", &M::n_group, Int{1}, "group-limited routing: expert groups"),
      field("topk_group", &M::topk_group, Int{1}, "groups a token may use"),
      field("routed_scaling_factor", &M::routed_scaling_factor, Real{0, true}, "scale of the routed sum"),
      field("n_shared_experts", &M::n_shared_experts, Int{0}, "shared experts (one dense SwiGLU) per MoE layer"),
      field("score_correction_bias", &M::score_correction_bias, Bool{}, "routers carry e_score_correction_bias"),
      field("load_balance_coeff", &M::load_balance_coeff, Real{0, false}, "aux-loss-free bias step; 0: off"),
      field("router_aux_loss_coef", &M::router_aux_loss_coef, Real{0, false}, "sequence-level balance loss; 0: off"),
  }, [](const ModelConfig& m) {
    QUILT_CHECK(m.num_attention_heads % m.kv_heads() == 0, "[config] model.num_attention_heads ",
                m.num_attention_heads, " is not divisible by model.num_key_value_heads ", m.kv_heads(),
                " (grouped-query attention shares each key/value head among a whole number of query heads)");
    QUILT_CHECK(m.head_dim || m.hidden_size % m.num_attention_heads == 0, "[config] model.hidden_size ",
                m.hidden_size, " is not divisible by model.num_attention_heads ", m.num_attention_heads,
                "; set model.head_dim explicitly");
    if (m.num_experts > 0) {
      QUILT_CHECK(m.moe_intermediate_size > 0, "[config] model.num_experts ", m.num_experts,
                  " needs model.moe_intermediate_size > 0");
      QUILT_CHECK(m.num_experts_per_tok <= m.num_experts, "[config] model.num_experts_per_tok ",
                  m.num_experts_per_tok, " exceeds model.num_experts ", m.num_experts);
      QUILT_CHECK(m.num_experts % m.n_group == 0, "[config] model.n_group ", m.n_group,
                  " does not divide model.num_experts ", m.num_experts);
      QUILT_CHECK(m.topk_group <= m.n_group, "[config] model.topk_group ", m.topk_group, " exceeds model.n_group ",
                  m.n_group);
      for (int64_t l : m.mlp_only_layers)
        QUILT_CHECK(l < m.num_hidden_layers, "[config] model.mlp_only_layers names layer ", l,
                    " but the model has ", m.num_hidden_layers, " layers");
    }
  }};
  return t;
}

const Table<DataConfig>& data_table() {
  using D = DataConfig;
  static const Table<D> t{{
      field("path", &D::path, Str{}, "training shards: a directory of *.bin, a glob, or one file"),
      field("val_path", &D::val_path, Opt<Str>{}, "validation shards; none: no validation"),
      field("tokenizer", &D::tokenizer, Choice{tokenizer_names()}, "tokenizer the shards were made with"),
      field("format", &D::format, Enum<DataFormat>{{DataFormat::kLlmc, DataFormat::kNanogpt}, data_format_name},
            "shard layout: llmc (header + tokens) | nanogpt (raw uint16)"),
  }, [](const DataConfig& d) {
    QUILT_CHECK(!d.path.empty() && d.path != "none", "[config] data.path is required: a directory of token "
                "shards, a glob, or one file (make them with `quilt data prepare`)");
  }};
  return t;
}

const Table<PackedSequenceConfig>& packed_sequence_table() {
  using P = PackedSequenceConfig;
  static const Table<P> t{{
      field("packed_sequence_size", &P::packed_sequence_size, Int{0},
            "tokens per row packed from whole documents (must equal train.seq_len; micro_batch_size 1); 0: off"),
      field("document_multiple", &P::document_multiple, Int{0},
            "pad each packed document to a multiple of this (0: 2 * cp_size under cp, else 1)"),
  }};
  return t;
}

const Table<TrainConfig>& train_table() {
  using T = TrainConfig;
  static const Table<T> t{{
      field("steps", &T::steps, Int{0}, "optimizer steps (0: only export, with checkpoint.save_consolidated)"),
      field("global_batch_size", &T::global_batch_size, Int{1}, "sequences per step over all data-parallel ranks"),
      field("micro_batch_size", &T::micro_batch_size, Int{1}, "sequences per rank per forward/backward"),
      field("seq_len", &T::seq_len, Int{1}, "tokens per sequence"),
      field("lr", &T::lr, Real{0, true}, "peak learning rate"),
      field("min_lr", &T::min_lr, Real{0, false}, "learning rate at the end of the decay"),
      field("warmup_steps", &T::warmup_steps, Int{0}, "linear warm-up steps (may exceed steps)"),
      field("decay", &T::decay, Enum<Decay>{{Decay::kCosine, Decay::kLinear}, decay_name},
            "learning-rate decay after warm-up"),
      field("weight_decay", &T::weight_decay, Real{0, false}, "AdamW weight decay"),
      field("beta1", &T::beta1, Real{0, false}, "AdamW beta1 (< 1)"),
      field("beta2", &T::beta2, Real{0, false}, "AdamW beta2 (< 1)"),
      field("eps", &T::eps, Real{0, true}, "AdamW epsilon"),
      field("max_grad_norm", &T::max_grad_norm, Opt<Real>{{0, true, " (or none for no clipping)"}},
            "gradient clipping norm; none: no clipping"),
      field("seed", &T::seed, Int{0}, "initialisation and data-order seed"),
      field("dtype", &T::dtype, Dtype{}, "master weights and optimizer state"),
      field("param_dtype", &T::param_dtype, Opt<Dtype>{{true}}, "compute dtype of parameters; none: dtype"),
      field("reduce_dtype", &T::reduce_dtype, Opt<Dtype>{{true}}, "gradient reduction dtype; none: dtype"),
      field("output_dtype", &T::output_dtype, Opt<Dtype>{{true}}, "dtype of module outputs; none: dtype"),
      field("eval_every", &T::eval_every, Int{0}, "steps between evaluations; 0: never"),
      field("eval_steps", &T::eval_steps, Int{1}, "global batches per evaluation"),
      field("max_skipped_steps", &T::max_skipped_steps, Int{0},
            "consecutive skipped (non-finite) steps that stop the run; 0: never stop"),
      field("device", &T::device, Enum<TrainDevice>{{TrainDevice::kCpu, TrainDevice::kCuda}, train_device_name},
            "where the model, gradients, optimizer state and batches live: cpu, or cuda (one GPU, one rank)"),
      field("cuda_graphs", &T::cuda_graphs, Bool{},
            "train.device cuda: after two eager steps, capture the step (forward, backward, clipping, AdamW) "
            "in a CUDA graph once and replay it every step"),
  }, [](const TrainConfig& t) {
    QUILT_CHECK(!t.cuda_graphs || t.device == TrainDevice::kCuda,
                "[config] train.cuda_graphs captures a GPU step: it needs train.device: cuda");
    QUILT_CHECK(t.beta1 < 1, "[config] train.beta1 must be < 1, got ", format_double(t.beta1));
    QUILT_CHECK(t.beta2 < 1, "[config] train.beta2 must be < 1, got ", format_double(t.beta2));
    QUILT_CHECK(t.min_lr <= t.lr, "[config] train.min_lr ", format_double(t.min_lr), " is greater than train.lr ",
                format_double(t.lr));
    QUILT_CHECK(t.global_batch_size % t.micro_batch_size == 0, "[config] train.global_batch_size ",
                t.global_batch_size, " is not divisible by train.micro_batch_size ", t.micro_batch_size);
  }};
  return t;
}

const Table<PipelineConfig>& pipeline_table() {
  using P = PipelineConfig;
  static const Table<P> t{{
      field("pp_schedule", &P::pp_schedule, Choice{pipeline_schedule_names()}, "pipeline schedule"),
      field("pp_microbatch_size", &P::pp_microbatch_size, Int{1}, "sequences per pipeline micro-batch"),
      field("scale_grads_in_schedule", &P::scale_grads_in_schedule, Bool{}, "the schedule scales gradients"),
  }};
  return t;
}

const Table<MoeConfig>& moe_table() {
  using E = MoeConfig;
  static const Table<E> t{{
      field("reshard_after_forward", &E::reshard_after_forward, Bool{}, "ep > 1: expert FSDP units reshard"),
      field("ignore_router_for_ac", &E::ignore_router_for_ac, Bool{},
            "ep > 1: AC recomputation reuses the router's choice of experts"),
      field("wrap_outer_model", &E::wrap_outer_model, Bool{},
            "ep > 1: the embedding and final norm one FSDP unit apart from the head"),
  }};
  return t;
}

const Table<DistributedConfig>& distributed_table() {
  using D = DistributedConfig;
  static const Table<D> t{{
      field("strategy", &D::strategy,
            Enum<Strategy>{{Strategy::kFsdp2, Strategy::kMegatronFsdp, Strategy::kDdp}, strategy_name},
            "data-parallel strategy"),
      field("dp_size", &D::dp_size, Opt<Int>{{1}}, "none: world / (tp * pp * cp)"),
      field("dp_replicate_size", &D::dp_replicate_size, Opt<Int>{{1}}, "HSDP replicas (fsdp2); none: no HSDP"),
      field("tp_size", &D::tp_size, Int{1}, "tensor parallelism"),
      field("pp_size", &D::pp_size, Int{1}, "pipeline stages"),
      field("cp_size", &D::cp_size, Int{1}, "context parallelism"),
      field("cp_comm_type", &D::cp_comm_type, Choice{{"ring", "all_gather", "a2a"}},
            "cp attention: ring (K/V rotate), all_gather (K/V gathered once), a2a (heads exchanged)"),
      field("ep_size", &D::ep_size, Int{1}, "expert parallelism; divides dp * cp"),
      field("sequence_parallel", &D::sequence_parallel, Bool{}, "shard norms and dropout over tp"),
      field("activation_checkpointing", &D::activation_checkpointing, Bool{}, "recompute blocks in backward"),
      field("activation_checkpointing_mode", &D::activation_checkpointing_mode, Choice{{"full", "selective"}},
            "selective keeps matmul outputs"),
      field("reshard_after_forward", &D::reshard_after_forward, BoolOrSize{},
            "fsdp2: false keeps gathered blocks; N reshards to groups of N ranks"),
      field("defer_fsdp_grad_sync", &D::defer_fsdp_grad_sync, Bool{}, "reduce gradients once per step"),
      field("pipeline", &D::pipeline, Sub<PipelineConfig>{pipeline_table}, "pipeline schedule"),
      field("moe", &D::moe, Sub<MoeConfig>{moe_table}, "mixture-of-experts wrapping"),
  }};
  return t;
}

const Table<DistEnvConfig>& dist_env_table() {
  using E = DistEnvConfig;
  static const Table<E> t{{
      field("backend", &E::backend,
            Enum<Backend>{{Backend::kMpi, Backend::kNccl, Backend::kThreads}, backend_name},
            "communication backend"),
      field("timeout_s", &E::timeout_s, Real{0, true}, "a slower collective aborts the job"),
  }};
  return t;
}

// checkpoint.resume: auto | none | a path (a quoted "auto" is the path auto).
struct Resume {
  using type = ResumeSpec;
  void read(ResumeSpec& out, const YAML::Node& n, const std::string& k, const Context& c) const {
    if (is_none(n)) return void(out = {ResumeSpec::Kind::kNone, ""});
    std::string v;
    Str{"auto | none | a checkpoint path"}.read(v, n, k, c);
    if (v == "auto" && n.Tag() != "!") out = {ResumeSpec::Kind::kAuto, ""};
    else out = {ResumeSpec::Kind::kPath, v};
  }
  Item write(const ResumeSpec& r) const {
    if (r.kind == ResumeSpec::Kind::kPath) return scalar(r.path, r.path == "auto" || is_none_word(r.path));
    return scalar(r.kind == ResumeSpec::Kind::kAuto ? "auto" : "none");
  }
};

const Table<CheckpointConfig>& checkpoint_table() {
  using C = CheckpointConfig;
  static const Table<C> t{{
      field("dir", &C::dir, Opt<Str>{}, "none: no checkpoints"),
      field("every_steps", &C::every_steps, Int{0}, "0: only at the end"),
      field("keep_last", &C::keep_last, Int{0}, "0: keep all"),
      field("resume", &C::resume, Resume{}, "auto (newest in dir) | none | a checkpoint path"),
      field("save_consolidated", &C::save_consolidated, Bool{}, "also write HF safetensors at the end"),
  }, [](const CheckpointConfig& c) {
    QUILT_CHECK(c.dir || c.every_steps == 0, "[config] checkpoint.every_steps is ", c.every_steps,
                " but checkpoint.dir is none; set checkpoint.dir");
    QUILT_CHECK(c.dir || !c.save_consolidated, "[config] checkpoint.save_consolidated is true but checkpoint.dir is "
                "none; set checkpoint.dir");
  }};
  return t;
}

const Table<LoggingConfig>& logging_table() {
  using L = LoggingConfig;
  static const Table<L> t{{
      field("dir", &L::dir, Opt<Str>{}, "metrics files; none: stdout only"),
      field("every_steps", &L::every_steps, Int{1}, "steps between metrics lines"),
      field("rank0_only", &L::rank0_only, Bool{}, "only rank 0 logs"),
      field("trace", &L::trace, Bool{}, "write a Chrome/Perfetto trace of trace_steps into dir (ops, collectives, "
            "FSDP, data, optimizer, pipeline actions)"),
      field("trace_steps", &L::trace_steps, IntList{1}, "the steps logging.trace records"),
      field("tensorboard", &L::tensorboard, Bool{}, "write a TensorBoard events file of loss, lr, grad_norm, tps and "
            "memory into dir"),
  }};
  return t;
}

const Table<RecipeConfig>& recipe_table() {
  using R = RecipeConfig;
  static const Table<R> t{{
      field("model", &R::model, Sub<ModelConfig>{model_table}, "the decoder, in HF config.json names"),
      field("data", &R::data, Sub<DataConfig>{data_table}, "token shards"),
      field("packed_sequence", &R::packed_sequence, Sub<PackedSequenceConfig>{packed_sequence_table},
            "sequence packing"),
      field("train", &R::train, Sub<TrainConfig>{train_table}, "the optimisation loop"),
      field("distributed", &R::distributed, Sub<DistributedConfig>{distributed_table}, "parallel layout"),
      field("dist_env", &R::dist_env, Sub<DistEnvConfig>{dist_env_table}, "how ranks talk"),
      field("checkpoint", &R::checkpoint, Sub<CheckpointConfig>{checkpoint_table}, "sharded checkpoints"),
      field("logging", &R::logging, Sub<LoggingConfig>{logging_table}, "metrics lines and files"),
  }, [](const RecipeConfig& r) {
    QUILT_CHECK(r.train.steps > 0 || r.checkpoint.save_consolidated, "[config] train.steps is 0 but "
                "checkpoint.save_consolidated is false: a run of no steps only exports the weights (set "
                "checkpoint.save_consolidated: true and checkpoint.dir)");
  }};
  return t;
}

std::vector<Leaf> leaves(const RecipeConfig& c) {
  std::vector<Leaf> out;
  flatten(to_item(recipe_table(), c), "", nullptr, out);
  return out;
}

// ---- overrides -------------------------------------------------------------------------------

// Writes one "a.b.c=value" into the tree; the value is YAML ("3", "none", "{pp_schedule: gpipe}").
void apply_override(YAML::Node& root, const std::string& spec, Context& ctx) {
  size_t eq = spec.find('=');
  QUILT_CHECK(eq != std::string::npos && eq > 0, "[config] --set expects key=value (e.g. train.steps=20), got '",
              spec, "'");
  const std::string key = spec.substr(0, eq);
  const std::string text = spec.substr(eq + 1);
  std::vector<std::string> parts;
  for (size_t b = 0;;) {
    size_t d = key.find('.', b);
    parts.push_back(key.substr(b, d == std::string::npos ? std::string::npos : d - b));
    if (d == std::string::npos) break;
    b = d + 1;
  }
  for (const std::string& p : parts)
    QUILT_CHECK(!p.empty(), "[config] --set ", spec, ": '", key, "' is not a dotted key like train.steps");
  YAML::Node value;
  try {
    value = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    fail("[config] --set ", spec, ": cannot parse the value of ", key, " as YAML: ", e.msg);
  }
  if (!root.IsDefined() || root.IsNull()) root.reset(YAML::Node(YAML::NodeType::Map));
  QUILT_CHECK(root.IsMap(), "[config] --set ", spec, ": the recipe is not a map of sections");
  // Node assignment writes through to the tree in yaml-cpp, so walk with reset() (rebind) only.
  YAML::Node cur;
  cur.reset(root);
  std::string walked;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    walked += (i ? "." : "") + parts[i];
    YAML::Node next = cur[parts[i]];
    if (!next.IsDefined() || is_none(next)) {
      cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
      next.reset(cur[parts[i]]);
    }
    QUILT_CHECK(next.IsMap(), "[config] --set ", spec, ": ", walked, " is ", describe(next),
                ", not a section with keys");
    cur.reset(next);
  }
  cur[parts.back()] = value;
  ctx.overrides[key] = spec;
}

RecipeConfig parse_tree(YAML::Node root, const std::vector<std::string>& overrides, const std::string& source) {
  Context ctx;
  ctx.source = source;
  for (const std::string& o : overrides) apply_override(root, o, ctx);
  RecipeConfig cfg;
  cfg.source = source;
  Section top(root, "", ctx);
  read_fields(recipe_table(), cfg, top);
  top.finish();
  recipe_table().check(cfg);

  // Rules between sections that do not depend on the world size.
  const int64_t tok_vocab = make_tokenizer(cfg.data.tokenizer)->vocab_size();
  QUILT_CHECK(cfg.model.vocab_size >= tok_vocab, "[config] model.vocab_size ", cfg.model.vocab_size,
              " is smaller than the ", cfg.data.tokenizer, " tokenizer's ", tok_vocab,
              " tokens (data.tokenizer); pad it up, e.g. to ", (tok_vocab + 63) / 64 * 64);
  QUILT_CHECK(cfg.train.seq_len <= cfg.model.max_position_embeddings, "[config] train.seq_len ", cfg.train.seq_len,
              " exceeds model.max_position_embeddings ", cfg.model.max_position_embeddings);
  QUILT_CHECK(cfg.train.eval_every == 0 || cfg.data.val_path, "[config] train.eval_every is ",
              cfg.train.eval_every, " but data.val_path is none; set data.val_path or train.eval_every: 0");

  // Keys that nothing reads yet: say so for each one the recipe moves off its default.
  const std::vector<Leaf> defaults = leaves(RecipeConfig{});
  for (const Leaf& l : leaves(cfg))
    if (l.ignored && std::find(defaults.begin(), defaults.end(), l) == defaults.end())
      cfg.warnings.push_back("[config] " + l.key + " is ignored: " + l.ignored);
  // The seed's rule: distributed.moe applies with expert parallelism only.
  if (cfg.distributed.ep_size == 1) {
    const std::vector<Leaf> mine = leaves(cfg), base = leaves(RecipeConfig{});
    for (const Leaf& l : mine)
      if (l.key.rfind("distributed.moe.", 0) == 0 && std::find(base.begin(), base.end(), l) == base.end())
        cfg.warnings.push_back("[config] " + l.key + " is ignored: distributed.moe applies only with ep_size > 1");
  }
  return cfg;
}

// A config.json value as the YAML node a recipe would hold.
YAML::Node json_to_yaml(const nlohmann::json& j) {
  if (j.is_null()) return YAML::Node(YAML::NodeType::Null);
  if (j.is_string()) return YAML::Node(j.get<std::string>());
  if (j.is_object()) {
    YAML::Node m(YAML::NodeType::Map);
    for (auto it = j.begin(); it != j.end(); ++it) m[it.key()] = json_to_yaml(it.value());
    return m;
  }
  return YAML::Node(j.dump());  // numbers and booleans in JSON spelling, which the readers accept
}

}  // namespace

bool operator==(const RecipeConfig& a, const RecipeConfig& b) { return leaves(a) == leaves(b); }

std::vector<RecipeKey> recipe_keys() {
  std::vector<RecipeKey> out;
  for (const Leaf& l : leaves(RecipeConfig{})) out.push_back({l.key, l.text, l.doc});
  return out;
}

RecipeConfig parse_recipe(const std::string& yaml_text, const std::vector<std::string>& overrides,
                          const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    fail("[config] ", source, ":", e.mark.line + 1, ":", e.mark.column + 1, ": YAML syntax error: ", e.msg);
  }
  return parse_tree(root, overrides, source);
}

RecipeConfig load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  QUILT_CHECK(!std::filesystem::is_directory(path, ec), "[config] --config ", path,
              " is a directory; give the recipe's YAML file (e.g. recipes/llama_tiny.yaml)");
  std::ifstream in(path, std::ios::binary);
  QUILT_CHECK(in.good(), "[config] cannot read recipe '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  RecipeConfig cfg = parse_recipe(ss.str(), overrides, path);
  for (const std::string& w : cfg.warnings) log_line(w);
  return cfg;
}

std::string recipe_to_yaml(const RecipeConfig& c) {
  YAML::Emitter out;
  emit(out, to_item(recipe_table(), c));
  return std::string(out.c_str()) + "\n";
}

std::vector<std::string> model_config_mismatches(const ModelConfig& recipe, const std::string& hf_config_json_text) {
  const std::string where = (recipe.pretrained ? *recipe.pretrained + "/" : std::string()) + "config.json";
  nlohmann::json hf;
  try {
    hf = nlohmann::json::parse(hf_config_json_text);
  } catch (const nlohmann::json::exception& e) {
    fail("[config] ", where, " is not valid JSON: ", e.what());
  }
  QUILT_CHECK(hf.is_object(), "[config] ", where, " is not a JSON object of model settings");
  // HF's older configs call rope_parameters rope_scaling (and `type` its rope_type); v5 keeps
  // rope_theta inside it. Only the keys the recipe has are compared.
  nlohmann::json rope = hf.contains("rope_parameters") ? hf["rope_parameters"]
                                                        : hf.value("rope_scaling", nlohmann::json());
  if (rope.is_object()) {
    if (!hf.contains("rope_theta") && rope.contains("rope_theta")) hf["rope_theta"] = rope["rope_theta"];
    if (!rope.contains("rope_type") && rope.contains("type")) rope["rope_type"] = rope["type"];
    nlohmann::json kept = nlohmann::json::object();
    for (const Field<RopeParameters>& f : rope_table().fields)
      if (rope.contains(f.key)) kept[f.key] = rope[f.key];
    rope = kept;
  }
  if (hf.contains("rope_parameters") || hf.contains("rope_scaling")) hf["rope_parameters"] = rope;

  static const std::vector<std::string> kCompared = {
      "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
      "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "vocab_size", "tie_word_embeddings",
      "max_position_embeddings", "model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
      "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace", "scoring_func", "n_group",
      "topk_group", "routed_scaling_factor", "n_shared_experts"};
  YAML::Node given(YAML::NodeType::Map);
  for (const std::string& k : kCompared)
    if (hf.contains(k)) given[k] = json_to_yaml(hf[k]);
  Context ctx;
  ctx.source = where;
  Section sec(given, "model", ctx);
  std::vector<std::string> out;
  for (const Field<ModelConfig>& f : model_table().fields) {
    const YAML::Node n = sec.get(f.key);
    const Item mine = f.write(recipe);
    if (!n.IsDefined() || (!mine.is_map && mine.text == "none")) continue;  // none: left to config.json
    const std::string key = "model." + f.key;
    ModelConfig theirs = recipe;
    try {
      f.read(theirs, n, key, sec);
    } catch (const Error& e) {
      out.push_back(detail::concat(key, " is ", compact(mine), " in the recipe but ", hf[f.key].dump(), " in ", where,
                                   ", which the recipe cannot hold: ", e.what()));
      continue;
    }
    const Item their = f.write(theirs);
    std::vector<Leaf> a, b;  // maps of one table: compare leaf by leaf
    flatten(mine.is_map && their.is_map ? mine : scalar(compact(mine)), key, nullptr, a);
    flatten(mine.is_map && their.is_map ? their : scalar(compact(their)), key, nullptr, b);
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].text != b[i].text)
        out.push_back(detail::concat(a[i].key, " is ", a[i].text, " in the recipe but ", b[i].text, " in ", where));
  }
  return out;
}

int64_t packing_document_multiple(const RecipeConfig& cfg) {
  if (cfg.packed_sequence.document_multiple > 0) return cfg.packed_sequence.document_multiple;
  return cfg.distributed.cp_size > 1 ? 2 * cfg.distributed.cp_size : 1;
}

LaunchOptions trainer_launch_options(const RecipeConfig& cfg) {
  // Left automatic, a CUDA build on a GPU machine would start an NCCL world while the model and
  // its gradients stay in host memory: the backend is always named.
  switch (cfg.dist_env.backend) {
    case Backend::kMpi: return {.backend = WorldBackend::mpi};
    case Backend::kNccl:
      QUILT_CHECK(cfg.train.device == TrainDevice::kCuda, "[config] dist_env.backend nccl reduces tensors on GPUs: "
                  "it needs train.device: cuda (a rank per GPU); train.device cpu trains with dist_env.backend: mpi");
      return {.backend = WorldBackend::nccl};
    case Backend::kThreads:
      fail("[config] dist_env.backend threads runs ranks as threads of one process (the test suites' backend); "
           "quilt train runs one process per rank under mpirun or srun. Use dist_env.backend: mpi");
  }
  fail("[config] dist_env.backend: unknown value");
}

ParallelDims check_recipe(const RecipeConfig& cfg, int64_t world_size) {
  (void)trainer_launch_options(cfg);
  ParallelDims dims(cfg.distributed, world_size);
  const TrainConfig& t = cfg.train;
  // train.device cuda: every rank trains on its GPU (local rank % the GPUs it sees); its
  // collectives go over NCCL (dist_env.backend nccl, a GPU per rank) or through host memory over
  // MPI (ranks may then share a GPU); every layout runs there.
  if (t.device == TrainDevice::kCuda) {
    QUILT_CHECK(!t.cuda_graphs || world_size == 1, "[config] train.cuda_graphs captures the step of one GPU; this run "
                "has ", world_size, " ranks: leave train.cuda_graphs off");
  }
  const ModelConfig& m = cfg.model;
  QUILT_CHECK(!t.cuda_graphs || m.num_experts == 0, "[config] train.cuda_graphs captures the step of a dense model; "
              "MoE models (model.num_experts ", m.num_experts, ") are not captured yet: leave train.cuda_graphs off");
  QUILT_CHECK(!cfg.logging.trace || cfg.logging.dir, "[config] logging.trace needs logging.dir (where the trace goes)");
  QUILT_CHECK(!cfg.logging.tensorboard || cfg.logging.dir,
              "[config] logging.tensorboard needs logging.dir (where the events file goes)");
  // Packing (before the seq_len rules, so that a bad packed size is named as such): rows are
  // train.seq_len tokens, one per micro-batch (the seed's rule), and each document splits
  // head-tail into 2 * cp_size chunks.
  if (const int64_t n = cfg.packed_sequence.packed_sequence_size; n > 0) {
    QUILT_CHECK(t.micro_batch_size == 1, "[config] train.micro_batch_size must be 1 with packing "
                "(packed_sequence.packed_sequence_size ", n, "), got ", t.micro_batch_size);
    QUILT_CHECK(t.seq_len == n, "[config] train.seq_len ", t.seq_len, " differs from packed_sequence."
                "packed_sequence_size ", n, ": packed rows are train.seq_len tokens; set both to ", n);
    const int64_t chunks = dims.cp() > 1 ? 2 * dims.cp() : 1;
    QUILT_CHECK(n % chunks == 0, "[config] packed_sequence.packed_sequence_size ", n,
                " is not divisible by 2 * cp_size = ", chunks, " (cp_size=", dims.cp(),
                "; context parallelism splits each document into 2 * cp_size load-balanced chunks)");
    const int64_t multiple = packing_document_multiple(cfg);
    QUILT_CHECK(multiple % chunks == 0, "[config] packed_sequence.document_multiple ", multiple,
                " is not a multiple of 2 * cp_size = ", chunks, " (cp_size=", dims.cp(),
                "; context parallelism splits each document into 2 * cp_size load-balanced chunks)");
    QUILT_CHECK(n % multiple == 0, "[config] packed_sequence.document_multiple ", multiple,
                " does not divide packed_sequence.packed_sequence_size ", n);
  }
  // Context parallelism by all-to-all (Ulysses) trades the sequence cut for a head cut: each
  // tensor-parallel rank's query and key/value heads must divide over cp.
  if (dims.cp() > 1 && parse_cp_comm_type(cfg.distributed.cp_comm_type) == CpCommType::a2a) {
    const int64_t hq = m.num_attention_heads / dims.tp(), hkv = m.kv_heads() / dims.tp();
    QUILT_CHECK(hq % dims.cp() == 0 && hkv % dims.cp() == 0, "[config] distributed.cp_comm_type a2a cuts the heads "
                "over cp_size ", dims.cp(), ": model.num_attention_heads ", m.num_attention_heads,
                " and model.num_key_value_heads ", m.kv_heads(), " per tp rank (tp_size=", dims.tp(), ": ", hq,
                " and ", hkv, ") must both be divisible by ", dims.cp(), " (or use cp_comm_type ring or all_gather)");
  }
  dims.check_seq_len(t.seq_len);
  const int64_t per_step = t.micro_batch_size * dims.dp();
  QUILT_CHECK(t.global_batch_size % per_step == 0, "[config] train.global_batch_size ", t.global_batch_size,
              " is not divisible by train.micro_batch_size * dp = ", t.micro_batch_size, " * ", dims.dp(), " = ",
              per_step, " (micro_batch_size=", t.micro_batch_size, ", dp_replicate=", dims.dp_replicate(),
              ", dp_shard=", dims.dp_shard(), ")");
  if (dims.pp() > 1) {
    QUILT_CHECK(t.micro_batch_size % cfg.distributed.pipeline.pp_microbatch_size == 0,
                "[config] train.micro_batch_size ", t.micro_batch_size,
                " is not divisible by distributed.pipeline.pp_microbatch_size ",
                cfg.distributed.pipeline.pp_microbatch_size);
    QUILT_CHECK(dims.pp() <= m.num_hidden_layers, "[config] distributed.pp_size ", dims.pp(),
                " exceeds model.num_hidden_layers ", m.num_hidden_layers,
                " (every pipeline stage needs at least one layer)");
    const PipelineConfig& pc = cfg.distributed.pipeline;
    QUILT_CHECK(dims.cp() == 1 && dims.ep() == 1, "[config] distributed.pp_size ", dims.pp(),
                " with cp_size or ep_size > 1 is not implemented yet");
    // The schedule's own rules (micro-batch count), named by make_schedule.
    (void)pipeline::make_schedule(pc.pp_schedule, int(dims.pp()),
                                  int(t.micro_batch_size / pc.pp_microbatch_size), 2);
  }
  if (m.num_experts > 0) {
    QUILT_CHECK(m.num_experts % dims.ep() == 0, "[config] model.num_experts ", m.num_experts,
                " is not divisible by distributed.ep_size ", dims.ep());
  } else {
    QUILT_CHECK(dims.ep() == 1, "[config] distributed.ep_size ", dims.ep(),
                " needs a mixture-of-experts model (model.num_experts > 0)");
  }
  // Tensor parallelism splits attention by whole heads.
  QUILT_CHECK(m.num_attention_heads % dims.tp() == 0, "[config] model.num_attention_heads ", m.num_attention_heads,
              " is not divisible by distributed.tp_size ", dims.tp());
  QUILT_CHECK(m.kv_heads() % dims.tp() == 0, "[config] model.num_key_value_heads ", m.kv_heads(),
              " is not divisible by distributed.tp_size ", dims.tp());
  return dims;
}

int64_t default_world_size(const RecipeConfig& cfg) {
  const DistributedConfig& d = cfg.distributed;
  const int64_t mp = d.tp_size * d.pp_size * d.cp_size;
  if (d.dp_size) return *d.dp_size * mp;
  const int64_t r = d.dp_replicate_size.value_or(1);
  // The smallest dp that HSDP (r divides dp, r < dp) and expert parallelism (ep divides dp * cp) accept.
  for (int64_t dp = 1; dp <= 4096; ++dp) {
    if (r > 1 && (dp % r != 0 || dp <= r)) continue;
    if ((dp * d.cp_size) % d.ep_size != 0) continue;
    return dp * mp;
  }
  return mp;
}

}  // namespace quilt
