// CUDA multi-tensor AdamW and SGD: one launch updates every tensor of a dtype combination.
// The host lays the tensors' chunks end to end (first_chunk, a prefix sum) and uploads one
// table (tensors) into a stream-ordered workspace buffer; each block finds its tensor by
// binary search and updates one chunk. kernels/elementwise_math.h's AdamWMath and SgdMath, as
// on the CPU, in float (double for f64 state).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/nn.h"

namespace quilt::kernels::cuda {
namespace {

constexpr int kOptThreads = 256;
constexpr int64_t kChunk = int64_t(kOptThreads) * 16;  // elements per block

// One AdamW tensor on the device; its constants computed in double on the host.
struct AdamWEntry {
  void* param;        // (n) P
  const void* grad;   // (n) G
  void* m;            // (n) S
  void* v;            // (n) S
  int64_t n;
  int64_t first_chunk;  // chunks of the tensors before this one
  AdamWMath<double> math;
};

struct SgdEntry {
  void* param;       // (n) P
  const void* grad;  // (n) G
  void* buf;         // (n) S, null without momentum
  int64_t n;
  int64_t first_chunk;
  SgdMath<double> math;
};

// Index of the entry whose chunks hold `chunk` (entries sorted by first_chunk, count > 0).
template <class E>
__device__ __forceinline__ int find_entry(const E* e, int count, int64_t chunk) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (e[mid].first_chunk <= chunk) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <class P, class G, class S>
__global__ void __launch_bounds__(kOptThreads)
    adamw_multi_kernel(const AdamWEntry* __restrict__ entries, int count, int64_t total_chunks, const bool* skip) {
  if (skip != nullptr && *skip) return;  // a non-finite step, decided on the device
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    const AdamWEntry& t = entries[find_entry(entries, count, chunk)];
    const int64_t begin = (chunk - t.first_chunk) * kChunk;
    const int64_t end = begin + kChunk < t.n ? begin + kChunk : t.n;
    P* p = static_cast<P*>(t.param);
    const G* g = static_cast<const G*>(t.grad);
    S* m = static_cast<S*>(t.m);
    S* v = static_cast<S*>(t.v);
    const AdamWMath<S> w = t.math.as<S>();
    for (int64_t i = begin + threadIdx.x; i < end; i += kOptThreads) {
      const S gi = S(Num<G>::load(g[i]));
      const S mi = w.moment1(m[i], gi);
      const S vi = w.moment2(v[i], gi);
      m[i] = mi;
      v[i] = vi;
      const S pi = S(Num<P>::load(p[i]));
      p[i] = Num<P>::store(w.param(pi, mi, m_sqrt(vi)));
    }
  }
}

template <class P, class G, class S>
__global__ void __launch_bounds__(kOptThreads)
    sgd_multi_kernel(const SgdEntry* __restrict__ entries, int count, int64_t total_chunks, const bool* skip) {
  if (skip != nullptr && *skip) return;
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    const SgdEntry& t = entries[find_entry(entries, count, chunk)];
    const int64_t begin = (chunk - t.first_chunk) * kChunk;
    const int64_t end = begin + kChunk < t.n ? begin + kChunk : t.n;
    P* p = static_cast<P*>(t.param);
    const G* g = static_cast<const G*>(t.grad);
    S* buf = static_cast<S*>(t.buf);
    const SgdMath<S> step = t.math.as<S>();
    for (int64_t i = begin + threadIdx.x; i < end; i += kOptThreads)
      p[i] = Num<P>::store(step(S(Num<P>::load(p[i])), S(Num<G>::load(g[i])), buf, i));
  }
}

// Checks the dtypes, then binds them as the CPU kernels do (cpu::dispatch_optim_types).
template <class F>
void dispatch(const char* what, DType param_dt, DType grad_dt, DType state_dt, F&& f) {
  if (!is_floating(param_dt)) fail_dtype(what, param_dt);
  if (grad_dt != param_dt && grad_dt != DType::f32) fail_dtype(what, grad_dt);
  if (state_dt != DType::f32 && state_dt != DType::f64) fail_dtype(what, state_dt);
  cpu::dispatch_optim_types(param_dt, grad_dt, state_dt, std::forward<F>(f));
}

