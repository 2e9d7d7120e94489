"""Peak memory and speed of ReMax and RLOO relative to PPO, in one run on one preset.

    python -m benchmark.tools.memory_speed_family                       # tiny-tldr, CPU
    python -m benchmark.tools.memory_speed_family --preset tiny-math --episodes 1024
    python -m benchmark.tools.memory_speed_family --preset tldr-pythia-1b --episodes 4096 -- --per-device-batch-size 16

ppo_rlhf.py, rloo.py and remax.py are run one after the other as subprocesses, on the same preset, for the same
number of sampled responses (`--total-episodes`; the greedy baselines of ReMax are extra work it pays for and are not
counted), with evaluation shrunk to a few prompts and run only before the first and after the last update (outside
the timed loop). Each script's own metrics are read from its `metrics.jsonl`:
  * `perf/episodes_per_sec` of the last training row: sampled responses per second of training, all processes;
  * `perf/peak_mem_gb`, the largest value logged: peak accelerator memory (CUDA: torch.cuda.max_memory_allocated),
    or the peak resident memory of the process on CPU (which includes the Python and torch runtime, so on tiny models
    the ratios on CPU are close to 1 whatever the algorithm).
The table gives each script's numbers and its ratios to PPO: memory ratio < 1 means less memory than PPO, speed
ratio > 1 means faster. The ReMax paper (Li et al. 2023, arXiv:2310.10505) reports about 0.54x PPO's GPU memory and
1.6x its speed at 7B. Arguments after `--` go to all three scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark.curves import read_run

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {"ppo": "ppo_rlhf.py", "rloo": "rloo.py", "remax": "remax.py"}


def measure(run_dir: Path) -> dict:
    """Training throughput and peak memory of one finished run, from its metrics.jsonl."""
    rows = read_run(run_dir).rows
    train = [r for r in rows if "perf/episodes_per_sec" in r]
    if not train:
        raise SystemExit(f"error: {run_dir}/metrics.jsonl has no perf/episodes_per_sec row")
    return {
        "episodes": train[-1]["episode"],
        "episodes_per_sec": train[-1]["perf/episodes_per_sec"],
        "peak_mem_gb": max(r["perf/peak_mem_gb"] for r in train),
        "wall_s": rows[-1]["time"],
    }


def ratios(results: dict) -> dict:
    """Each algorithm's peak memory and speed divided by PPO's."""
    ppo = results["ppo"]
    return {
        name: {
            "mem_ratio": r["peak_mem_gb"] / ppo["peak_mem_gb"],
            "speed_ratio": r["episodes_per_sec"] / ppo["episodes_per_sec"],
        }
        for name, r in results.items()
    }


def table(preset: str, results: dict) -> str:
    rel = ratios(results)
    lines = [
        f"# memory and speed on {preset}",
        "",
        "| script | episodes | episodes/s | peak memory (GB) | memory / PPO | speed / PPO |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {SCRIPTS[name]} | {r['episodes']} | {r['episodes_per_sec']:.2f} | {r['peak_mem_gb']:.3f} | "
            f"{rel[name]['mem_ratio']:.3f} | {rel[name]['speed_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-tldr", help="preset name shared by ppo_rlhf.py, rloo.py and remax.py")
    parser.add_argument("--episodes", type=int, default=512, help="sampled responses per script (--total-episodes)")
    parser.add_argument(
        "--num-eval-examples", type=int, default=8, help="evaluation prompts (before and after training only)"
    )
    parser.add_argument("--num-threads", type=int, default=None, help="CPU threads per script")
    parser.add_argument("--output-dir", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results and ratios to this JSON file")
    args = parser.parse_args(argv)

    out = Path(args.output_dir or tempfile.mkdtemp(prefix="memory_speed_"))
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    results = {}
    for name, script in SCRIPTS.items():
        run_name = f"memspeed_{name}_{args.preset}"
        cmd = [
            sys.executable,
            str(REPO / script),
            args.preset,
            "--run-name",
            run_name,
            "--overwrite",
            "--output-dir",
            str(out),
            "--total-episodes",
            str(args.episodes),
            "--eval-every",
            str(10**9),
            "--num-eval-examples",
            str(args.num_eval_examples),
            "--no-save-model",
            *(["--num-threads", str(args.num_threads)] if args.num_threads else []),
            *extra,
        ]
        print("[run]", " ".join(cmd), flush=True)
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(
                f"error: {script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            )
        results[name] = measure(out / run_name)
        print(f"      {time.time() - t0:.0f}s: {results[name]}", flush=True)
    text = table(args.preset, results)
    print(text)
    report = {"preset": args.preset, "episodes": args.episodes, "results": results, "ratios": ratios(results)}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
