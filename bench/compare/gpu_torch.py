#!/usr/bin/env python3
"""PyTorch's side of tools/gpu-check: the same kernels at the same shapes as cuda_bench, timed
with CUDA events (median of the timed launches after a warm-up), then one table that puts
Quilt's rate beside PyTorch's with their ratio, written as JSON too.

    python3 bench/compare/gpu_torch.py --quilt build-gpu/cuda_bench.txt --json build-gpu/gpu-check.json

Needs a CUDA build of PyTorch and a GPU; it is never part of `make test`. Rows whose shape names
differ between the two sides (a benchmark one side lacks) are listed with a dash on that side.
"""
import argparse
import json
import math
import re
import sys

import torch

PEAK_BF16_TFLOPS = 790.0  # dense bf16 GEMM measured on an H200
PEAK_F32_TFLOPS = 67.0  # f32 without TF32, datasheet
PEAK_GBPS = 4300.0  # device copy, bytes read + written


def median_ms(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def shape_of(*dims):
    return "x".join(str(d) for d in dims)


def zipf_counts(experts, rows):
    """Expert loads ~ 1 / (e + 1), at least one row each, the remainder to expert 0 (as
    bench/kernels/cuda_grouped.cpp splits them)."""
    h = sum(1.0 / (e + 1) for e in range(experts))
    counts = [max(1, int(rows / (h * (e + 1)))) for e in range(experts)]
    counts[0] += rows - sum(counts)
    return counts


def run():
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = []

    def add(kernel, shape, ms, work, tflops, peak):
        rate = work / (ms * 1e-3) / (1e12 if tflops else 1e9)
        out.append({"kernel": kernel, "shape": shape, "us": ms * 1e3, "rate": rate,
                    "unit": "TFLOP/s" if tflops else "GB/s", "pct_peak": 100.0 * rate / peak})

    for n in (4096, 8192):
        for dt, name, peak in ((torch.bfloat16, "gemm_bf16", PEAK_BF16_TFLOPS), (torch.float32, "gemm_f32", PEAK_F32_TFLOPS)):
            a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
            c = torch.empty(n, n, device=dev, dtype=dt)
            add(name, shape_of(n, n, n), median_ms(lambda: torch.matmul(a, b, out=c)), 2.0 * n ** 3, True, peak)
            del a, b, c

    big = 1 << 28
    x = torch.randn(big, device=dev)
    y = torch.empty_like(x)
    add("copy_f32", shape_of(big), median_ms(lambda: y.copy_(x)), 8.0 * big, False, PEAK_GBPS)
    yb = torch.empty(big, device=dev, dtype=torch.bfloat16)
    add("cast_f32_to_bf16", shape_of(big), median_ms(lambda: yb.copy_(x)), 6.0 * big, False, PEAK_GBPS)
    add("cast_bf16_to_f32", shape_of(big), median_ms(lambda: y.copy_(yb)), 6.0 * big, False, PEAK_GBPS)
    x2 = torch.randn(big, device=dev)
    add("add_f32", shape_of(big), median_ms(lambda: torch.add(x, x2, out=y)), 12.0 * big, False, PEAK_GBPS)
    xb, xb2 = x.bfloat16(), x2.bfloat16()
    add("add_bf16", shape_of(big), median_ms(lambda: torch.add(xb, xb2, out=yb)), 6.0 * big, False, PEAK_GBPS)
    add("randn_f32", shape_of(big), median_ms(lambda: y.normal_()), 4.0 * big, False, PEAK_GBPS)
    add("sum_f32", shape_of(big), median_ms(lambda: x.sum()), 4.0 * big, False, PEAK_GBPS)
    del x, y, yb, x2, xb, xb2

    s = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
    add("softmax_bf16", shape_of(16384, 4096), median_ms(lambda: torch.softmax(s, -1)), 2.0 * s.numel() * 2, False, PEAK_GBPS)
    s = torch.randn(65536, 512, device=dev)
    add("softmax_f32", shape_of(65536, 512), median_ms(lambda: torch.softmax(s, -1)), 2.0 * s.numel() * 4, False, PEAK_GBPS)
    logits = torch.randn(8192, 32768, device=dev, dtype=torch.bfloat16)
    t = torch.randint(0, 32768, (8192,), device=dev)
    add("cross_entropy_bf16", shape_of(8192, 32768),
        median_ms(lambda: torch.nn.functional.cross_entropy(logits, t, reduction="none")), logits.numel() * 2.0, False,
        PEAK_GBPS)
    m = torch.randn(65536, 4096, device=dev)
    add("row_sum_f32", shape_of(65536, 4096), median_ms(lambda: m.sum(-1)), m.numel() * 4.0, False, PEAK_GBPS)
    del s, logits, m

    # Grouped GEMM at Qwen3-30B-A3B's expert shapes: 128 experts, hidden 2048.
    if hasattr(torch, "_grouped_mm"):
        e, k, total = 128, 2048, 128 * 1024
        xg = torch.randn(total, k, device=dev, dtype=torch.bfloat16)
        for n in (768, 1536):
            w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16).transpose(1, 2)  # (E, K, N), N-major storage
            for split, counts in (("bal", [total // e] * e), ("zipf", zipf_counts(e, total))):
                offs = torch.tensor(counts, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
                try:
                    ms = median_ms(lambda: torch._grouped_mm(xg, w, offs=offs))
                    add("grouped_mm_" + split, shape_of(total, k, n), ms, 2.0 * total * k * n, True, PEAK_BF16_TFLOPS)
                except RuntimeError as err:  # an unsupported layout on this build: say so, go on
                    print(f"gpu_torch: _grouped_mm {split} N={n}: {err}", file=sys.stderr)
        del xg

    # Attention: causal SDPA, head dim 128, bf16; forward and forward + backward.
    for seq, batch in ((2048, 8), (8192, 2)):
        heads, hd = 16, 128
        q, kk, v = (torch.randn(batch, heads, seq, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(3))
        fwd_flops = 4.0 * batch * heads * seq * seq * hd / 2  # causal: half the score matrix
        f = lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True)
        shape = shape_of(batch, heads, seq, hd) + "/causal"
        add("attention_fwd_bf16", shape, median_ms(f), fwd_flops, True, PEAK_BF16_TFLOPS)
        o = f()
        g = torch.randn_like(o)
        add("attention_bwd_bf16", shape,
            median_ms(lambda: torch.autograd.grad(o, (q, kk, v), g, retain_graph=True)), 2.5 * fwd_flops, True,
            PEAK_BF16_TFLOPS)
        del q, kk, v, o, g
    try:
        out.append(llama_step_rows())
    except Exception as err:  # noqa: BLE001 -- a failed baseline must not hide the other rows
        print(f"gpu_torch: the Llama step failed: {err!r}", file=sys.stderr)
    return out


class TorchLlama(torch.nn.Module):
    """A plain eager Llama as a PyTorch user writes it (SDPA, GQA, RoPE, SwiGLU, RMSNorm), the
    shape of cuda_llama.cpp's dense model."""

    def __init__(self, vocab, hidden, layers, heads, kv_heads, head_dim, inter, max_pos):
        super().__init__()
        nn = torch.nn
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            blk = nn.Module()
            blk.ln1, blk.ln2 = nn.RMSNorm(hidden, eps=1e-5), nn.RMSNorm(hidden, eps=1e-5)
            blk.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
            blk.o = nn.Linear(heads * head_dim, hidden, bias=False)
            blk.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
            blk.down = nn.Linear(inter, hidden, bias=False)
            self.layers.append(blk)
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.head = nn.Linear(hidden, vocab, bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", torch.cat((ang.cos(), ang.cos()), -1).float(), persistent=False)
        self.register_buffer("sin", torch.cat((ang.sin(), ang.sin()), -1).float(), persistent=False)

    def rope(self, x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    def forward(self, tokens):
        b, t = tokens.shape
        cos, sin = self.cos[:t].to(self.head.weight.dtype), self.sin[:t].to(self.head.weight.dtype)
        h = self.embed(tokens)
        for blk in self.layers:
            q, k, v = blk.qkv(blk.ln1(h)).split(
                [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
            q = self.rope(q.view(b, t, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = self.rope(k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = h + blk.o(a.transpose(1, 2).reshape(b, t, -1))
            g, u = blk.gate_up(blk.ln2(h)).chunk(2, -1)
            h = h + blk.down(torch.nn.functional.silu(g) * u)
        return self.head(self.norm(h))


def llama_step_rows():
    """Tokens/s and model TFLOP/s of the ~1B dense step, bf16 weights, AdamW, eager."""
    dev = torch.device("cuda")
    vocab, hidden, layers, heads, kv, hd, inter = 32000, 2048, 16, 16, 8, 128, 5632
    batch, seq = 2, 2048
    model = TorchLlama(vocab, hidden, layers, heads, kv, hd, inter, 4096).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=dev)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms = median_ms(step, warmup=2, iters=5)
    n = sum(p.numel() for p in model.parameters()) - vocab * hidden  # the lookup is free
    flops_per_token = 6.0 * n + 12.0 * layers * heads * hd * seq / 2  # as Quilt's flops_per_token
    del model, opt
    torch.cuda.empty_cache()
    rate = flops_per_token * batch * seq / (ms * 1e-3) / 1e12
    return {"kernel": "llama1b_step_bf16", "shape": shape_of(batch, seq), "us": ms * 1e3, "rate": rate,
            "unit": "TFLOP/s", "pct_peak": 100.0 * rate / 989.0, "tokens_per_s": batch * seq / (ms * 1e-3)}


def parse_quilt(path):
    """Rows of cuda_bench's closing table: kernel, shape, time, rate, % of peak."""
    rows = {}
    if not path:
        return rows
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return rows
    started = False
    pat = re.compile(r"^(\S+)\s+(\S+)\s+([\d.]+) us\s+([\d.]+) (TFLOP/s|GB/s)\s+([\d.]+)%")
    for line in lines:
        if line.startswith("kernel "):
            started = True
            continue
        mt = pat.match(line) if started else None
        if mt:
            rows[(mt.group(1), mt.group(2))] = {"us": float(mt.group(3)), "rate": float(mt.group(4)),
                                                "unit": mt.group(5), "pct_peak": float(mt.group(6))}
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quilt", help="cuda_bench's output (its closing table is read)")
    ap.add_argument("--json", help="write both sides' rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_torch: PyTorch sees no CUDA device: nothing to compare")
        return 0
    torch_rows = run()
    quilt = parse_quilt(args.quilt)
    keyed = {(r["kernel"], r["shape"]): r for r in torch_rows}
    keys = list(quilt.keys()) + [k for k in keyed if k not in quilt]
    print(f"\n{'kernel':<26} {'shape':<22} {'quilt':>16} {'pytorch ' + torch.__version__.split('+')[0]:>18} {'quilt/pytorch':>14}")
    table = []
    for key in keys:
        # A variant of one of our kernels (shape "8x16x2048x128/causal/mma") is set beside the
        # PyTorch row of the kernel it stands in for.
        q, t = quilt.get(key), keyed.get(key) or keyed.get((key[0], key[1].removesuffix("/mma")))
        unit = (q or t)["unit"]
        qs = f"{q['rate']:.1f} {unit}" if q else "-"
        ts = f"{t['rate']:.1f} {unit}" if t else "-"
        ratio = q["rate"] / t["rate"] if q and t and t["rate"] > 0 else math.nan
        print(f"{key[0]:<26} {key[1]:<22} {qs:>16} {ts:>18} {'-' if math.isnan(ratio) else f'{ratio:.2f}':>14}")
        table.append({"kernel": key[0], "shape": key[1], "unit": unit, "quilt": q, "pytorch": t,
                      "ratio": None if math.isnan(ratio) else ratio})
    if args.json:
        info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": table}
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
