// MoE kernel benchmarks at Qwen3-30B-A3B shapes (E = 128 experts, hidden K = 2048, expert
// width N = 768 or 1536 (gate+up), 128 * 1024 routed rows), bf16:
//   grouped_mm_*      kernels::cuda::grouped_gemm (offsets read on the device), the default WMMA
//                     kernel; the same name ending in /mma: the opt-in mma.sync kernel
//   grouped_dgrad_*   the same kernels for dx = dy @ w_e^T (N -> K = 2048, w read transposed)
//   grouped_wgrad_*   kernels::cuda::grouped_gemm_weight_grad, dw_e = x_e^T @ dy_e (K-grouped)
//   grouped_loop_*    one cublasGemmEx per expert, host-known counts, same stream
//   grouped_cublas_*  cublasGemmGroupedBatchedEx (one call, E groups of one GEMM each)
//   dense_same_flops  one cuBLAS GEMM of all rows against one expert's matrix (kernels::cuda::gemm)
// with balanced counts (1024 rows each) and a Zipf-like split (count_e ~ 1 / (e + 1)), each in
// TFLOP/s against the dense bf16 ceiling; and the token permute and combine (128k tokens x
// 2048 hidden, top-8) in GB/s (bytes read + written) against the copy ceiling.
// Needs cuBLAS at link time: -lcublas -lcudart (with -L/usr/local/cuda/lib64 -I/usr/local/cuda/include).
#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "bench/kernels/cuda_bench.h"
#include "engine/engine.h"
#include "engine/ops/moe.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/moe.h"

using namespace quilt;
using namespace quilt::cuda_bench;

namespace {

constexpr int64_t kExperts = 128, kHidden = 2048, kRows = 128 * 1024;

void check_blas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string("[cuda_grouped] ") + what + " failed");
}
void check_rt(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("[cuda_grouped] ") + what + ": " + cudaGetErrorString(err));
}

cublasHandle_t blas() {
  static cublasHandle_t h = [] {
    cublasHandle_t x = nullptr;
    check_blas(cublasCreate(&x), "cublasCreate");
    return x;
  }();
  check_blas(cublasSetStream(h, static_cast<cudaStream_t>(stream())), "cublasSetStream");
  return h;
}

// Rows per expert summing to kRows: equal, or ~ 1 / (e + 1) (every expert keeps at least one row).
std::vector<int64_t> split_counts(bool zipf) {
  std::vector<int64_t> c(size_t(kExperts), kRows / kExperts);
  if (!zipf) return c;
  double h = 0;
  for (int64_t e = 0; e < kExperts; ++e) h += 1.0 / double(e + 1);
  int64_t used = 0;
  for (int64_t e = 0; e < kExperts; ++e) used += c[size_t(e)] = std::max<int64_t>(1, int64_t(kRows / (h * (e + 1))));
  c[0] += kRows - used;
  return c;
}

struct Problem {
  std::vector<int64_t> counts, offsets;
  Tensor x, w, out, dev_offsets;
  int64_t n;
};

Problem make_problem(bool zipf, int64_t n) {
  Problem p;
  p.counts = split_counts(zipf);
  p.offsets.resize(p.counts.size());
  std::partial_sum(p.counts.begin(), p.counts.end(), p.offsets.begin());
  p.n = n;
  p.x = dev_randn({kRows, kHidden}, DType::bf16, "x");
  p.w = dev_randn({kExperts, kHidden, n}, DType::bf16, "w");
  p.out = empty({kRows, n}, {.dtype = DType::bf16, .device = kGpu});
  std::vector<double> off(p.offsets.begin(), p.offsets.end());
  p.dev_offsets = from_vector(off, {kExperts}, {.dtype = DType::i64}).to(kGpu);
  return p;
}

double flops_of(int64_t n) { return 2.0 * double(kRows) * double(kHidden) * double(n); }

