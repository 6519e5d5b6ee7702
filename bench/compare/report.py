#!/usr/bin/python3
"""bench/compare's table: per-step losses of Quilt and PyTorch side by side, and tokens/s.

  report.py NAME TOKENS_PER_STEP WARMUP QUILT_ROUND1.jsonl[,ROUND2...] TORCH_ROUND1.jsonl[,...]

Losses and gradient norms come from round 1 of each side (later rounds repeat the same
computation; their losses are checked to be the same). Tokens/s is tokens per step divided by
the median step time over the steps after WARMUP of every round. Quilt's step time is
recovered from its metrics.jsonl tps (tokens / step seconds); PyTorch's is written directly.
Appends a one-line summary to $COMPARE_SUMMARY when that is set.
"""
import json
import os
import statistics
import sys


def rows(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def main():
    name, tokens, warm = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    q_runs = [rows(p) for p in sys.argv[4].split(",")]
    t_runs = [rows(p) for p in sys.argv[5].split(",")]
    q, t = q_runs[0], t_runs[0]
    if len(q) != len(t):
        sys.exit(f"{name}: quilt ran {len(q)} steps, torch {len(t)}")
    for runs, side in ((q_runs, "quilt"), (t_runs, "torch")):
        for k, other in enumerate(runs[1:], 2):
            drift = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs[0], other))
            if drift > 0:
                print(f"note: {side} round {k} losses differ from round 1 by up to {drift:.3g}")

    print(f"{'step':>4}  {'lr':>9}  {'quilt loss':>12}  {'torch loss':>12}  {'rel diff':>8}  "
          f"{'quilt |g|':>10}  {'torch |g|':>10}  {'quilt ms':>9}  {'torch ms':>9}")
    worst, worst_g = 0.0, 0.0
    for a, b in zip(q, t):
        rel = abs(a["loss"] - b["loss"]) / abs(b["loss"])
        rel_g = abs(a["grad_norm"] - b["grad_norm"]) / max(abs(b["grad_norm"]), 1e-30)
        worst, worst_g = max(worst, rel), max(worst_g, rel_g)
        timed = "" if a["step"] > warm else "  (warm-up)"
        print(f"{a['step']:>4}  {a['lr']:9.3e}  {a['loss']:12.8f}  {b['loss']:12.8f}  {rel:8.1e}  "
              f"{a['grad_norm']:10.6f}  {b['grad_norm']:10.6f}  {1e3 * tokens / a['tps']:9.1f}  "
              f"{1e3 * b['seconds']:9.1f}{timed}")
    q_secs = [tokens / r["tps"] for run in q_runs for r in run[warm:]]
    t_secs = [r["seconds"] for run in t_runs for r in run[warm:]]
    if not q_secs or not t_secs:
        sys.exit(f"{name}: no timed steps (steps must exceed the {warm} warm-up steps)")
    q_tps, t_tps = tokens / statistics.median(q_secs), tokens / statistics.median(t_secs)
    print(f"max relative loss difference {worst:.1e}, gradient norm {worst_g:.1e} (over {len(q)} steps)")
    print(f"tokens/s, median of {len(q_secs)} timed steps each: quilt {q_tps:,.0f}  torch {t_tps:,.0f}  "
          f"quilt/torch {q_tps / t_tps:.2f}x")
    if os.environ.get("COMPARE_SUMMARY"):
        with open(os.environ["COMPARE_SUMMARY"], "a") as f:
            f.write(f"| {name} | {q_tps:,.0f} | {t_tps:,.0f} | {q_tps / t_tps:.2f}x | {worst:.1e} | {worst_g:.1e} |\n")


if __name__ == "__main__":
    main()
