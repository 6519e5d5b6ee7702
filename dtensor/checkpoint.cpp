// Sharded checkpoints (per-rank safetensors + index, committed by rename), resharding loads that
// read only the needed blocks, and Hugging Face consolidated export/import (with per-expert
// tensors mapped to grouped ones).
#include "dtensor/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>

#include "collectives/launch.h"
#include "dtensor/dtensor.h"
#include "dtensor/sharding.h"
#include "engine/autograd.h"
#include "engine/io/safetensors.h"
#include "engine/ops/creation.h"
#include "engine/ops/view.h"

namespace quilt::dtensor {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kIndexFile = "index.json";
constexpr const char* kFormat = "quilt-dcp/1";
constexpr const char* kChunksKey = "quilt.chunks";

// ---- the fault hook (tests) ----

struct Hook {
  std::mutex mu;
  std::function<void(const std::string&, int)> fn;
};
Hook& fault_hook() {
  static Hook h;
  return h;
}
struct ReadHook {
  std::mutex mu;
  std::function<void(const std::string&, const Shape&, const Shape&, int)> fn;
};
ReadHook& read_hook() {
  static ReadHook h;
  return h;
}

// ---- files ----

std::string strip_slash(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

std::string rank_file(int r) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.safetensors", r);
  return buf;
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Writes `text` to `path` through a temporary name, fsynced, then renamed.
void write_text_atomic(const std::string& path, const std::string& text, const char* op) {
  const std::string part = path + ".part";
  {
    std::ofstream f(part, std::ios::binary | std::ios::trunc);
    QUILT_CHECK(f.good(), "[", op, "] cannot write ", part);
    f << text;
    f.flush();
    QUILT_CHECK(f.good(), "[", op, "] writing ", part, " failed");
  }
  fsync_path(part, false);
  std::error_code ec;
  fs::rename(part, path, ec);
  QUILT_CHECK(!ec, "[", op, "] cannot rename ", part, " to ", path, ": ", ec.message());
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// ---- the source of a load: every tensor's chunks, from an index or a Hugging Face file ----

struct ChunkRec {
  std::string file;  // relative to Source::dir
  Shape offset, shape;
  // One expert of a StackedName: the file entry that holds the chunk, which lacks the chunk's
  // leading dim (of size 1; offset[0] is the expert). Otherwise the entry is the tensor's name.
  std::string entry;
  bool drops_dim0 = false;
};
struct TensorRec {
  Shape shape;
  DType dtype = DType::f32;
  std::string placements;
  std::vector<ChunkRec> chunks;
};
struct Source {
  std::string dir;
  std::string what;  // "checkpoint <dir>" or "<file>" for messages
  std::vector<std::string> order;
  std::map<std::string, TensorRec> tensors;
  int world_size = 0;
  std::map<std::string, std::string> metadata;
};

Shape shape_of(const json& j) { return j.get<std::vector<int64_t>>(); }

Source read_index(const std::string& dir_in, const char* op) {
  const std::string dir = strip_slash(dir_in);
  const std::string path = dir + "/" + kIndexFile;
  QUILT_CHECK(fs::is_regular_file(path), "[", op, "] ", dir, " is not a complete checkpoint (no ", kIndexFile,
              "; an interrupted save leaves only ", dir, ".tmp)");
  Source s;
  s.dir = dir;
  s.what = "checkpoint " + dir;
  try {
    const json j = json::parse(read_text(path));
    QUILT_CHECK(j.at("format") == kFormat, "[", op, "] ", path, ": unknown format ", j.at("format").dump());
    s.world_size = j.at("world_size").get<int>();
    for (const auto& [k, v] : j.at("metadata").items()) s.metadata[k] = v.get<std::string>();
    for (const json& t : j.at("tensors")) {
      TensorRec r;
      const std::string name = t.at("name").get<std::string>();
      r.shape = shape_of(t.at("shape"));
      r.dtype = parse_safetensors_dtype(t.at("dtype").get<std::string>(), "[" + std::string(op) + "] " + path);
      r.placements = t.at("placements").get<std::string>();
      for (const json& c : t.at("chunks"))
        r.chunks.push_back(
            {c.at("file").get<std::string>(), shape_of(c.at("offset")), shape_of(c.at("shape")), "", false});
      s.order.push_back(name);
      s.tensors[name] = std::move(r);
    }
  } catch (const json::exception& e) {
    fail("[", op, "] ", path, " is not a valid checkpoint index: ", e.what());
  }
  return s;
}

void add_file_entries(Source& s, const std::string& file, const std::vector<std::string>* only, const char* op) {
  const SafetensorsIndex idx = read_safetensors_index(s.dir + "/" + file);
  for (const SafetensorsEntry& e : idx.entries) {
    if (only && std::find(only->begin(), only->end(), e.name) == only->end()) continue;
    TensorRec r;
    r.shape = e.shape;
    r.dtype = e.dtype;
    r.placements = "plain";
    r.chunks.push_back({file, Shape(e.shape.size(), 0), e.shape, "", false});
    s.order.push_back(e.name);
    s.tensors[e.name] = std::move(r);
  }
}

Source read_hf(const std::string& path, const char* op) {
  Source s;
  s.dir = fs::path(path).parent_path().string();
  if (s.dir.empty()) s.dir = ".";
  s.what = path;
  QUILT_CHECK(fs::is_regular_file(path), "[", op, "] ", path, " does not exist");
  if (path.size() >= 5 && path.substr(path.size() - 5) == ".json") {
    std::map<std::string, std::vector<std::string>> by_file;
    try {
      const json j = json::parse(read_text(path));
      for (const auto& [name, file] : j.at("weight_map").items()) by_file[file.get<std::string>()].push_back(name);
    } catch (const json::exception& e) {
      fail("[", op, "] ", path, " is not a valid safetensors index: ", e.what());
    }
    for (const auto& [file, names] : by_file) add_file_entries(s, file, &names, op);
  } else {
    add_file_entries(s, fs::path(path).filename().string(), nullptr, op);
  }
  return s;
}

// ---- Hugging Face per-expert tensors as the chunks of one grouped tensor ----

std::string expert_name(const StackedName& rule, int64_t e) {
  const size_t at = rule.pattern.find("{}");
  return rule.pattern.substr(0, at) + std::to_string(e) + rule.pattern.substr(at + 2);
}

void check_stacks(const std::vector<StackedName>& stacks, const char* op) {
  std::set<std::string> seen;
  for (const StackedName& rule : stacks) {
    const size_t at = rule.pattern.find("{}");
    QUILT_CHECK(at != std::string::npos && rule.pattern.find("{}", at + 2) == std::string::npos, "[", op,
                "] the rule for '", rule.name, "' has pattern '", rule.pattern,
                "', which must hold \"{}\" exactly once");
    QUILT_CHECK(rule.count > 0, "[", op, "] the rule for '", rule.name, "' stacks ", rule.count,
                " experts; it needs at least one");
    QUILT_CHECK(seen.insert(rule.name).second, "[", op, "] two rules stack '", rule.name, "'");
  }
}

// Makes src's record of rule.name the stack of the rule's file tensors: expert e is the chunk
// (1, *rest) at (e, 0, ...), so fill() reads of each expert only the rows a block covers. Every
// expert must be there with the target's shape[1:] and expert 0's dtype, also those this rank
// does not read: a checkpoint missing one is damaged, whichever rank notices.
void stack_experts(Source& src, const StackedName& rule, const Shape& target_shape, int rank, const char* op) {
  QUILT_CHECK(!target_shape.empty() && target_shape[0] == rule.count, "[", op, "] target '", rule.name, "' has shape ",
              target_shape, " but its rule stacks ", rule.count, " experts along dim 0 (rank ", rank, ")");
  const Shape rest(target_shape.begin() + 1, target_shape.end());
  TensorRec rec;
  rec.shape = target_shape;
  rec.placements = "plain";
  for (int64_t e = 0; e < rule.count; ++e) {
    const std::string n = expert_name(rule, e);
    const auto it = src.tensors.find(n);
    QUILT_CHECK(it != src.tensors.end(), "[", op, "] tensor '", n, "' (expert ", e, " of '", rule.name, "') is not in ",
                src.what, " (rank ", rank, ")");
    const TensorRec& x = it->second;
    QUILT_CHECK(x.shape == rest, "[", op, "] tensor '", n, "' (expert ", e, " of '", rule.name, "') has shape ",
                x.shape, " in ", src.what, " but the target's shape ", target_shape, " needs ", rest,
                " per expert (rank ", rank, ")");
    if (e == 0) rec.dtype = x.dtype;
    QUILT_CHECK(x.dtype == rec.dtype, "[", op, "] tensor '", n, "' (expert ", e, " of '", rule.name, "') has dtype ",
                dtype_name(x.dtype), " in ", src.what, " but expert 0 ('", expert_name(rule, 0), "') has dtype ",
                dtype_name(rec.dtype), " (rank ", rank, ")");
    assert(x.chunks.size() == 1);  // a Hugging Face file holds each tensor whole
    ChunkRec c{x.chunks[0].file, Shape(target_shape.size(), 0), target_shape, n, true};
    c.offset[0] = e;
    c.shape[0] = 1;
    rec.chunks.push_back(std::move(c));
  }
  if (!src.tensors.count(rule.name)) src.order.push_back(rule.name);
  src.tensors[rule.name] = std::move(rec);
}

// ---- filling a target's block from a source ----

int rank_label(const Tensor& t) {
  if (t.is_distributed()) {
    const DeviceMesh& m = mesh_of(t);
    return m.ranks()[size_t(m.rank())];
  }
  return is_initialized() ? launch_info().rank : 0;
}

// Fills `target` with tensor `name` of `src`, or, for a plain target, with the block `region` of it.
void fill(const Source& src, const std::string& name, const Tensor& target, std::map<std::string, SafetensorsIndex>& files,
          const char* op, const Block* region = nullptr) {
  const int rank = rank_label(target);
  QUILT_CHECK(target.defined(), "[", op, "] target '", name, "' is undefined (rank ", rank, ")");
  auto it = src.tensors.find(name);
  if (it == src.tensors.end()) {
    std::string some;
    for (size_t i = 0; i < src.order.size() && i < 8; ++i) some += (i ? ", " : "") + src.order[i];
    fail("[", op, "] tensor '", name, "' is not in ", src.what, " (rank ", rank, "); it holds ", src.order.size(),
         " tensors: ", some, src.order.size() > 8 ? ", ..." : "");
  }
  const TensorRec& rec = it->second;
  QUILT_CHECK(region || rec.shape == target.shape(), "[", op, "] tensor '", name, "' has shape ", rec.shape, " in ",
              src.what, " but the target has shape ", target.shape(), " (rank ", rank, ")");
  assert(!region || (!target.is_distributed() && target.shape() == region->shape));
  NoGradGuard ng;
  Block block = region ? *region : Block{Shape(rec.shape.size(), 0), rec.shape};
  Tensor local = target;
  if (target.is_distributed()) {
    const DistSpec& spec = *target.dist_spec();
    local = target.local();
    block = local_block(spec.shape, spec.mesh.shape(), spec.placements, spec.mesh.coordinate());
    for (size_t a = 0; a < spec.placements.size(); ++a)
      if (spec.placements[a].is_partial(ReduceOp::sum) && spec.mesh.coordinate(int64_t(a)) != 0) {
        local.zero_();  // R -> P(sum): the value lives on coordinate 0
        return;
      }
  }
  int64_t covered = 0;
  for (const ChunkRec& c : rec.chunks) {
    Block inter{block.offset, block.shape};
    bool empty = false;
    for (size_t d = 0; d < block.shape.size(); ++d) {
      const int64_t lo = std::max(block.offset[d], c.offset[d]);
      const int64_t hi = std::min(block.offset[d] + block.shape[d], c.offset[d] + c.shape[d]);
      if (hi <= lo) { empty = true; break; }
      inter.offset[d] = lo;
      inter.shape[d] = hi - lo;
    }
    if (empty || numel_of(inter.shape) == 0) continue;
    const std::string& entry = c.entry.empty() ? name : c.entry;
    Shape start(block.shape.size()), sizes = inter.shape;
    for (size_t d = 0; d < start.size(); ++d) start[d] = inter.offset[d] - c.offset[d];
    if (c.drops_dim0) {
      start.erase(start.begin());
      sizes.erase(sizes.begin());
    }
    std::function<void(const std::string&, const Shape&, const Shape&, int)> hook;
    {
      std::lock_guard<std::mutex> lock(read_hook().mu);
      hook = read_hook().fn;
    }
    if (hook) hook(entry, start, sizes, rank);
    Tensor piece;
    try {
      auto fi = files.find(c.file);
      if (fi == files.end()) fi = files.emplace(c.file, read_safetensors_index(src.dir + "/" + c.file)).first;
      piece = read_safetensors_block(fi->second, entry, start, sizes);
    } catch (const Error& e) {
      const std::string expert =
          c.drops_dim0 ? "expert " + std::to_string(c.offset[0]) + " '" + entry + "', " : std::string();
      fail("[", op, "] tensor '", name, "' (", expert, "rank ", rank, "): ", e.what());
    }
    Tensor dst = local;
    for (size_t d = 0; d < block.shape.size(); ++d)
      dst = dst.narrow(int64_t(d), inter.offset[d] - block.offset[d], inter.shape[d]);
    dst.copy_(c.drops_dim0 ? piece.unsqueeze(0) : piece);
    covered += numel_of(inter.shape);
  }
  QUILT_CHECK(covered == numel_of(block.shape), "[", op, "] tensor '", name, "' (rank ", rank, "): the chunks in ",
              src.what, " cover ", covered, " of the ", numel_of(block.shape), " elements this rank needs");
}

// Every rank learns whether all succeeded; the failing ranks' own messages are kept.
void agree(Communicator& comm, bool ok, const std::string& msg, const std::string& dir, const std::string& phase) {
  Tensor flag = full({1}, ok ? 1.0 : 0.0, {.dtype = DType::i32, .device = comm.device()});
  comm.all_reduce(flag, ReduceOp::min);
  if (flag.item<int>() == 1) return;
  if (!ok) fail("[save_checkpoint] ", dir, ": rank ", comm.rank(), " failed while ", phase, ": ", msg,
                " (nothing was committed)");
  fail("[save_checkpoint] ", dir, ": another rank failed while ", phase, " (nothing was committed)");
}

int64_t trailing_number(const std::string& s, bool* has) {
  size_t i = s.size();
  while (i > 0 && std::isdigit(static_cast<unsigned char>(s[i - 1]))) --i;
  *has = i < s.size() && s.size() - i < 19;
  return *has ? std::stoll(s.substr(i)) : 0;
}

}  // namespace

namespace detail {
void set_checkpoint_fault_hook(std::function<void(const std::string& path, int rank)> hook) {
  std::lock_guard<std::mutex> lock(fault_hook().mu);
  fault_hook().fn = std::move(hook);
}
void set_checkpoint_read_hook(
    std::function<void(const std::string& entry, const Shape& start, const Shape& sizes, int rank)> hook) {
  std::lock_guard<std::mutex> lock(read_hook().mu);
  read_hook().fn = std::move(hook);
}
}  // namespace detail

void save_checkpoint(const std::string& dir_in, const StateDict& state, Communicator& comm,
                     const std::map<std::string, std::string>& metadata) {
  const std::string dir = strip_slash(dir_in);
  const std::string tmp = dir + ".tmp";
  const int rank = comm.rank();
  {
    std::set<std::string> seen;
    for (const auto& [name, t] : state) {
      QUILT_CHECK(t.defined(), "[save_checkpoint] tensor '", name, "' is undefined");
      QUILT_CHECK(seen.insert(name).second, "[save_checkpoint] tensor name '", name, "' appears twice");
    }
  }
  // Shards this rank writes: one copy of each block (coordinate 0 of every non-Shard axis).
  std::vector<std::pair<std::string, Tensor>> mine;
  json chunks = json::object();
  json tensors = json::array();
  {
    NoGradGuard ng;
    for (const auto& [name, t0] : state) {
      Tensor t = t0.detach();
      json info = {{"name", name}, {"dtype", safetensors_dtype_name(t.dtype())}, {"shape", t.shape()}};
      if (t.is_distributed()) {
        Placements pl = placements_of(t);
        bool partial = false;
        for (Placement& p : pl)
          if (p.is_partial()) { p = Replicate(); partial = true; }
        if (partial) t = redistribute(t, pl);  // collective over t's mesh, the same order on all ranks
        const DeviceMesh& mesh = mesh_of(t);
        info["placements"] = str(pl);
        info["mesh_shape"] = mesh.shape();
        bool writer = true;
        for (size_t a = 0; a < pl.size(); ++a) writer = writer && (pl[a].is_shard() || mesh.coordinate(int64_t(a)) == 0);
        const Block b = local_block(t.shape(), mesh.shape(), pl, mesh.coordinate());
        if (writer && numel_of(b.shape) > 0) {
          mine.emplace_back(name, contiguous(t.local()));
          chunks[name] = b.offset;
        }
      } else {
        info["placements"] = "plain";
        if (rank == 0 && t.numel() > 0) {
          mine.emplace_back(name, contiguous(t));
          chunks[name] = Shape(size_t(t.dim()), 0);
        }
      }
      tensors.push_back(std::move(info));
    }
  }

  // Phase 1: rank 0 prepares an empty temporary directory (an interrupted save may have left one).
  bool ok = true;
  std::string msg;
  if (rank == 0) {
    try {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      ok = false;
      msg = e.what();
    }
  }
  agree(comm, ok, msg, dir, "preparing " + tmp);

  // Phase 2: every rank writes its own file (the file itself is written atomically too).
  const std::string file = tmp + "/" + rank_file(rank);
  try {
    std::function<void(const std::string&, int)> hook;
    {
      std::lock_guard<std::mutex> lock(fault_hook().mu);
      hook = fault_hook().fn;
    }
    if (hook) hook(file, rank);
    save_safetensors(file, mine, {{kChunksKey, chunks.dump()}});
  } catch (const std::exception& e) {
    ok = false;
    msg = e.what();
  }
  agree(comm, ok, msg, dir, "writing its shards");

  // Phase 3: rank 0 writes the index from every rank's file and commits by renaming.
  if (rank == 0) {
    try {
      std::map<std::string, json> chunk_lists;  // name -> array of chunks
      for (int r = 0; r < comm.size(); ++r) {
        const std::string f = rank_file(r);
        const SafetensorsIndex idx = read_safetensors_index(tmp + "/" + f);
        const auto m = idx.metadata.find(kChunksKey);
        QUILT_CHECK(m != idx.metadata.end(), "[save_checkpoint] ", tmp, "/", f, " has no chunk metadata");
        const json offs = json::parse(m->second);
        for (const SafetensorsEntry& e : idx.entries) {
          // A tensor on a sub-mesh is replicated over the ranks outside it, which write the same
          // block again: the index keeps the first copy of each block.
          json& list = chunk_lists[e.name];
          const json off = offs.at(e.name);
          const bool dup = std::any_of(list.begin(), list.end(), [&](const json& c) {
            return c.at("offset") == off && c.at("shape") == json(e.shape);
          });
          if (!dup) list.push_back({{"file", f}, {"offset", off}, {"shape", e.shape}});
        }
      }
      for (json& t : tensors) {
        const std::string name = t.at("name").get<std::string>();
        t["chunks"] = chunk_lists.count(name) ? chunk_lists[name] : json::array();
        int64_t covered = 0;
        for (const json& c : t["chunks"]) covered += numel_of(shape_of(c.at("shape")));
        QUILT_CHECK(covered == numel_of(shape_of(t.at("shape"))), "[save_checkpoint] tensor '", name, "': the ranks wrote ",
                    covered, " of its ", numel_of(shape_of(t.at("shape"))), " elements");
      }
      json index = {{"format", kFormat}, {"world_size", comm.size()}, {"metadata", metadata}, {"tensors", tensors}};
      write_text_atomic(tmp + "/" + kIndexFile, index.dump(1), "save_checkpoint");
      fsync_path(tmp, true);
      std::error_code ec;
      if (fs::exists(dir)) {
        const std::string old = dir + ".old";
        fs::remove_all(old, ec);
        fs::rename(dir, old);
        fs::rename(tmp, dir);
        fs::remove_all(old, ec);
      } else {
        fs::rename(tmp, dir);
      }
      const std::string parent = fs::path(dir).parent_path().string();
      fsync_path(parent.empty() ? "." : parent, true);
    } catch (const std::exception& e) {
      ok = false;
      msg = e.what();
    }
  }
  agree(comm, ok, msg, dir, "committing");
}

void load_checkpoint(const std::string& dir, const StateDict& targets) {
  const Source src = read_index(dir, "load_checkpoint");
  std::map<std::string, SafetensorsIndex> files;
  for (const auto& [name, t] : targets) fill(src, name, t, files, "load_checkpoint");
}

CheckpointInfo read_checkpoint_info(const std::string& dir) {
  const Source src = read_index(dir, "read_checkpoint_info");
  CheckpointInfo info;
  info.dir = src.dir;
  info.world_size = src.world_size;
  info.metadata = src.metadata;
  for (const std::string& n : src.order) {
    const TensorRec& r = src.tensors.at(n);
    info.tensors.push_back({n, r.shape, r.dtype, r.placements});
  }
  return info;
}

std::string latest_checkpoint(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return "";
  std::string best;
  bool best_has = false;
  int64_t best_num = 0;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (!e.is_directory()) continue;
    const std::string name = e.path().filename().string();
    auto ends = [&](const char* suf) {
      const size_t n = std::char_traits<char>::length(suf);
      return name.size() >= n && name.compare(name.size() - n, n, suf) == 0;
    };
    if (ends(".tmp") || ends(".old") || !fs::is_regular_file(e.path() / kIndexFile)) continue;
    bool has = false;
    const int64_t num = trailing_number(name, &has);
    const bool better = best.empty() || (has && !best_has) || (has == best_has && (num > best_num || (num == best_num && name > fs::path(best).filename().string())));
    if (better) {
      best = e.path().string();
      best_has = has;
      best_num = num;
    }
  }
  return best;
}

std::vector<std::string> export_consolidated(const std::string& dir, const std::string& out_path,
                                             uint64_t max_shard_bytes, const std::vector<StackedName>& stacks) {
  const char* op = "export_consolidated";
  check_stacks(stacks, op);
  const Source src = read_index(dir, op);
  std::map<std::string, const StackedName*> rule_of;
  for (const StackedName& rule : stacks) {
    const auto it = src.tensors.find(rule.name);
    QUILT_CHECK(it != src.tensors.end(), "[", op, "] the rule for '", rule.name, "' names no tensor of ", src.what);
    const Shape& shape = it->second.shape;
    QUILT_CHECK(!shape.empty() && shape[0] == rule.count, "[", op, "] tensor '", rule.name, "' has shape ", shape, " in ",
                src.what, " but its rule stacks ", rule.count, " experts along dim 0");
    rule_of[rule.name] = &rule;
  }
  // What the files hold, in order: whole tensors, or the experts of a stacked one in its place
  // (expert e is its block (1, *rest) at (e, 0, ...)).
  struct Item {
    std::string out_name, src_name;
    int64_t expert = -1;  // -1: the whole tensor
    uint64_t bytes = 0;
  };
  std::vector<Item> items;
  for (const std::string& n : src.order) {
    const TensorRec& r = src.tensors.at(n);
    const uint64_t bytes = uint64_t(numel_of(r.shape)) * dtype_size(r.dtype);
    const auto ru = rule_of.find(n);
    if (ru == rule_of.end()) {
      items.push_back({n, n, -1, bytes});
      continue;
    }
    for (int64_t e = 0; e < ru->second->count; ++e)
      items.push_back({expert_name(*ru->second, e), n, e, bytes / uint64_t(ru->second->count)});
  }
  {
    std::map<std::string, std::string> from;  // output name -> the tensor it comes from
    for (const Item& it : items) {
      const auto [at, fresh] = from.emplace(it.out_name, it.src_name);
      QUILT_CHECK(fresh, "[", op, "] two tensors would be written as '", it.out_name, "': from '", at->second, "' and '",
                  it.src_name, "' of ", src.what);
    }
  }
  // Files of at most max_shard_bytes (a larger tensor gets a file of its own).
  std::vector<std::vector<const Item*>> groups(1);
  uint64_t in_group = 0, total = 0;
  for (const Item& it : items) {
    if (!groups.back().empty() && in_group + it.bytes > max_shard_bytes) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(&it);
    in_group += it.bytes;
    total += it.bytes;
  }
  const fs::path out(out_path);
  if (!out.parent_path().empty()) fs::create_directories(out.parent_path());
  std::string stem = out.filename().string();
  if (stem.size() > 12 && stem.substr(stem.size() - 12) == ".safetensors") stem = stem.substr(0, stem.size() - 12);
  std::vector<std::string> written;
  json weight_map = json::object();
  std::map<std::string, SafetensorsIndex> files;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const Item* it : groups[g]) {
      const TensorRec& r = src.tensors.at(it->src_name);
      if (it->expert < 0) {
        Tensor t = Tensor::empty(r.shape, {.dtype = r.dtype});
        fill(src, it->src_name, t, files, op);
        tensors.emplace_back(it->out_name, t);
        continue;
      }
      Block region{Shape(r.shape.size(), 0), r.shape};
      region.offset[0] = it->expert;
      region.shape[0] = 1;
      Tensor t = Tensor::empty(region.shape, {.dtype = r.dtype});
      fill(src, it->src_name, t, files, op, &region);
      tensors.emplace_back(it->out_name, t.squeeze(0));
    }
    std::string path = out_path;
    if (groups.size() > 1) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", g + 1, groups.size());
      path = (out.parent_path() / (stem + buf)).string();
      for (const Item* it : groups[g]) weight_map[it->out_name] = fs::path(path).filename().string();
    }
    save_safetensors(path, tensors, {{"format", "pt"}});
    written.push_back(path);
  }
  if (groups.size() > 1) {
    const std::string index_path = (out.parent_path() / (stem + ".safetensors.index.json")).string();
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_text_atomic(index_path, index.dump(2), op);
    written.push_back(index_path);
  }
  return written;
}

void import_consolidated(const std::string& path, const StateDict& targets, const std::vector<StackedName>& stacks) {
  const char* op = "import_consolidated";
  check_stacks(stacks, op);
  Source src = read_hf(path, op);
  for (const StackedName& rule : stacks) {
    const auto t = std::find_if(targets.begin(), targets.end(), [&](const auto& nt) { return nt.first == rule.name; });
    if (t != targets.end() && t->second.defined())
      stack_experts(src, rule, t->second.shape(), rank_label(t->second), op);
  }
  std::map<std::string, SafetensorsIndex> files;
  for (const auto& [name, t] : targets) fill(src, name, t, files, op);
}

}  // namespace quilt::dtensor