// Runs with one grouped GEMM kernel selected, then restores the previous selection.
class UseKernel {
 public:
  explicit UseKernel(kernels::cuda::GroupedGemmKernel k) : saved_(kernels::cuda::grouped_gemm_kernel()) {
    kernels::cuda::set_grouped_gemm_kernel(k);
  }
  ~UseKernel() { kernels::cuda::set_grouped_gemm_kernel(saved_); }
  UseKernel(const UseKernel&) = delete;
  UseKernel& operator=(const UseKernel&) = delete;

 private:
  kernels::cuda::GroupedGemmKernel saved_;
};

using kernels::cuda::GroupedGemmKernel;

void bm_quilt(benchmark::State& state, bool zipf, int64_t n, GroupedGemmKernel kernel) {
  const UseKernel use(kernel);
  Problem p = make_problem(zipf, n);
  kernels::GroupedGemmArgs g;
  g.groups = kExperts;
  g.offsets = p.dev_offsets.data<int64_t>();
  g.m = kRows; g.n = n; g.k = kHidden;
  g.x = p.x.data_ptr(); g.ldx = kHidden;
  g.w = p.w.data_ptr(); g.ldw = n; g.w_group_stride = kHidden * n;
  g.out = p.out.data_ptr(); g.ldo = n;
  timed(state, 5, flops_of(n), true, kPeakBf16Tflops, [&] { kernels::cuda::grouped_gemm(DType::bf16, g, stream()); });
}

// dx (rows, K) = dy (rows, n) @ w_e^T: w (E, K, n) read as the transposed (n, K) operand.
void bm_dgrad(benchmark::State& state, bool zipf, int64_t n, GroupedGemmKernel kernel) {
  const UseKernel use(kernel);
  Problem p = make_problem(zipf, n);
  Tensor dy = dev_randn({kRows, n}, DType::bf16, "dy");
  Tensor dx = empty({kRows, kHidden}, {.dtype = DType::bf16, .device = kGpu});
  kernels::GroupedGemmArgs g;
  g.groups = kExperts;
  g.offsets = p.dev_offsets.data<int64_t>();
  g.m = kRows; g.n = kHidden; g.k = n;
  g.x = dy.data_ptr(); g.ldx = n;
  g.w = p.w.data_ptr(); g.trans_w = true; g.ldw = n; g.w_group_stride = kHidden * n;
  g.out = dx.data_ptr(); g.ldo = kHidden;
  timed(state, 5, flops_of(n), true, kPeakBf16Tflops, [&] { kernels::cuda::grouped_gemm(DType::bf16, g, stream()); });
}

// dw (E, K, n): dw_e = x_e^T @ dy_e over expert e's rows.
void bm_wgrad(benchmark::State& state, bool zipf, int64_t n, GroupedGemmKernel kernel) {
  const UseKernel use(kernel);
  Problem p = make_problem(zipf, n);
  Tensor dy = dev_randn({kRows, n}, DType::bf16, "dy");
  kernels::GroupedGemmWeightGradArgs g;
  g.groups = kExperts;
  g.offsets = p.dev_offsets.data<int64_t>();
  g.m = kRows; g.n = n; g.k = kHidden;
  g.x = p.x.data_ptr(); g.ldx = kHidden;
  g.dy = dy.data_ptr(); g.lddy = n;
  g.dw = p.w.data_ptr();  // (E, K, n), overwritten
  timed(state, 5, flops_of(n), true, kPeakBf16Tflops,
        [&] { kernels::cuda::grouped_gemm_weight_grad(DType::bf16, g, stream()); });
}

