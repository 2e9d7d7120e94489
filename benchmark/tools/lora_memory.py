"""Peak memory, speed and final quality of LoRA against full fine-tuning, in one run on one preset.

    python -m benchmark.tools.lora_memory                                  # grpo_math.py tiny, CPU
    python -m benchmark.tools.lora_memory --full-size qwen2.5-0.5b-instruct --preset gsm8k-qwen2.5-0.5b \
        -- --dataset-name-or-path ../shared/real-assets/gsm8k --questions-per-device 2 --num-generations 4 \
           --max-completion-length 32 --micro-batch-size 8 --total-steps 2 --num-eval-examples 4 --pass-k 0

The script runs twice as subprocesses, one after the other, with the same flags: once as written (every weight
trained, AdamW's two moments for each) and once with `--lora-r R --lora-alpha A` (rank-R adapters trained, the base
frozen, the reference policy the base with its adapters disabled instead of a second copy), optionally at its own
learning rate (`--lora-learning-rate`; "LoRA Without Regret", Schulman et al. 2025: about 10x full fine-tuning's).
Each run's `perf/peak_mem_gb` (the largest value logged: torch.cuda.max_memory_allocated on a GPU; on a CPU the peak
resident memory of the process, which includes the Python and torch runtime, so on tiny models the ratio is close to
1; glibc is told to map every block over 64 KiB on its own, so that a freed tensor leaves the resident set), its last
`perf/episodes_per_sec` and its last evaluation are read from metrics.jsonl.

`--full-size NAME` first builds a random-weight model of the real architecture at its published size (Qwen2.5-0.5B:
24 layers, hidden 896, 494M parameters) with the real tokenizer (`--assets`, default ../shared/real-assets), so the
memory ratio is measured where the weights and optimizer state dominate, as on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmark.curves import read_run
from benchmark.tools.real_check import QWEN2, QWEN_MODELS, default_assets

REPO = Path(__file__).resolve().parents[2]
FULL_SIZES = {  # the published config.json sizes (Qwen/Qwen2.5-0.5B-Instruct)
    "qwen2.5-0.5b-instruct": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
    }
}
TOKENIZERS = {"qwen2.5-0.5b-instruct": "qwen2.5-instruct"}  # folder under the real assets' tokenizers/


def build_full_size(name: str, out: Path, assets: Path) -> Path:
    """A random-weight model of `name` at its real size, with the real tokenizer, saved once under `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    values = {**QWEN2, **QWEN_MODELS[name], **FULL_SIZES[name]}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(assets / "tokenizers" / TOKENIZERS[name]).save_pretrained(out)
    return out


def measure(run_dir: Path) -> dict:
    rows = read_run(run_dir).rows
    train = [r for r in rows if "perf/peak_mem_gb" in r]
    if not train:
        raise SystemExit(f"error: {run_dir}/metrics.jsonl has no perf/peak_mem_gb row")
    quality = next((k for k in ("eval/accuracy", "eval/gold_reward", "eval/score") if any(k in r for r in rows)), None)
    return {
        "peak_mem_gb": max(r["perf/peak_mem_gb"] for r in train),
        "episodes_per_sec": train[-1].get("perf/episodes_per_sec"),
        "quality_metric": quality,
        "quality": [r[quality] for r in rows if quality in r][-1] if quality else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="grpo_math.py")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    parser.add_argument("--lora-learning-rate", type=float, help="the LoRA run's --learning-rate (default: the same)")
    parser.add_argument("--full-size", choices=sorted(FULL_SIZES), help="build and train this model at its real size")
    parser.add_argument("--assets", type=Path, default=default_assets(), help="real assets (tokenizers)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--output-dir", default="runs")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed to both runs after `--`")
    cli = parser.parse_args()
    extra = [a for a in cli.extra if a != "--"]
    if cli.full_size:
        if cli.assets is None:
            raise SystemExit(
                "error: --full-size needs the real tokenizers: pass --assets or set CLEAN_RLHF_REAL_ASSETS"
            )
        model = build_full_size(cli.full_size, Path(cli.output_dir) / "models" / f"{cli.full_size}-full", cli.assets)
        extra = ["--model-name-or-path", str(model), *extra]
    # glibc keeps freed blocks, so a process's peak resident memory on CPU counts memory freed long before; with every
    # block over 64 KiB mapped on its own, freeing a tensor returns it and the peak follows the live tensors
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = {}
    for mode in ("full", "lora"):
        name = f"lora_bench_{Path(cli.script).stem}_{cli.preset}_{mode}"
        flags = []
        if mode == "lora":
            flags = ["--lora-r", str(cli.lora_r), "--lora-alpha", str(cli.lora_alpha)]
            if cli.lora_learning_rate:
                flags += ["--learning-rate", str(cli.lora_learning_rate)]
        cmd = [
            sys.executable,
            str(REPO / cli.script),
            cli.preset,
            "--run-name",
            name,
            "--overwrite",
            "--seed",
            str(cli.seed),
            "--output-dir",
            cli.output_dir,
            "--num-threads",
            str(cli.num_threads),
            *extra,
            *flags,
        ]
        print("[run]", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        results[mode] = measure(Path(cli.output_dir) / name)
    full, lora = results["full"], results["lora"]

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    print(f"\n| run | peak memory (GB) | episodes/s | {full['quality_metric'] or 'quality'} |")
    print("| --- | --- | --- | --- |")
    for mode, r in results.items():
        print(f"| {mode} | {r['peak_mem_gb']:.3f} | {fmt(r['episodes_per_sec'])} | {fmt(r['quality'])} |")
    ratio = lora["peak_mem_gb"] / full["peak_mem_gb"]
    print(f"LoRA / full fine-tuning peak memory: {ratio:.3f}")
    out = Path(cli.output_dir) / f"lora_bench_{Path(cli.script).stem}_{cli.preset}.json"
    out.write_text(
        json.dumps({"results": results, "lora_over_full_peak_mem": ratio, "argv": sys.argv[1:]}, indent=2) + "\n"
    )
    print(f"written {out}")


if __name__ == "__main__":
    main()
