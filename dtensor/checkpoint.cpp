// Sharded checkpoints (per-rank safetensors + index, committed by rename), resharding loads that
// read only the needed blocks, and Hugging Face consolidated export/import.
#include "dtensor/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
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
        r.chunks.push_back({c.at("file").get<std::string>(), shape_of(c.at("offset")), shape_of(c.at("shape"))});
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
    r.chunks.push_back({file, Shape(e.shape.size(), 0), e.shape});
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

// ---- filling a target's block from a source ----

int rank_label(const Tensor& t) {
  if (t.is_distributed()) {
    const DeviceMesh& m = mesh_of(t);
    return m.ranks()[size_t(m.rank())];
  }
  return is_initialized() ? launch_info().rank : 0;
}

void fill(const Source& src, const std::string& name, const Tensor& target, std::map<std::string, SafetensorsIndex>& files,
          const char* op) {
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
  QUILT_CHECK(rec.shape == target.shape(), "[", op, "] tensor '", name, "' has shape ", rec.shape, " in ", src.what,
              " but the target has shape ", target.shape(), " (rank ", rank, ")");
  NoGradGuard ng;
  Block block{Shape(rec.shape.size(), 0), rec.shape};
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
    Tensor piece;
    try {
      auto fi = files.find(c.file);
      if (fi == files.end()) fi = files.emplace(c.file, read_safetensors_index(src.dir + "/" + c.file)).first;
      Shape start(block.shape.size());
      for (size_t d = 0; d < start.size(); ++d) start[d] = inter.offset[d] - c.offset[d];
      piece = read_safetensors_block(fi->second, name, start, inter.shape);
    } catch (const Error& e) {
      fail("[", op, "] tensor '", name, "' (rank ", rank, "): ", e.what());
    }
    Tensor dst = local;
    for (size_t d = 0; d < block.shape.size(); ++d)
      dst = dst.narrow(int64_t(d), inter.offset[d] - block.offset[d], inter.shape[d]);
    dst.copy_(piece);
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
                                             uint64_t max_shard_bytes) {
  const Source src = read_index(dir, "export_consolidated");
  // Files of at most max_shard_bytes (a larger tensor gets a file of its own).
  std::vector<std::vector<std::string>> groups(1);
  uint64_t in_group = 0, total = 0;
  for (const std::string& n : src.order) {
    const TensorRec& r = src.tensors.at(n);
    const uint64_t bytes = uint64_t(numel_of(r.shape)) * dtype_size(r.dtype);
    if (!groups.back().empty() && in_group + bytes > max_shard_bytes) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(n);
    in_group += bytes;
    total += bytes;
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
    for (const std::string& n : groups[g]) {
      const TensorRec& r = src.tensors.at(n);
      Tensor t = Tensor::empty(r.shape, {.dtype = r.dtype});
      fill(src, n, t, files, "export_consolidated");
      tensors.emplace_back(n, t);
    }
    std::string path = out_path;
    if (groups.size() > 1) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", g + 1, groups.size());
      path = (out.parent_path() / (stem + buf)).string();
      for (const std::string& n : groups[g]) weight_map[n] = fs::path(path).filename().string();
    }
    save_safetensors(path, tensors, {{"format", "pt"}});
    written.push_back(path);
  }
  if (groups.size() > 1) {
    const std::string index_path = (out.parent_path() / (stem + ".safetensors.index.json")).string();
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_text_atomic(index_path, index.dump(2), "export_consolidated");
    written.push_back(index_path);
  }
  return written;
}

void import_consolidated(const std::string& path, const StateDict& targets) {
  const Source src = read_hf(path, "import_consolidated");
  std::map<std::string, SafetensorsIndex> files;
  for (const auto& [name, t] : targets) fill(src, name, t, files, "import_consolidated");
}

}  // namespace quilt::dtensor