// Row-major out_e = x_e @ w_e as column-major out_e^T = w_e^T x_e^T (the operands swapped).
void bm_loop(benchmark::State& state, bool zipf, int64_t n) {
  Problem p = make_problem(zipf, n);
  cublasHandle_t h = blas();
  const float one = 1.0f, zero = 0.0f;
  auto* x = static_cast<const uint16_t*>(p.x.data_ptr());
  auto* w = static_cast<const uint16_t*>(p.w.data_ptr());
  auto* out = static_cast<uint16_t*>(p.out.data_ptr());
  timed(state, 5, flops_of(n), true, kPeakBf16Tflops, [&] {
    int64_t start = 0;
    for (int64_t e = 0; e < kExperts; ++e) {
      const int64_t rows = p.counts[size_t(e)];
      if (rows > 0)
        check_blas(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(rows), int(kHidden), &one,
                                w + e * kHidden * n, CUDA_R_16BF, int(n), x + start * kHidden, CUDA_R_16BF,
                                int(kHidden), &zero, out + start * n, CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
      start += rows;
    }
  });
}

void bm_cublas_grouped(benchmark::State& state, bool zipf, int64_t n) {
  Problem p = make_problem(zipf, n);
  cublasHandle_t h = blas();
  auto* x = static_cast<const uint16_t*>(p.x.data_ptr());
  auto* w = static_cast<const uint16_t*>(p.w.data_ptr());
  auto* out = static_cast<uint16_t*>(p.out.data_ptr());
  std::vector<cublasOperation_t> ops;
  std::vector<int> ms, ns, ks, lda, ldb, ldc, sizes;
  std::vector<float> alpha, beta;
  std::vector<const void*> a_ptr, b_ptr;
  std::vector<void*> c_ptr;
  int64_t start = 0;
  for (int64_t e = 0; e < kExperts; ++e) {
    const int64_t rows = p.counts[size_t(e)];
    if (rows > 0) {
      ops.push_back(CUBLAS_OP_N);
      ms.push_back(int(n)); ns.push_back(int(rows)); ks.push_back(int(kHidden));
      lda.push_back(int(n)); ldb.push_back(int(kHidden)); ldc.push_back(int(n));
      sizes.push_back(1);
      alpha.push_back(1.0f); beta.push_back(0.0f);
      a_ptr.push_back(w + e * kHidden * n);
      b_ptr.push_back(x + start * kHidden);
      c_ptr.push_back(out + start * n);
    }
    start += rows;
  }
  const int groups = int(ops.size());
  // The pointer arrays live on the device; sizes, leading dims and scalars on the host.
  void* dev = nullptr;
  const size_t bytes = size_t(groups) * 3 * sizeof(void*);
  check_rt(cudaMalloc(&dev, bytes), "cudaMalloc");
  std::vector<const void*> all(a_ptr);
  all.insert(all.end(), b_ptr.begin(), b_ptr.end());
  all.insert(all.end(), c_ptr.begin(), c_ptr.end());
  check_rt(cudaMemcpy(dev, all.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  const void* const* dp = static_cast<const void* const*>(dev);
  try {
    timed(state, 5, flops_of(n), true, kPeakBf16Tflops, [&] {
      check_blas(cublasGemmGroupedBatchedEx(h, ops.data(), ops.data(), ms.data(), ns.data(), ks.data(), alpha.data(),
                                            dp, CUDA_R_16BF, lda.data(), dp + groups, CUDA_R_16BF, ldb.data(),
                                            beta.data(), const_cast<void* const*>(dp + 2 * groups), CUDA_R_16BF,
                                            ldc.data(), groups, sizes.data(), CUBLAS_COMPUTE_32F),
                 "cublasGemmGroupedBatchedEx");
    });
  } catch (const std::exception& ex) {
    state.SkipWithError(ex.what());
  }
  check_rt(cudaFree(dev), "cudaFree");
}

void bm_dense(benchmark::State& state, int64_t n) {
  Tensor x = dev_randn({kRows, kHidden}, DType::bf16, "x"), w = dev_randn({kHidden, n}, DType::bf16, "w");
  Tensor out = empty({kRows, n}, {.dtype = DType::bf16, .device = kGpu});
  kernels::GemmArgs g;
  g.m = kRows; g.n = n; g.k = kHidden;
  g.a = x.data_ptr(); g.lda = kHidden;
  g.b = w.data_ptr(); g.ldb = n;
  g.c = out.data_ptr(); g.ldc = n;
  timed(state, 5, flops_of(n), true, kPeakBf16Tflops, [&] { kernels::cuda::gemm(DType::bf16, g, stream()); });
}

// Token permute (T x H -> T*k x H) and weighted combine back, top-k routing of random experts.
struct Routed {
  int64_t tokens = 128 * 1024, k = 8, h = kHidden;
  Tensor x, y, w, order, slot_row;
};

Routed make_routed() {
  Routed r;
  const MoeRouting route = moe_route(randint(0, kExperts, {r.tokens, r.k}, RngKey(1, "idx")).to(kGpu), kExperts);
  r.order = route.order;
  r.slot_row = empty({r.tokens * r.k}, {.dtype = DType::i64, .device = kGpu});
  kernels::cuda::moe_invert_order(r.tokens * r.k, r.order.data<int64_t>(), r.slot_row.data<int64_t>(), stream());
  r.x = dev_randn({r.tokens, r.h}, DType::bf16, "x");
  r.y = dev_randn({r.tokens * r.k, r.h}, DType::bf16, "y");
  r.w = dev_randn({r.tokens, r.k}, DType::bf16, "w");
  return r;
}

void bm_permute(benchmark::State& state) {
  Routed r = make_routed();
  Tensor out = empty({r.tokens * r.k, r.h}, {.dtype = DType::bf16, .device = kGpu});
  const double bytes = 2.0 * double(r.tokens * r.k * r.h) * 2.0;  // each routed row read and written
  timed(state, 5, bytes, false, kPeakGBps, [&] {
    kernels::cuda::moe_permute(DType::bf16, r.tokens * r.k, r.h, r.k, r.order.data<int64_t>(), r.x.data_ptr(), r.h,
                               nullptr, out.data_ptr(), stream());
  });
}

void bm_combine(benchmark::State& state) {
  Routed r = make_routed();
  Tensor out = empty({r.tokens, r.h}, {.dtype = DType::bf16, .device = kGpu});
  const double bytes = double(r.tokens * r.k * r.h + r.tokens * r.h) * 2.0;  // k rows read, one written
  timed(state, 5, bytes, false, kPeakGBps, [&] {
    kernels::cuda::moe_unpermute(DType::bf16, r.tokens, r.h, r.k, r.slot_row.data<int64_t>(), r.y.data_ptr(), r.h,
                                 r.w.data_ptr(), out.data_ptr(), stream());
  });
}

void register_grouped() {
  for (int64_t n : {int64_t(768), int64_t(1536)}) {
    const std::string shape = shape_of({kRows, kHidden, n});
    for (bool zipf : {false, true}) {
      const std::string split = zipf ? "zipf" : "bal";
      for (GroupedGemmKernel kernel : {GroupedGemmKernel::wmma, GroupedGemmKernel::mma}) {
        const std::string tag = kernel == GroupedGemmKernel::mma ? "/mma" : "";
        reg("grouped_mm_" + split + "/" + shape + tag,
            [zipf, n, kernel](benchmark::State& s) { bm_quilt(s, zipf, n, kernel); });
        // The backward GEMMs at the wider expert only (the bench's time is limited).
        if (n == 1536) {
          reg("grouped_dgrad_" + split + "/" + shape + tag,
              [zipf, n, kernel](benchmark::State& s) { bm_dgrad(s, zipf, n, kernel); });
          reg("grouped_wgrad_" + split + "/" + shape + tag,
              [zipf, n, kernel](benchmark::State& s) { bm_wgrad(s, zipf, n, kernel); });
        }
      }
      reg("grouped_loop_" + split + "/" + shape, [zipf, n](benchmark::State& s) { bm_loop(s, zipf, n); });
      reg("grouped_cublas_" + split + "/" + shape,
          [zipf, n](benchmark::State& s) { bm_cublas_grouped(s, zipf, n); });
    }
    reg("dense_same_flops/" + shape, [n](benchmark::State& s) { bm_dense(s, n); });
  }
  reg("moe_permute_bf16/" + shape_of({128 * 1024, kHidden, 8}), [](benchmark::State& s) { bm_permute(s); });
  reg("moe_combine_bf16/" + shape_of({128 * 1024, kHidden, 8}), [](benchmark::State& s) { bm_combine(s); });
}

const Registrar grouped(register_grouped);

}  // namespace
