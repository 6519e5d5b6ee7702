// CUDA multi-tensor AdamW and SGD: one launch updates every tensor of a dtype combination.
// The host lays the tensors' chunks end to end (first_chunk, a prefix sum) and uploads one
// table (tensors) into a stream-ordered workspace buffer; each block finds its tensor by
// binary search and updates one chunk. kernels/elementwise_math.h's AdamWMath and SgdMath, as
// on the CPU, in float (double for f64 state).
#include <algorithm>
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
    adamw_multi_kernel(const AdamWEntry* __restrict__ entries, int count, int64_t total_chunks) {
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
    sgd_multi_kernel(const SgdEntry* __restrict__ entries, int count, int64_t total_chunks) {
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

// Uploads `entries` (first_chunk filled in here) and launches kernel(table, count, chunks).
template <class E, class Launch>
void launch_table(std::vector<E>& entries, cudaStream_t s, Launch&& launch) {
  int64_t chunks = 0;
  std::vector<E> live;
  for (E& e : entries) {
    if (e.n == 0) continue;  // nothing to update; keeps every entry's chunk range non-empty
    e.first_chunk = chunks;
    chunks += (e.n + kChunk - 1) / kChunk;
    live.push_back(e);
  }
  if (live.empty()) return;
  if (live.size() > size_t(INT32_MAX)) fail_msg("optimizer", "has more than 2^31 - 1 tensors in one step");
  const size_t bytes = live.size() * sizeof(E);
  void* table = workspace_alloc(bytes, s);
  // The host vector may go right after: a copy from pageable memory is staged before it returns.
  QUILT_CHECK_CUDA(cudaMemcpyAsync(table, live.data(), bytes, cudaMemcpyHostToDevice, s));
  const unsigned grid = unsigned(std::min<int64_t>(chunks, int64_t(INT32_MAX)));
  launch(static_cast<const E*>(table), int(live.size()), chunks, grid);
  const cudaError_t err = cudaGetLastError();
  workspace_free(table, s);  // before checking, so a failed launch does not leak it
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
void multi_step(const char* what, std::span<const T> tensors, cudaStream_t s, MakeEntry&& entry, Launch&& launch) {
  by_dtypes(tensors, [&](const std::vector<const T*>& group) {
    const T& first = *group[0];
    std::vector<E> entries;
    entries.reserve(group.size());
    for (const T* t : group) entries.push_back(entry(*t));
    dispatch(what, first.param_dt, first.grad_dt, first.state_dt, [&](auto p, auto g, auto st) {
      launch_table(entries, s, [&](const E* table, int count, int64_t chunks, unsigned grid) {
        launch(p, g, st, table, count, chunks, grid);
      });
    });
  });
}

}  // namespace

void adamw_multi(std::span<const AdamWTensor> tensors, void* stream) {
  const cudaStream_t s = as_stream(stream);
  multi_step<AdamWEntry>(
      "adamw", tensors, s,
      [](const AdamWTensor& t) {
        return AdamWEntry{.param = t.param, .grad = t.grad, .m = t.m, .v = t.v, .n = t.n, .first_chunk = 0,
                          .math = cpu::adamw_math(t.hyper)};
      },
      [&](auto p, auto g, auto st, const AdamWEntry* table, int count, int64_t chunks, unsigned grid) {
        adamw_multi_kernel<decltype(p), decltype(g), decltype(st)><<<grid, kOptThreads, 0, s>>>(table, count, chunks);
      });
}

void sgd_multi(std::span<const SgdTensor> tensors, void* stream) {
  const cudaStream_t s = as_stream(stream);
  multi_step<SgdEntry>(
      "sgd", tensors, s,
      [](const SgdTensor& t) {
        return SgdEntry{.param = t.param, .grad = t.grad, .buf = t.buf, .n = t.n, .first_chunk = 0,
                        .math = cpu::sgd_math(t.hyper)};
      },
      [&](auto p, auto g, auto st, const SgdEntry* table, int count, int64_t chunks, unsigned grid) {
        sgd_multi_kernel<decltype(p), decltype(g), decltype(st)><<<grid, kOptThreads, 0, s>>>(table, count, chunks);
      });
}

}  // namespace quilt::kernels::cuda
