// Recipe parsing: YAML tree -> overrides -> typed structs with every key checked, and back.
#include "tools/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "engine/error.h"
#include "tools/tokenizer.h"

namespace quilt {

// ---- names of enum values ---------------------------------------------------------------

const char* data_format_name(DataFormat f) { return f == DataFormat::kLlmc ? "llmc" : "nanogpt"; }

const char* decay_name(Decay d) { return d == Decay::kCosine ? "cosine" : "linear"; }

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kMpi: return "mpi";
    case Backend::kNccl: return "nccl";
    case Backend::kThreads: return "threads";
  }
  return "?";
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

int64_t ModelConfig::num_parameters() const {
  const int64_t h = hidden_size, hd = head_dimension();
  const int64_t attn = h * num_attention_heads * hd * 2 + h * kv_heads() * hd * 2;  // q, o and k, v
  const int64_t mlp = 3 * h * intermediate_size;                                   // gate, up, down
  const int64_t layer = attn + mlp + 2 * h;                                         // + two RMSNorms
  return vocab_size * h * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * layer + h;
}

namespace {

const std::vector<std::string> kModelTypes = {"llama"};

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

// An unquoted none / null / ~ / empty value.
bool is_none(const YAML::Node& n) {
  if (n.IsNull()) return true;
  if (!n.IsScalar() || n.Tag() == "!") return false;  // quoted "none" is the string none
  const std::string& s = n.Scalar();
  return s == "none" || s == "None" || s == "null" || s == "Null" || s == "NULL" || s == "~";
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// Shortest text that reads back as the same double.
std::string format_double(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, res.ptr);
}

// ---- one YAML map, read key by key ----------------------------------------------------------

// Reads the keys of one section; finish() rejects any key that no read asked for, naming the
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

