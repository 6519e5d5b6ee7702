#!/usr/bin/python3
"""The PyTorch side of bench/compare: Quilt's training step written plainly in PyTorch.

It reads everything it needs from what Quilt reads or writes, so the two sides cannot drift:
  --recipe  the effective recipe (`quilt config check` output): batch sizes, seq_len, seed,
            AdamW hyper-parameters, lr schedule, grad clipping, dtype, data path;
  --hf      a Hugging Face Llama checkpoint (config.json + model.safetensors), here the one
            Quilt's trainer exported from its own initialisation;
  the token shards of the recipe's data.path (llm.c format, as `quilt data prepare` writes them),
  walked in the order of Quilt's DataLoader (tools/data.h: windows of seq_len + 1 tokens, each
  epoch a Feistel permutation keyed by (seed, epoch); step s reads stream positions
  [s * G, (s + 1) * G)).

The model is a straightforward Llama (RMSNorm, RoPE rotating (x_i, x_{i+D/2}) as HF's
rotate_half does, grouped-query attention by explicit math with a causal mask, SwiGLU MLP,
tied or untied head). The step is Quilt's (tools/trainer.cpp): lr = schedule(step - 1), the
micro-batches' mean losses each scaled by 1 / accumulation and backpropagated, the gradients
clipped to max_grad_norm, AdamW with weight decay on the >= 2-D parameters only, zero_grad.
Each step's time covers the same work as Quilt's step time (batch assembly, forward, backward,
clipping, optimizer step, zero_grad), measured with the same clock.

Writes one JSON line per step to --out: step, loss, grad_norm, lr, seconds.
Runs under /usr/bin/python3 with Debian's python3-torch (1.13).
"""
import argparse
import glob
import json
import math
import os
import struct
import sys
import time

import torch
import torch.nn.functional as F

M64 = (1 << 64) - 1


# ---- recipe -------------------------------------------------------------------------------

def read_recipe(path):
    """The two-level `section:\\n  key: value` scalars of recipe_to_yaml's output."""
    out, section = {}, None
    for line in open(path):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip(" "))
        key, _, value = line.strip().partition(":")
        value = value.strip()
        if indent == 0:
            section = key
        elif indent == 2 and value:
            out[f"{section}.{key}"] = value.strip('"')
    return out


def opt_float(v):
    return None if v == "none" else float(v)


# ---- data: Quilt's DataLoader order ---------------------------------------------------------

def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