// The entries of one launch with first_chunk filled in (empty tensors dropped, so every entry's
// chunk range is non-empty), and their chunk count.
template <class E>
int64_t live_entries(std::vector<E>& entries) {
  int64_t chunks = 0;
  std::vector<E> live;
  for (E& e : entries) {
    if (e.n == 0) continue;
    e.first_chunk = chunks;
    chunks += (e.n + kChunk - 1) / kChunk;
    live.push_back(e);
  }
  if (live.size() > size_t(INT32_MAX)) fail_msg("optimizer", "has more than 2^31 - 1 tensors in one step");
  entries = std::move(live);
  return chunks;
}

[[noreturn]] void table_too_small(const char* what, size_t have, size_t need) {
  const std::string m = "staged table of " + std::to_string(have) + " bytes is too small for this step (" +
                        std::to_string(need) + " bytes); size it from *_table_bytes before a capture";
  fail_msg(what, m.c_str());
}

// The room one launch's table takes in a staged table: its bytes, 256-aligned (TableSink and
// stage_tables lay the slices out alike).
size_t table_slice(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Where the launches of one step put their tables: a stream-ordered workspace buffer each, or
// consecutive slices of a staged table (written on the host, then copied inside the step).
class TableSink {
 public:
  TableSink(const OptimLaunch& o, cudaStream_t s) : table_(o.table), s_(s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    QUILT_CHECK_CUDA(cudaStreamIsCapturing(s, &status));
    // Outside a capture, an earlier step's copy may still be reading the host side.
    if (table_ && status == cudaStreamCaptureStatusNone) QUILT_CHECK_CUDA(cudaStreamSynchronize(s));
  }
  // Device address of `bytes` of table, filled from `src`; free() after the launch.
  void* put(const void* src, size_t bytes) {
    if (!table_) {
      void* t = workspace_alloc(bytes, s_);
      // The host vector may go right after: a copy from pageable memory is staged before it returns.
      QUILT_CHECK_CUDA(cudaMemcpyAsync(t, src, bytes, cudaMemcpyHostToDevice, s_));
      return t;
    }
    if (used_ + bytes > table_->bytes) table_too_small("optimizer", table_->bytes, used_ + bytes);
    char* host = static_cast<char*>(table_->host) + used_;
    char* dev = static_cast<char*>(table_->device) + used_;
    std::memcpy(host, src, bytes);
    // From pinned memory: a captured copy reads the host side when the graph runs.
    QUILT_CHECK_CUDA(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s_));
    used_ += table_slice(bytes);
    return dev;
  }
  void free(void* t) {
    if (!table_) workspace_free(t, s_);
  }

 private:
  StagedTable* table_;
  cudaStream_t s_;
  size_t used_ = 0;
};

// Uploads `entries` through `sink` and launches kernel(table, count, chunks, grid).
template <class E, class Launch>
void launch_table(std::vector<E>& entries, TableSink& sink, Launch&& launch) {
  const int64_t chunks = live_entries(entries);
  if (entries.empty()) return;
  void* table = sink.put(entries.data(), entries.size() * sizeof(E));
  const unsigned grid = unsigned(std::min<int64_t>(chunks, int64_t(INT32_MAX)));
  launch(static_cast<const E*>(table), int(entries.size()), chunks, grid);
  const cudaError_t err = cudaGetLastError();
  sink.free(table);  // before checking, so a failed launch does not leak it
  QUILT_CHECK_CUDA(err);
}

// Runs f(group) for each run of tensors sharing (param, grad, state) dtypes, in first-seen order.
template <class T, class F>
void by_dtypes(std::span<const T> tensors, F&& f) {
  std::vector<bool> done(tensors.size(), false);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (done[i]) continue;
    std::vector<const T*> group;
    for (size_t j = i; j < tensors.size(); ++j) {
      const T& a = tensors[i];
      const T& b = tensors[j];
      if (!done[j] && a.param_dt == b.param_dt && a.grad_dt == b.grad_dt && a.state_dt == b.state_dt) {
        done[j] = true;
        group.push_back(&b);
      }
    }
    f(group);
  }
}

