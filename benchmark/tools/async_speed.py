"""Asynchronous against synchronous training: `python -m benchmark.tools.async_speed [--script dpo.py|grpo_math.py]
[--preset tiny-tldr-online|tiny] [--seeds 1 2]`.

Runs `SCRIPT PRESET` (online DPO, or GRPO) twice per seed as subprocesses, once synchronous and once with `--async`
(generation of the next batch overlapped with training on this one, one step off-policy; Noukhovitch et al. 2024,
arXiv:2410.18252), with the same flags and thread budget, then reads each run's metrics.jsonl and prints:
  * seconds per episode of the training loop (from the step-0 evaluation row to the last training row, so
    model loading and the final evaluation are left out; the intermediate evaluations are the same in both),
  * the ratio async / sync (below 1 means async is faster),
  * the final eval/gold_reward and eval/win_rate (tiny-tldr), eval/score or eval/accuracy (GRPO), and the mean
    async/policy_lag.
On a CPU, the two threads of an async run share the process's cores (`--num-threads`): the speed-up can only
come from overlapping Python overhead and idle time, not from extra hardware, and the GIL limits it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmark.curves import read_run

REPO = Path(__file__).resolve().parents[2]


def summarise(run_dir: Path) -> dict:
    rows = read_run(run_dir).rows
    start = next(r["time"] for r in rows if r["step"] == 0)
    train = [r for r in rows if "train/loss" in r or "loss/policy" in r]  # DPO's, GRPO's
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    last_eval = evals[-1] if evals else {}
    episodes = train[-1]["episode"]
    return {
        "episodes": episodes,
        "sec_per_episode": (train[-1]["time"] - start) / episodes,
        "gold_reward_start": evals[0].get("eval/gold_reward") if evals else None,
        "gold_reward": last_eval.get("eval/gold_reward"),
        "win_rate": last_eval.get("eval/win_rate"),
        "score": last_eval.get("eval/score", last_eval.get("eval/accuracy")),
        "policy_lag": sum(r.get("async/policy_lag", 0) for r in train) / len(train),
        "generation_wait_sec": sum(r.get("perf/generation_wait_sec", 0) for r in train) / len(train),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="dpo.py", choices=["dpo.py", "grpo_math.py"])
    parser.add_argument("--preset", default="tiny-tldr-online", help="the script's preset (grpo_math.py: tiny)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads of each run (async splits them)")
    parser.add_argument("--output-dir", default="runs")
    parser.add_argument("--prefix", help="run names: PREFIX_{sync,async}__SEED (default async_bench_<script>)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed to the script after `--`")
    cli = parser.parse_args()
    extra = [a for a in cli.extra if a != "--"]
    cli.prefix = cli.prefix or f"async_bench_{Path(cli.script).stem}"
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    results = []
    for seed in cli.seeds:
        for mode in ("sync", "async"):
            name = f"{cli.prefix}_{mode}__{seed}"
            cmd = [
                sys.executable,
                str(REPO / cli.script),
                cli.preset,
                "--run-name",
                name,
                "--overwrite",
                "--seed",
                str(seed),
                "--output-dir",
                cli.output_dir,
                "--num-threads",
                str(cli.num_threads),
                "--async" if mode == "async" else "--no-async",
                *extra,
            ]
            print("[run]", " ".join(cmd), flush=True)
            t0 = time.time()
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            results.append(
                {"mode": mode, "seed": seed, "wall_sec": time.time() - t0, **summarise(Path(cli.output_dir) / name)}
            )

    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    print(
        "\n| mode | seed | sec/episode | wall s | lag | gen wait s/step | gold reward start -> end | win rate | RM "
        "score / accuracy |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['mode']} | {r['seed']} | {r['sec_per_episode']:.4f} | {r['wall_sec']:.0f} | {r['policy_lag']:.2f} | "
            f"{r['generation_wait_sec']:.3f} | {fmt(r['gold_reward_start'])} -> {fmt(r['gold_reward'])} | "
            f"{fmt(r['win_rate'])} | {fmt(r['score'])} |"
        )
    summary = {}
    for seed in cli.seeds:
        sync, asyn = (next(r for r in results if r["seed"] == seed and r["mode"] == m) for m in ("sync", "async"))
        summary[seed] = asyn["sec_per_episode"] / sync["sec_per_episode"]
        print(
            f"seed {seed}: async / sync wall-clock per episode = {summary[seed]:.3f} "
            f"(speed-up {1 / summary[seed]:.2f}x); final gold reward sync {fmt(sync['gold_reward'])}, async "
            f"{fmt(asyn['gold_reward'])}; "
            f"score / accuracy sync {fmt(sync['score'])}, async {fmt(asyn['score'])}"
        )
    out = Path(cli.output_dir) / f"{cli.prefix}_summary.json"
    out.write_text(json.dumps({"results": results, "async_over_sync_sec_per_episode": summary}, indent=2) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