class Permutation:
    """tools/data.cpp's Permutation: a 4-round balanced Feistel network with cycle-walking."""

    def __init__(self, n, key):
        bits = 1
        while bits < 64 and (1 << bits) < n:
            bits += 1
        self.n, self.half = n, (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [mix64((key + 0x632BE59BD9B4E019 * (i + 1)) & M64) for i in range(4)]

    def __call__(self, x):
        while True:
            left, right = x >> self.half, x & self.mask
            for k in self.keys:
                left, right = right, left ^ (mix64(right ^ k) & self.mask)
            x = (left << self.half) | right
            if x < self.n:
                return x


class Windows:
    """The windows of seq_len + 1 tokens of every shard a data path names, in Quilt's order."""

    def __init__(self, pattern, seq_len, seed):
        files = [pattern] if os.path.isfile(pattern) else sorted(
            glob.glob(os.path.join(pattern, "*.bin")) if os.path.isdir(pattern) else glob.glob(pattern))
        if not files:
            sys.exit(f"torch_llama: no token shards match {pattern}")
        self.shards = []
        for f in files:
            raw = open(f, "rb").read()
            magic, version, count = struct.unpack_from("<3i", raw)
            if (magic, version) == (20240520, 1):
                dtype, width = torch.int16, 2
            elif (magic, version) == (20240801, 7):
                dtype, width = torch.int32, 4
            else:
                sys.exit(f"torch_llama: {f} is not an llm.c token shard")
            t = torch.frombuffer(bytearray(raw[1024:1024 + count * width]), dtype=dtype).to(torch.int64)
            if width == 2:
                t = t & 0xFFFF  # uint16 stored as int16
            self.shards.append(t)
        self.seq_len, self.seed = seq_len, seed
        self.per_shard = [(len(s) - 1) // seq_len if len(s) else 0 for s in self.shards]
        self.count = sum(self.per_shard)
        if self.count == 0:
            sys.exit(f"torch_llama: {pattern} holds no window of {seq_len + 1} tokens")
        self.perms = {}

    def window_at(self, p):
        epoch, idx = divmod(p, self.count)
        if epoch not in self.perms:
            self.perms[epoch] = Permutation(self.count, mix64(self.seed ^ mix64((epoch + 0x5851F42D4C957F2D) & M64)))
        return self.perms[epoch](idx)

    def read(self, w):
        for shard, n in zip(self.shards, self.per_shard):
            if w < n:
                return shard[w * self.seq_len: w * self.seq_len + self.seq_len + 1]
            w -= n
        raise IndexError(w)


# ---- checkpoint -----------------------------------------------------------------------------

def read_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    dtypes = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16}
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        buf = bytearray(raw[8 + n + b: 8 + n + end])
        out[name] = torch.frombuffer(buf, dtype=dtypes[e["dtype"]]).reshape(e["shape"]).clone() if buf else \
            torch.zeros(e["shape"], dtype=dtypes[e["dtype"]])
    return out


# ---- model ----------------------------------------------------------------------------------

class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        h = c["hidden_size"]
        self.q_proj = torch.nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(self.heads * self.head_dim, h, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads  # query head h reads kv head h // group (HF repeat_kv)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        return self.o_proj((p @ v).transpose(1, 2).reshape(b, t, -1))


class MLP(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = torch.nn.Linear(h, i, bias=False)
        self.up_proj = torch.nn.Linear(h, i, bias=False)
        self.down_proj = torch.nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, cos, sin, mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList(DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = LlamaModel(c)
        self.tied = bool(c.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        # RoPE tables computed in f64 and rounded once to f32, as Quilt's rope_tables do.
        d = c["head_dim"]
        inv = 1.0 / (float(c["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(c["max_position_embeddings"], dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = torch.cat((ang.cos(), ang.cos()), dim=-1).float()
        self.sin = torch.cat((ang.sin(), ang.sin()), dim=-1).float()

    def forward(self, tokens):
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)  # True: masked (a key after the query)
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask)
        h = self.model.norm(h)
        return F.linear(h, self.model.embed_tokens.weight) if self.tied else self.lm_head(h)


def load_model(hf_dir):
    c = json.load(open(os.path.join(hf_dir, "config.json")))
    c.setdefault("num_key_value_heads", c["num_attention_heads"])
    if c.get("head_dim") is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    for key, ok in (("model_type", lambda v: v == "llama"), ("qk_norm", lambda v: not v),
                    ("rope_scaling", lambda v: v is None), ("num_experts", lambda v: not v)):
        if key in c and not ok(c[key]):
            sys.exit(f"torch_llama: config.json {key}={c[key]!r} is not supported (a dense Llama with plain RoPE)")
    model = LlamaForCausalLM(c)
    model.load_state_dict(read_safetensors(os.path.join(hf_dir, "model.safetensors")), strict=True)
    return model


# ---- the step -------------------------------------------------------------------------------

def lr_at(step, r, steps):
    """engine/optim/lr_schedule.cpp with the trainer's options (init_lr 0)."""
    lr, min_lr, warmup = float(r["train.lr"]), float(r["train.min_lr"]), int(r["train.warmup_steps"])
    decay_steps = max(steps, warmup + 1)
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if step >= decay_steps:
        return min_lr
    x = (step - warmup) / (decay_steps - warmup)
    coeff = 1.0 - x if r["train.decay"] == "linear" else 0.5 * (1.0 + math.cos(math.pi * x))
    return min_lr + (lr - min_lr) * coeff


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True, help="effective recipe (quilt config check output)")
    ap.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + model.safetensors)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="JSON lines, one per step")
    ap.add_argument("--foreach", choices=("auto", "on", "off"), default="auto",
                    help="AdamW's multi-tensor path (auto: PyTorch's default)")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    r = read_recipe(a.recipe)
    for key, want in (("train.dtype", "float32"), ("train.param_dtype", "none"), ("distributed.tp_size", "1"),
                      ("distributed.cp_size", "1"), ("distributed.pp_size", "1")):
        if r.get(key, want) != want:
            sys.exit(f"torch_llama: {key}={r[key]} is not supported (want {want})")
    steps, seq, gbs, mbs = (int(r[k]) for k in ("train.steps", "train.seq_len", "train.global_batch_size",
                                                "train.micro_batch_size"))
    accum = gbs // mbs  # one data-parallel rank
    clip = opt_float(r["train.max_grad_norm"])

    model = load_model(a.hf)
    model.train()
    data = Windows(r["data.path"], seq, int(r["train.seed"]))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    wd = float(r["train.weight_decay"])
    kw = {} if a.foreach == "auto" else {"foreach": a.foreach == "on"}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=float(r["train.lr"]), betas=(float(r["train.beta1"]), float(r["train.beta2"])),
                            eps=float(r["train.eps"]), weight_decay=wd, **kw)
    # Window ids of every step, computed before the clock starts (Quilt's costs nanoseconds).
    ids = [[[data.window_at(s * gbs + m * mbs + i) for i in range(mbs)] for m in range(accum)] for s in range(steps)]

    with open(a.out, "w") as out:
        for s in range(steps):
            t0 = time.perf_counter()
            lr = lr_at(s, r, steps)
            for g in opt.param_groups:
                g["lr"] = lr
            total = 0.0
            for m in range(accum):
                win = torch.stack([data.read(w) for w in ids[s][m]])
                inputs, targets = win[:, :-1], win[:, 1:]
                logits = model(inputs)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                (loss * (1.0 / accum)).backward()
                total += loss.item()
            params = decay + no_decay
            norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip is not None else \
                torch.norm(torch.stack([p.grad.norm() for p in params]))
            opt.step()
            opt.zero_grad(set_to_none=True)
            secs = time.perf_counter() - t0
            out.write(json.dumps({"step": s + 1, "loss": total / accum, "grad_norm": float(norm), "lr": lr,
                                  "seconds": secs}) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
