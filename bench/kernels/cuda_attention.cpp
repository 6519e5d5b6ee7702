// CUDA flash attention (kernels/cuda/attention.h) forward and backward TFLOP/s against the bf16
// GEMM ceiling. bf16, head dim 128, 16 heads, batch rows so that B * T = 16384 tokens (the grid
// fills the chip at every length). FLOPs: forward 4 B H T S D (the two products), halved under a
// causal mask; backward 2.5x the forward (five products, one of them the recomputed scores),
// as flash-attention benchmarks count them. The backward includes its delta kernel. Rows
// ending in /mma run the mma.sync kernels (kernels/cuda/attention_mma.cu, forward;
// attention_mma_backward.cu, backward), the others the WMMA ones, so one run prints both side
// by side (the backward rows' forward, run once to get out and lse, is the default kernel).
//
//   ./cuda_bench --benchmark_filter=attention
#include <cmath>
#include <string>
#include <utility>

#include "bench/kernels/cuda_bench.h"
#include "engine/engine.h"
#include "kernels/cuda/attention.h"

using namespace quilt;
using namespace quilt::cuda_bench;

namespace {

constexpr int64_t kHeads = 16, kDim = 128, kTokens = 16384;

struct Setup {
  kernels::cuda::AttentionArgs args;
  Tensor q, k, v, out, lse, dout, dq, dk, dv;
  double forward_flops;

  Setup(int64_t t, bool causal) {
    const int64_t b = kTokens / t;
    args = {.batch = b, .q_heads = kHeads, .kv_heads = kHeads, .t = t, .s = t, .d = kDim, .dv = kDim,
            .scale = 1.0 / std::sqrt(double(kDim)), .causal = causal};
    const Shape shape{b, kHeads, t, kDim};
    q = dev_randn(shape, DType::bf16, "q");
    k = dev_randn(shape, DType::bf16, "k");
    v = dev_randn(shape, DType::bf16, "v");
    dout = dev_randn(shape, DType::bf16, "dout");
    out = empty(shape, {.dtype = DType::bf16, .device = kGpu});
    dq = empty(shape, {.dtype = DType::bf16, .device = kGpu});
    dk = empty(shape, {.dtype = DType::bf16, .device = kGpu});
    dv = empty(shape, {.dtype = DType::bf16, .device = kGpu});
    lse = empty({b, kHeads, t}, {.dtype = DType::f32, .device = kGpu});
    forward_flops = 4.0 * double(b) * double(kHeads) * double(t) * double(t) * double(kDim) * (causal ? 0.5 : 1.0);
  }
  void forward() {
    kernels::cuda::attention_forward(DType::bf16, args, out.data_ptr(), lse.data_ptr(), q.data_ptr(), k.data_ptr(),
                                     v.data_ptr(), stream());
  }
  void backward() {
    kernels::cuda::attention_backward(DType::bf16, args, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                      dout.data_ptr(), nullptr, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                      out.data_ptr(), lse.data_ptr(), stream());
  }
};

void bm_forward(benchmark::State& state, int64_t t, bool causal, kernels::cuda::AttentionKernel kernel) {
  const kernels::cuda::AttentionKernel before = kernels::cuda::attention_kernel();
  kernels::cuda::set_attention_kernel(kernel);
  Setup s(t, causal);
  timed(state, 5, s.forward_flops, true, kPeakBf16Tflops, [&] { s.forward(); });
  kernels::cuda::set_attention_kernel(before);
}

void bm_backward(benchmark::State& state, int64_t t, bool causal, kernels::cuda::AttentionKernel kernel) {
  const kernels::cuda::AttentionKernel before = kernels::cuda::attention_backward_kernel();
  kernels::cuda::set_attention_backward_kernel(kernel);
  Setup s(t, causal);
  s.forward();
  timed(state, 3, 2.5 * s.forward_flops, true, kPeakBf16Tflops, [&] { s.backward(); });
  kernels::cuda::set_attention_backward_kernel(before);
}

void register_attention() {
  for (const auto& [t, causal] : {std::pair<int64_t, bool>{2048, true}, {8192, true}, {2048, false}}) {
    const std::string shape = shape_of({kTokens / t, kHeads, t, kDim}) + (causal ? "/causal" : "/dense");
    using kernels::cuda::AttentionKernel;
    reg("attention_fwd_bf16/" + shape,
        [t, causal](benchmark::State& s) { bm_forward(s, t, causal, AttentionKernel::wmma); });
    reg("attention_fwd_bf16/" + shape + "/mma",
        [t, causal](benchmark::State& s) { bm_forward(s, t, causal, AttentionKernel::mma); });
    reg("attention_bwd_bf16/" + shape,
        [t, causal](benchmark::State& s) { bm_backward(s, t, causal, AttentionKernel::wmma); });
    reg("attention_bwd_bf16/" + shape + "/mma",
        [t, causal](benchmark::State& s) { bm_backward(s, t, causal, AttentionKernel::mma); });
  }
}

const Registrar attention(register_attention);

}  // namespace