  // Calls parse(node, dotted key) when the key is present.
  void read(const std::string& key, const std::function<void(const YAML::Node&, const std::string&)>& parse) {
    YAML::Node n = get(key);
    if (n.IsDefined()) parse(n, full(key));
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

// ---- typed scalar readers ------------------------------------------------------------------

[[noreturn]] void bad_type(const Context& ctx, const std::string& key, const YAML::Node& n, const char* expected) {
  fail("[config] ", key, ": expected ", expected, ", got ", describe(n), ctx.where(key, n));
}

int64_t to_int(const Context& ctx, const YAML::Node& n, const std::string& key, int64_t min) {
  if (!n.IsScalar()) bad_type(ctx, key, n, "an integer");
  std::string s = n.Scalar();
  const char* b = s.data() + (!s.empty() && s[0] == '+');
  int64_t v = 0;
  auto res = std::from_chars(b, s.data() + s.size(), v);
  if (res.ec != std::errc() || res.ptr != s.data() + s.size() || s.empty()) bad_type(ctx, key, n, "an integer");
  QUILT_CHECK(v >= min, "[config] ", key, " must be >= ", min, ", got ", v, ctx.where(key, n));
  return v;
}

double to_double(const Context& ctx, const YAML::Node& n, const std::string& key) {
  if (!n.IsScalar()) bad_type(ctx, key, n, "a number");
  std::string s = n.Scalar();
  const char* b = s.data() + (!s.empty() && s[0] == '+');
  double v = 0;
  auto res = std::from_chars(b, s.data() + s.size(), v);
  if (res.ec != std::errc() || res.ptr != s.data() + s.size() || s.empty() || !std::isfinite(v))
    bad_type(ctx, key, n, "a finite number");
  return v;
}

bool to_bool(const Context& ctx, const YAML::Node& n, const std::string& key) {
  if (!n.IsScalar()) bad_type(ctx, key, n, "true or false");
  std::string s = lower(n.Scalar());
  if (s == "true" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "no" || s == "off") return false;
  bad_type(ctx, key, n, "true or false");
}

std::string to_string(const Context& ctx, const YAML::Node& n, const std::string& key) {
  if (!n.IsScalar()) bad_type(ctx, key, n, "a string");
  return n.Scalar();
}

// One of `names`; the error lists them all.
std::string to_choice(const Context& ctx, const YAML::Node& n, const std::string& key,
                      const std::vector<std::string>& names) {
  std::string s = n.IsScalar() ? n.Scalar() : "";
  if (n.IsScalar() && std::find(names.begin(), names.end(), s) != names.end()) return s;
  fail("[config] ", key, ": expected one of ", join(names, " | "), ", got ", describe(n), ctx.where(key, n));
}

// Convenience readers bound to a section.
void read_int(Section& s, const std::string& key, int64_t& out, int64_t min) {
  s.read(key, [&](const YAML::Node& n, const std::string& k) { out = to_int(s.ctx(), n, k, min); });
}
void read_opt_int(Section& s, const std::string& key, std::optional<int64_t>& out, int64_t min) {
  s.read(key, [&](const YAML::Node& n, const std::string& k) {
    if (is_none(n)) out.reset();
    else out = to_int(s.ctx(), n, k, min);
  });
}
// A number with an inclusive lower bound, or an exclusive one when `strict`.
void read_double(Section& s, const std::string& key, double& out, double min, bool strict) {
  s.read(key, [&](const YAML::Node& n, const std::string& k) {
    double v = to_double(s.ctx(), n, k);
    QUILT_CHECK(strict ? v > min : v >= min, "[config] ", k, " must be ", strict ? "> " : ">= ", format_double(min),
                ", got ", n.Scalar(), s.ctx().where(k, n));
    out = v;
  });
}
void read_bool(Section& s, const std::string& key, bool& out) {
  s.read(key, [&](const YAML::Node& n, const std::string& k) { out = to_bool(s.ctx(), n, k); });
}
void read_string(Section& s, const std::string& key, std::string& out) {
  s.read(key, [&](const YAML::Node& n, const std::string& k) { out = to_string(s.ctx(), n, k); });
}
void read_opt_string(Section& s, const std::string& key, std::optional<std::string>& out) {
  s.read(key, [&](const YAML::Node& n, const std::string& k) {
    if (is_none(n)) out.reset();
    else out = to_string(s.ctx(), n, k);
  });
}
void read_choice(Section& s, const std::string& key, std::string& out, const std::vector<std::string>& names) {
  s.read(key, [&](const YAML::Node& n, const std::string& k) { out = to_choice(s.ctx(), n, k, names); });
}
void read_dtype(Section& s, const std::string& key, std::optional<DType>& out, bool allow_none) {
  s.read(key, [&](const YAML::Node& n, const std::string& k) {
    if (allow_none && is_none(n)) {
      out.reset();
      return;
    }
    std::optional<DType> d = n.IsScalar() ? parse_float_dtype(n.Scalar()) : std::nullopt;
    if (!d) bad_type(s.ctx(), k, n, allow_none ? "float32 | bfloat16 | float16 | float64 | none"
                                               : "float32 | bfloat16 | float16 | float64");
    out = d;
  });
}

// ---- sections ------------------------------------------------------------------------------

void parse_model(const YAML::Node& node, const Context& ctx, ModelConfig& m) {
  Section s(node, "model", ctx);
  read_choice(s, "model_type", m.model_type, kModelTypes);
  read_int(s, "hidden_size", m.hidden_size, 1);
  read_int(s, "intermediate_size", m.intermediate_size, 1);
  read_int(s, "num_hidden_layers", m.num_hidden_layers, 1);
  read_int(s, "num_attention_heads", m.num_attention_heads, 1);
  read_opt_int(s, "num_key_value_heads", m.num_key_value_heads, 1);
  read_opt_int(s, "head_dim", m.head_dim, 1);
  read_double(s, "rms_norm_eps", m.rms_norm_eps, 0, true);
  read_double(s, "rope_theta", m.rope_theta, 0, true);
  // HF's older configs call it rope_scaling; accept either name, never both.
  YAML::Node rp = s.get("rope_parameters");
  YAML::Node rs = s.get("rope_scaling");
  QUILT_CHECK(!(rp.IsDefined() && rs.IsDefined()), "[config] model.rope_parameters and model.rope_scaling are the "
              "same setting; give only one", ctx.where("model.rope_scaling", rs));
  const std::string rope_key = rs.IsDefined() ? "model.rope_scaling" : "model.rope_parameters";
  YAML::Node rope = rs.IsDefined() ? rs : rp;
  if (rope.IsDefined()) {
    if (is_none(rope)) {
      m.rope_parameters.reset();
    } else {
      Section r(rope, rope_key, ctx);
      RopeParameters p;
      read_choice(r, "rope_type", p.rope_type, {"default", "llama3"});
      // HF v5 keeps rope_theta inside rope_parameters.
      double theta = 0;
      bool has_theta = r.get("rope_theta").IsDefined();
      read_double(r, "rope_theta", theta, 0, true);
      read_double(r, "factor", p.factor, 1, false);
      read_double(r, "low_freq_factor", p.low_freq_factor, 0, true);
      read_double(r, "high_freq_factor", p.high_freq_factor, 0, true);
      read_int(r, "original_max_position_embeddings", p.original_max_position_embeddings, 1);
      r.finish();
      if (has_theta) {
        YAML::Node outer = s.get("rope_theta");
        QUILT_CHECK(!outer.IsDefined() || theta == m.rope_theta, "[config] ", rope_key, ".rope_theta ",
                    format_double(theta), " differs from model.rope_theta ", format_double(m.rope_theta),
                    "; give it once");
        m.rope_theta = theta;
      }
      QUILT_CHECK(p.high_freq_factor > p.low_freq_factor, "[config] ", rope_key, ".high_freq_factor ",
                  format_double(p.high_freq_factor), " must be greater than low_freq_factor ",
                  format_double(p.low_freq_factor), ctx.where(rope_key, rope));
      if (p.rope_type == "default") m.rope_parameters.reset();
      else m.rope_parameters = p;
    }
  }
  read_int(s, "vocab_size", m.vocab_size, 1);
  read_bool(s, "tie_word_embeddings", m.tie_word_embeddings);
  read_int(s, "max_position_embeddings", m.max_position_embeddings, 1);
  read_double(s, "initializer_range", m.initializer_range, 0, true);
  s.finish();

  QUILT_CHECK(m.num_attention_heads % m.kv_heads() == 0, "[config] model.num_attention_heads ",
              m.num_attention_heads, " is not divisible by model.num_key_value_heads ", m.kv_heads(),
              " (grouped-query attention shares each key/value head among a whole number of query heads)");
  QUILT_CHECK(m.head_dim || m.hidden_size % m.num_attention_heads == 0, "[config] model.hidden_size ",
              m.hidden_size, " is not divisible by model.num_attention_heads ", m.num_attention_heads,
              "; set model.head_dim explicitly");
}

void parse_data(const YAML::Node& node, const Context& ctx, DataConfig& d) {
  Section s(node, "data", ctx);
  read_string(s, "path", d.path);
  read_opt_string(s, "val_path", d.val_path);
  read_choice(s, "tokenizer", d.tokenizer, tokenizer_names());
  std::string format = data_format_name(d.format);
  read_choice(s, "format", format, {"llmc", "nanogpt"});
  d.format = format == "llmc" ? DataFormat::kLlmc : DataFormat::kNanogpt;
  s.finish();
  QUILT_CHECK(!d.path.empty() && d.path != "none", "[config] data.path is required: a directory of token "
              "shards, a glob, or one file (make them with `quilt data prepare`)");
}

void parse_train(const YAML::Node& node, const Context& ctx, TrainConfig& t) {
  Section s(node, "train", ctx);
  read_int(s, "steps", t.steps, 1);
  read_int(s, "global_batch_size", t.global_batch_size, 1);
  read_int(s, "micro_batch_size", t.micro_batch_size, 1);
  read_int(s, "seq_len", t.seq_len, 1);
  read_double(s, "lr", t.lr, 0, true);
  read_double(s, "min_lr", t.min_lr, 0, false);
  read_int(s, "warmup_steps", t.warmup_steps, 0);
  std::string decay = decay_name(t.decay);
  read_choice(s, "decay", decay, {"cosine", "linear"});
  t.decay = decay == "cosine" ? Decay::kCosine : Decay::kLinear;
  read_double(s, "weight_decay", t.weight_decay, 0, false);
  read_double(s, "beta1", t.beta1, 0, false);
  read_double(s, "beta2", t.beta2, 0, false);
  read_double(s, "eps", t.eps, 0, true);
  s.read("max_grad_norm", [&](const YAML::Node& n, const std::string& k) {
    if (is_none(n)) {
      t.max_grad_norm.reset();
      return;
    }
    double v = to_double(ctx, n, k);
    QUILT_CHECK(v > 0, "[config] ", k, " must be > 0 (or none for no clipping), got ", n.Scalar(), ctx.where(k, n));
    t.max_grad_norm = v;
  });
  read_int(s, "seed", t.seed, 0);
  std::optional<DType> dtype = t.dtype;
  read_dtype(s, "dtype", dtype, false);
  t.dtype = *dtype;
  read_dtype(s, "param_dtype", t.param_dtype, true);
  read_dtype(s, "reduce_dtype", t.reduce_dtype, true);
  read_dtype(s, "output_dtype", t.output_dtype, true);
  read_int(s, "eval_every", t.eval_every, 0);
  read_int(s, "eval_steps", t.eval_steps, 1);
  s.finish();

  QUILT_CHECK(t.beta1 < 1, "[config] train.beta1 must be < 1, got ", format_double(t.beta1));
  QUILT_CHECK(t.beta2 < 1, "[config] train.beta2 must be < 1, got ", format_double(t.beta2));
  QUILT_CHECK(t.min_lr <= t.lr, "[config] train.min_lr ", format_double(t.min_lr), " is greater than train.lr ",
              format_double(t.lr));
  QUILT_CHECK(t.global_batch_size % t.micro_batch_size == 0, "[config] train.global_batch_size ",
              t.global_batch_size, " is not divisible by train.micro_batch_size ", t.micro_batch_size);
}

void parse_distributed(const YAML::Node& node, const Context& ctx, DistributedConfig& d) {
  Section s(node, "distributed", ctx);
  std::string strategy = strategy_name(d.strategy);
  read_choice(s, "strategy", strategy, {"fsdp2", "megatron_fsdp", "ddp"});
  d.strategy = parse_strategy(strategy);
  read_opt_int(s, "dp_size", d.dp_size, 1);
  read_opt_int(s, "dp_replicate_size", d.dp_replicate_size, 1);
  read_int(s, "tp_size", d.tp_size, 1);
  read_int(s, "pp_size", d.pp_size, 1);
  read_int(s, "cp_size", d.cp_size, 1);
  read_int(s, "ep_size", d.ep_size, 1);
  read_bool(s, "sequence_parallel", d.sequence_parallel);
  read_bool(s, "activation_checkpointing", d.activation_checkpointing);
  read_choice(s, "activation_checkpointing_mode", d.activation_checkpointing_mode, {"full", "selective"});
  read_bool(s, "reshard_after_forward", d.reshard_after_forward);
  read_bool(s, "defer_fsdp_grad_sync", d.defer_fsdp_grad_sync);
  {
    Section p(s.get("pipeline"), "distributed.pipeline", ctx);
    read_choice(p, "pp_schedule", d.pipeline.pp_schedule, pipeline_schedule_names());
    read_int(p, "pp_microbatch_size", d.pipeline.pp_microbatch_size, 1);
    read_bool(p, "scale_grads_in_schedule", d.pipeline.scale_grads_in_schedule);
    p.finish();
  }
  {
    Section m(s.get("moe"), "distributed.moe", ctx);
    read_bool(m, "reshard_after_forward", d.moe.reshard_after_forward);
    read_bool(m, "ignore_router_for_ac", d.moe.ignore_router_for_ac);
    read_bool(m, "wrap_outer_model", d.moe.wrap_outer_model);
    m.finish();
  }
  s.finish();
}

void parse_dist_env(const YAML::Node& node, const Context& ctx, DistEnvConfig& e) {
  Section s(node, "dist_env", ctx);
  std::string backend = backend_name(e.backend);
  read_choice(s, "backend", backend, {"mpi", "nccl", "threads"});
  e.backend = backend == "mpi" ? Backend::kMpi : backend == "nccl" ? Backend::kNccl : Backend::kThreads;
  read_double(s, "timeout_s", e.timeout_s, 0, true);
  s.finish();
}

void parse_checkpoint(const YAML::Node& node, const Context& ctx, CheckpointConfig& c) {
  Section s(node, "checkpoint", ctx);
  read_opt_string(s, "dir", c.dir);
  read_int(s, "every_steps", c.every_steps, 0);
  read_int(s, "keep_last", c.keep_last, 0);
  s.read("resume", [&](const YAML::Node& n, const std::string& k) {
    if (is_none(n)) {
      c.resume = {ResumeSpec::Kind::kNone, ""};
      return;
    }
    std::string v = to_string(ctx, n, k);
    QUILT_CHECK(!v.empty(), "[config] ", k, ": expected auto | none | a checkpoint path, got ''", ctx.where(k, n));
    if (v == "auto" && n.Tag() != "!") c.resume = {ResumeSpec::Kind::kAuto, ""};
    else c.resume = {ResumeSpec::Kind::kPath, v};
  });
  read_bool(s, "save_consolidated", c.save_consolidated);
  s.finish();
  QUILT_CHECK(c.dir || c.every_steps == 0, "[config] checkpoint.every_steps is ", c.every_steps,
              " but checkpoint.dir is none; set checkpoint.dir");
  QUILT_CHECK(c.dir || !c.save_consolidated, "[config] checkpoint.save_consolidated is true but checkpoint.dir is "
              "none; set checkpoint.dir");
}

void parse_logging(const YAML::Node& node, const Context& ctx, LoggingConfig& l) {
  Section s(node, "logging", ctx);
  read_opt_string(s, "dir", l.dir);
  read_int(s, "every_steps", l.every_steps, 1);
  read_bool(s, "rank0_only", l.rank0_only);
  s.finish();
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
  parse_model(top.get("model"), ctx, cfg.model);
  parse_data(top.get("data"), ctx, cfg.data);
  parse_train(top.get("train"), ctx, cfg.train);
  parse_distributed(top.get("distributed"), ctx, cfg.distributed);
  parse_dist_env(top.get("dist_env"), ctx, cfg.dist_env);
  parse_checkpoint(top.get("checkpoint"), ctx, cfg.checkpoint);
  parse_logging(top.get("logging"), ctx, cfg.logging);
  top.finish();

  // Rules between sections that do not depend on the world size.
  const int64_t tok_vocab = make_tokenizer(cfg.data.tokenizer)->vocab_size();
  QUILT_CHECK(cfg.model.vocab_size >= tok_vocab, "[config] model.vocab_size ", cfg.model.vocab_size,
              " is smaller than the ", cfg.data.tokenizer, " tokenizer's ", tok_vocab,
              " tokens (data.tokenizer); pad it up, e.g. to ", (tok_vocab + 63) / 64 * 64);
  QUILT_CHECK(cfg.train.seq_len <= cfg.model.max_position_embeddings, "[config] train.seq_len ", cfg.train.seq_len,
              " exceeds model.max_position_embeddings ", cfg.model.max_position_embeddings);
  QUILT_CHECK(cfg.train.eval_every == 0 || cfg.data.val_path, "[config] train.eval_every is ",
              cfg.train.eval_every, " but data.val_path is none; set data.val_path or train.eval_every: 0");
  return cfg;
}

// ---- emitting --------------------------------------------------------------------------------

struct Emit {
  YAML::Emitter out;
  void key(const char* k) { out << YAML::Key << k << YAML::Value; }
  void kv(const char* k, const std::string& v) { key(k), out << v; }
  void kv(const char* k, const char* v) { key(k), out << v; }
  void kv(const char* k, int64_t v) { key(k), out << std::to_string(v); }
  void kv(const char* k, double v) { key(k), out << format_double(v); }
  void kv(const char* k, bool v) { key(k), out << (v ? "true" : "false"); }
  template <class T>
  void kv(const char* k, const std::optional<T>& v) {
    if (v) kv(k, *v);
    else kv(k, "none");
  }
  void kv(const char* k, const std::optional<DType>& v) { kv(k, v ? float_dtype_name(*v) : "none"); }
  void begin(const char* k) { key(k), out << YAML::BeginMap; }
  void end() { out << YAML::EndMap; }
};

}  // namespace

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
  std::ifstream in(path, std::ios::binary);
  QUILT_CHECK(in.good(), "[config] cannot read recipe '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_recipe(ss.str(), overrides, path);
}

std::string recipe_to_yaml(const RecipeConfig& c) {
  Emit e;
  e.out << YAML::BeginMap;
  e.begin("model");
  const ModelConfig& m = c.model;
  e.kv("model_type", m.model_type);
  e.kv("hidden_size", m.hidden_size);
  e.kv("intermediate_size", m.intermediate_size);
  e.kv("num_hidden_layers", m.num_hidden_layers);
  e.kv("num_attention_heads", m.num_attention_heads);
  e.kv("num_key_value_heads", m.num_key_value_heads);
  e.kv("head_dim", m.head_dim);
  e.kv("rms_norm_eps", m.rms_norm_eps);
  e.kv("rope_theta", m.rope_theta);
  if (m.rope_parameters) {
    const RopeParameters& r = *m.rope_parameters;
    e.begin("rope_parameters");
    e.kv("rope_type", r.rope_type);
    e.kv("factor", r.factor);
    e.kv("low_freq_factor", r.low_freq_factor);
    e.kv("high_freq_factor", r.high_freq_factor);
    e.kv("original_max_position_embeddings", r.original_max_position_embeddings);
    e.end();
  } else {
    e.kv("rope_parameters", "none");
  }
  e.kv("vocab_size", m.vocab_size);
  e.kv("tie_word_embeddings", m.tie_word_embeddings);
  e.kv("max_position_embeddings", m.max_position_embeddings);
  e.kv("initializer_range", m.initializer_range);
  e.end();

  e.begin("data");
  e.kv("path", c.data.path);
  e.kv("val_path", c.data.val_path);
  e.kv("tokenizer", c.data.tokenizer);
  e.kv("format", data_format_name(c.data.format));
  e.end();

  const TrainConfig& t = c.train;
  e.begin("train");
  e.kv("steps", t.steps);
  e.kv("global_batch_size", t.global_batch_size);
  e.kv("micro_batch_size", t.micro_batch_size);
  e.kv("seq_len", t.seq_len);
  e.kv("lr", t.lr);
  e.kv("min_lr", t.min_lr);
  e.kv("warmup_steps", t.warmup_steps);
  e.kv("decay", decay_name(t.decay));
  e.kv("weight_decay", t.weight_decay);
  e.kv("beta1", t.beta1);
  e.kv("beta2", t.beta2);
  e.kv("eps", t.eps);
  e.kv("max_grad_norm", t.max_grad_norm);
  e.kv("seed", t.seed);
  e.kv("dtype", float_dtype_name(t.dtype));
  e.kv("param_dtype", t.param_dtype);
  e.kv("reduce_dtype", t.reduce_dtype);
  e.kv("output_dtype", t.output_dtype);
  e.kv("eval_every", t.eval_every);
  e.kv("eval_steps", t.eval_steps);
  e.end();

  const DistributedConfig& d = c.distributed;
  e.begin("distributed");
  e.kv("strategy", strategy_name(d.strategy));
  e.kv("dp_size", d.dp_size);
  e.kv("dp_replicate_size", d.dp_replicate_size);
  e.kv("tp_size", d.tp_size);
  e.kv("pp_size", d.pp_size);
  e.kv("cp_size", d.cp_size);
  e.kv("ep_size", d.ep_size);
  e.kv("sequence_parallel", d.sequence_parallel);
  e.kv("activation_checkpointing", d.activation_checkpointing);
  e.kv("activation_checkpointing_mode", d.activation_checkpointing_mode);
  e.kv("reshard_after_forward", d.reshard_after_forward);
  e.kv("defer_fsdp_grad_sync", d.defer_fsdp_grad_sync);
  e.begin("pipeline");
  e.kv("pp_schedule", d.pipeline.pp_schedule);
  e.kv("pp_microbatch_size", d.pipeline.pp_microbatch_size);
  e.kv("scale_grads_in_schedule", d.pipeline.scale_grads_in_schedule);
  e.end();
  e.begin("moe");
  e.kv("reshard_after_forward", d.moe.reshard_after_forward);
  e.kv("ignore_router_for_ac", d.moe.ignore_router_for_ac);
  e.kv("wrap_outer_model", d.moe.wrap_outer_model);
  e.end();
  e.end();

  e.begin("dist_env");
  e.kv("backend", backend_name(c.dist_env.backend));
  e.kv("timeout_s", c.dist_env.timeout_s);
  e.end();

  const CheckpointConfig& k = c.checkpoint;
  e.begin("checkpoint");
  e.kv("dir", k.dir);
  e.kv("every_steps", k.every_steps);
  e.kv("keep_last", k.keep_last);
  switch (k.resume.kind) {
    case ResumeSpec::Kind::kAuto: e.kv("resume", "auto"); break;
    case ResumeSpec::Kind::kNone: e.kv("resume", "none"); break;
    case ResumeSpec::Kind::kPath:
      // A path spelled like a keyword must stay a path when read back.
      e.key("resume");
      if (k.resume.path == "auto" || k.resume.path == "none") e.out << YAML::DoubleQuoted;
      e.out << k.resume.path;
      break;
  }
  e.kv("save_consolidated", k.save_consolidated);
  e.end();

  e.begin("logging");
  e.kv("dir", c.logging.dir);
  e.kv("every_steps", c.logging.every_steps);
  e.kv("rank0_only", c.logging.rank0_only);
  e.end();
  e.out << YAML::EndMap;
  return std::string(e.out.c_str()) + "\n";
}

ParallelDims check_recipe(const RecipeConfig& cfg, int64_t world_size) {
  ParallelDims dims(cfg.distributed, world_size);
  const TrainConfig& t = cfg.train;
  const ModelConfig& m = cfg.model;
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
