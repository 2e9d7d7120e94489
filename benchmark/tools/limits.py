"""What this CPU can do at most: its float32 matmul rate and its memory bandwidth, the yardsticks of docs/speed.md.

    python -m benchmark.tools.limits                  # one thread and every thread; a table, and --out FILE as JSON
    python -m benchmark.tools.limits --threads 1 --seconds 2

Issue 70: "faster than TRL" was the only yardstick; a stage's achieved rate against these says how far it is from
what the machine allows. Measured, not taken from a datasheet:
  * matmul: `torch.mm` of two n x n float32 matrices, n in --sizes, each repeated for about --seconds; 2 n^3
    floating-point operations a product; the best size's rate is the attainable rate (a training step's matmuls are
    of these sizes and smaller: tiny-neox's hidden size is 128);
  * memory: `dst.copy_(src)` of two --mib MiB float32 tensors (read once, written once: 2 x the bytes moved) and
    `src.sum()` (read once), far larger than the caches; the better is the attainable bandwidth. Sampling a small
    batch (1-64 sequences) reads every weight once a token, so it is bound by this, not by the matmul rate.
A model's FLOPs (`model_flops`): 2 N per token for a forward pass and 6 N for a forward and backward (Kaplan et al.
2020, arXiv:2001.08361, section 2.1), N the parameters outside the input embedding (the output head counted, tied
or not); a pass's FLOPs count every token, so work a side skips (ours runs the LM head on the response positions
only, TRL pads) does not change them: a share is of the model's FLOPs, as an MFU is; attention's own term (2 n_layer
n_ctx d_model a token) is left out: below 5% of 2 N at the tiny world's 176-token sequences and 128 hidden units.
The machine is shared and its speed drifts by 10-20%: take the best of a few runs, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def timed_rate(work, units: float, seconds: float) -> float:
    """`units` per second of `work()`, the best of repeated calls over about `seconds` (after one warm-up call)."""
    work()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        t0 = time.perf_counter()
        work()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return units / best


def matmul_gflops(n: int, seconds: float) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return timed_rate(lambda: torch.mm(a, b, out=out), 2.0 * n**3, seconds) / 1e9


def bandwidth_gbs(mib: int, seconds: float) -> dict[str, float]:
    n = mib * 2**20 // 4
    src, dst = torch.randn(n), torch.empty(n)
    return {
        "copy": timed_rate(lambda: dst.copy_(src), 2.0 * n * 4, seconds) / 1e9,
        "read": timed_rate(lambda: src.sum(), n * 4.0, seconds) / 1e9,
    }


def model_flops(parameters: int, tokens: int, backward: bool) -> float:
    """FLOPs of a pass over `tokens` tokens of a model of `parameters` non-embedding parameters: 2 N a token forward,
    6 N with the backward pass (Kaplan et al. 2020)."""
    return (6.0 if backward else 2.0) * parameters * tokens


def episode_flops(algo: str, tokens: float, completion: float, n_policy: int, n_value: int, ppo_epochs: int) -> float:
    """Model FLOPs of one episode of `benchmark.tools.speed`'s work (`model_flops` per pass, the useful tokens only: a
    side's padding is its own overhead). `tokens`: an episode's tokens (rm, dpo: chosen + rejected with their prompts;
    online: prompt + `completion`, the mean sampled length); `n_policy` / `n_value`: non-embedding parameters of the
    policy (rm: the reward model) and of the value and reward models (ppo). The passes:
      rm    the reward model forward and backward: 6 N
      dpo   the policy forward and backward, the reference forward: 6 N + 2 N
      ppo   sampling 2 N; the rollout's reference, value and reward forward passes 2 N + 2 Nv + 2 Nv; each PPO epoch
            the policy's and the value model's forward and backward 6 (N + Nv); the policy's rollout logprobs are the
            sampler's (TRL recomputes them: its overhead)
      grpo, rloo  sampling 2 N; the reference forward 2 N; one forward and backward 6 N"""
    if algo == "rm":
        return model_flops(n_policy, tokens, backward=True)
    if algo == "dpo":
        return model_flops(n_policy, tokens, backward=True) + model_flops(n_policy, tokens, backward=False)
    if algo == "ppo":
        frozen = model_flops(2 * n_policy + 2 * n_value, tokens, backward=False)  # sampling + reference, value, reward
        return frozen + ppo_epochs * model_flops(n_policy + n_value, tokens, backward=True)
    if algo in ("grpo", "rloo"):
        return model_flops(2 * n_policy, tokens, backward=False) + model_flops(n_policy, tokens, backward=True)
    raise ValueError(f"no FLOP model for {algo!r}")


def decode_bytes(steps: int, contexts: int, weight_bytes: int, kv_bytes_per_token: int) -> float:
    """Bytes one sampling call reads at least: every weight once a decoding step (`steps`: the longest completion's),
    and at each step each live row's KV cache (`contexts`: over the rows, the sum of the context lengths before each
    of their tokens; a finished row leaves the batch; `kv_bytes_per_token`: 2 x layers x KV width x element size). A
    decoding step of 1-64 rows does too little arithmetic per byte to be bound by the matmul rate."""
    return steps * weight_bytes + contexts * kv_bytes_per_token


def row_contexts(prompt_lengths: list[int], completion_lengths: list[int]) -> int:
    """`decode_bytes`'s `contexts`: a row of prompt P decoding L tokens reads contexts P, P + 1, ..., P + L - 1."""
    return sum(length * p + length * (length - 1) // 2 for p, length in zip(prompt_lengths, completion_lengths))


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """The parameters a token's matmuls use: all but the input embedding (a lookup), with the output head counted
    whether or not it is tied to that embedding (it is a matmul a token either way)."""
    embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and embedding is not None and head.weight is embedding
    return sum(p.numel() for p in model.parameters() if p is not embedding) + (embedding.numel() if tied else 0)


def measure(threads: list[int], sizes: list[int], mib: int, seconds: float) -> list[dict]:
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        by_size = {n: matmul_gflops(n, seconds) for n in sizes}
        rows.append({"threads": t, "matmul_gflops": by_size, "bandwidth_gbs": bandwidth_gbs(mib, seconds)})
    return rows


def table(rows: list[dict]) -> str:
    sizes = list(rows[0]["matmul_gflops"])
    head = " | ".join(f"matmul {n}, GFLOP/s" for n in sizes)
    lines = [
        f"| threads | {head} | attainable GFLOP/s | copy GB/s | read GB/s |",
        "| --- |" + " --- |" * (len(sizes) + 3),
    ]
    for r in rows:
        rates = r["matmul_gflops"]
        cells = " | ".join(f"{rates[n]:.1f}" for n in sizes)
        bw = r["bandwidth_gbs"]
        lines.append(f"| {r['threads']} | {cells} | {max(rates.values()):.1f} | {bw['copy']:.1f} | {bw['read']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and every core")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--mib", type=int, default=256, help="each tensor of the bandwidth test, MiB")
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    a = parser.parse_args(argv)
    if a.seconds <= 0 or a.mib <= 0 or any(n <= 0 for n in a.sizes) or any(t <= 0 for t in a.threads or [1]):
        raise SystemExit("error: --seconds, --mib, --sizes and --threads must be positive")
    threads = a.threads or sorted({1, torch.get_num_threads()})
    rows = measure(threads, a.sizes, a.mib, a.seconds)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    print(table(rows))
    if a.out is not None:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