// One launch per dtype combination of `tensors`: entry(t) builds each tensor's table row,
// launch(P{}, G{}, S{}, table, count, chunks, grid) starts the kernel on the uploaded table.
template <class E, class T, class MakeEntry, class Launch>
void multi_step(const char* what, std::span<const T> tensors, cudaStream_t s, const OptimLaunch& o, MakeEntry&& entry,
                Launch&& launch) {
  TableSink sink(o, s);
  by_dtypes(tensors, [&](const std::vector<const T*>& group) {
    const T& first = *group[0];
    std::vector<E> entries;
    entries.reserve(group.size());
    for (const T* t : group) entries.push_back(entry(*t));
    dispatch(what, first.param_dt, first.grad_dt, first.state_dt, [&](auto p, auto g, auto st) {
      launch_table(entries, sink, [&](const E* table, int count, int64_t chunks, unsigned grid) {
        launch(p, g, st, table, count, chunks, grid);
      });
    });
  });
}

// The tables multi_step would upload, end to end as a staged table lays them out: their bytes,
// and (with `host`) their contents written there.
template <class E, class T, class MakeEntry>
size_t stage_tables(std::span<const T> tensors, MakeEntry&& entry, void* host) {
  size_t used = 0;
  by_dtypes(tensors, [&](const std::vector<const T*>& group) {
    std::vector<E> entries;
    for (const T* t : group) entries.push_back(entry(*t));
    live_entries(entries);
    if (entries.empty()) return;
    const size_t bytes = entries.size() * sizeof(E);
    if (host) std::memcpy(static_cast<char*>(host) + used, entries.data(), bytes);
    used += table_slice(bytes);
  });
  return used;
}

AdamWEntry adamw_entry(const AdamWTensor& t) {
  return AdamWEntry{.param = t.param, .grad = t.grad, .m = t.m, .v = t.v, .n = t.n, .first_chunk = 0,
                    .math = cpu::adamw_math(t.hyper)};
}

SgdEntry sgd_entry(const SgdTensor& t) {
  return SgdEntry{.param = t.param, .grad = t.grad, .buf = t.buf, .n = t.n, .first_chunk = 0,
                  .math = cpu::sgd_math(t.hyper)};
}

}  // namespace

void adamw_multi(std::span<const AdamWTensor> tensors, void* stream, const OptimLaunch& o) {
  const cudaStream_t s = as_stream(stream);
  multi_step<AdamWEntry>(
      "adamw", tensors, s, o, adamw_entry,
      [&](auto p, auto g, auto st, const AdamWEntry* table, int count, int64_t chunks, unsigned grid) {
        adamw_multi_kernel<decltype(p), decltype(g), decltype(st)>
            <<<grid, kOptThreads, 0, s>>>(table, count, chunks, o.skip);
      });
}

size_t adamw_table_bytes(std::span<const AdamWTensor> tensors) {
  return stage_tables<AdamWEntry>(tensors, adamw_entry, nullptr);
}

void adamw_stage(std::span<const AdamWTensor> tensors, const StagedTable& table) {
  const size_t bytes = adamw_table_bytes(tensors);
  if (bytes > table.bytes) table_too_small("adamw", table.bytes, bytes);
  stage_tables<AdamWEntry>(tensors, adamw_entry, table.host);
}

void sgd_multi(std::span<const SgdTensor> tensors, void* stream, const OptimLaunch& o) {
  const cudaStream_t s = as_stream(stream);
  multi_step<SgdEntry>(
      "sgd", tensors, s, o, sgd_entry,
      [&](auto p, auto g, auto st, const SgdEntry* table, int count, int64_t chunks, unsigned grid) {
        sgd_multi_kernel<decltype(p), decltype(g), decltype(st)>
            <<<grid, kOptThreads, 0, s>>>(table, count, chunks, o.skip);
      });
}

size_t sgd_table_bytes(std::span<const SgdTensor> tensors) { return stage_tables<SgdEntry>(tensors, sgd_entry, nullptr); }

void sgd_stage(std::span<const SgdTensor> tensors, const StagedTable& table) {
  const size_t bytes = sgd_table_bytes(tensors);
  if (bytes > table.bytes) table_too_small("sgd", table.bytes, bytes);
  stage_tables<SgdEntry>(tensors, sgd_entry, table.host);
}

}  // namespace quilt::kernels::cuda
