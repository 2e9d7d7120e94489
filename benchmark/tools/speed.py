"""Speed and peak memory of clean-rlhf's scripts side by side with Hugging Face TRL, on the same work.

    python -m benchmark.tools.speed --algos rm ppo grpo rloo dpo --steps 8      # table + runs/speed/speed.md
    python -m benchmark.tools.speed --algos ppo --steps 4 --batch-size 32       # one algorithm, smaller work
    python -m benchmark.tools.speed --algos ppo --steps 8 --repeats 3            # median of 3 alternating rounds
    python -m benchmark.tools.speed --side trl --algo rm --steps 8 --out r.json  # one TRL side alone (the driver's)

Pairs (ours / TRL):
  rm    reward_model.py (Bradley-Terry)    / trl.RewardTrainer
  ppo   ppo_rlhf.py                         / trl.experimental.ppo.PPOTrainer of trl 1.12 (the last release with PPO;
                                              `pip install --no-deps --target DIR trl==1.12.0`, then --trl-ppo-path DIR)
  grpo  grpo_math.py                        / trl.GRPOTrainer
  rloo  rloo.py (verifiable math reward)    / trl.RLOOTrainer
  dpo   dpo.py (offline)                    / trl.DPOTrainer

Both sides get the same tiny model, data, batch size, minibatches, sequence / generation lengths, number of
optimisation steps, sampling temperature and KL coefficient. Each side is its own subprocess, started one after the
other from this driver (so peak memory is per side), with one CPU thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)).
What is measured:
  * training seconds: the training loop only, model loading and evaluation excluded on both sides. Ours: from the
    script's own `perf/episodes_per_sec` rows in metrics.jsonl (cumulative rate since the loop started for ppo, rloo
    and dpo: seconds = episode / rate of the last row; per-log-window rate for rm and grpo: seconds = the sum of
    episodes-in-window / rate). TRL: wall-clock of `trainer.train()` (its own `train_runtime` is printed alongside).
  * episodes/s: completions (online algorithms) or preference pairs (rm, dpo) trained on per second.
  * tokens/s: episodes/s x tokens per episode of this work, counted once from the data with the tokenizer (pairs:
    chosen + rejected tokens; online: prompt tokens + the generation budget), the same number for both sides, so
    the tokens/s ratio equals the episodes/s ratio; it is there to compare with other reports in tokens.
  * peak memory: peak resident set size of the whole subprocess (os.wait4's ru_maxrss; CPU), which includes the
    Python, torch and library runtime (TRL imports more of it) and model loading.
Ratios are ours / TRL: speed ratio > 1 means we are faster, memory ratio < 1 means we use less.
This machine's speed drifts by 10-20% over minutes, so one pair of runs gives a noisy ratio; `--repeats N` runs N
rounds (ours, then TRL, alternating) and reports the median of the N per-round ratios (each from two runs minutes
apart, so a slow stretch of the machine mostly cancels), median episodes/s, and the largest peak memory of each side.
Online algorithms sample with the SFT models, so generations stop at EOS: the number of generated tokens is a
random variable with the same distribution on both sides (not the same draw); run several steps to average it.
Differences in what each side does per step that the harness cannot remove are listed in NOTES and in speed.md.
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

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "runs" / "assets"
SCRIPTS = {"rm": "reward_model.py", "ppo": "ppo_rlhf.py", "grpo": "grpo_math.py", "rloo": "rloo.py", "dpo": "dpo.py"}
TRL_NAMES = {
    "rm": "RewardTrainer",
    "ppo": "PPOTrainer (trl 1.12)",
    "grpo": "GRPOTrainer",
    "rloo": "RLOOTrainer",
    "dpo": "DPOTrainer",
}
# how our script reports perf/episodes_per_sec: "cumulative" since the loop started, or per log "window"
RATE_KIND = {"rm": "window", "ppo": "cumulative", "grpo": "window", "rloo": "cumulative", "dpo": "cumulative"}
NOTES = {
    "rm": "same forward (chosen and rejected rows in one batch) and loss; TRL appends EOS to the text and tokenizes "
    "prompt+response as one string",
    "ppo": "ours keeps the sampler's logprobs (float32; TRL takes them from generate's scores) and runs every forward "
    "pass on one packed row without padding (packed_sdpa attention), the last layer's MLP only where a head reads; TRL "
    "pads. TRL's gradient accumulation spans the minibatches "
    "of an epoch (optimizer steps once per epoch here), ours steps per minibatch (N+)",
    "grpo": "TRL: per_device_train_batch_size = one minibatch, steps_per_generation = minibatches per generation "
    "round. Ours takes the old policy's logprobs from its sampling loop (float32: equal to a forward pass to 1e-5, "
    "tested); TRL recomputes them",
    "rloo": "one optimizer step per batch on both sides; ours keeps the sampler's logprobs (float32), TRL needs none "
    "(on-policy)",
    "dpo": "reference logprobs computed per step on both sides (ours: --no-precompute-ref-logprobs)",
}
TINY_TLDR_SFT = ("runs/sft_tiny-tldr__1/model", "runs/old/sft_tiny-tldr__1/model")
TINY_TLDR_RM = ("runs/rm_tiny-tldr__1/model", "runs/old/rm_tiny-tldr__1/model")
TINY_MATH_SFT = ("runs/sft_tiny-math__1/model",)


def first_existing(paths: tuple[str, ...]) -> str | None:
    for p in paths:
        if (REPO / p / "config.json").exists():
            return p
    return None


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------
# The work: one description per algorithm, turned into our CLI flags and into TRL's config
# ----------------------------------------------------------------------------------------------------


def work(algo: str, a: argparse.Namespace) -> dict:
    """Everything both sides must agree on. `batch`: episodes (completions or pairs) per step; a step is one batch
    (one generation round for online algorithms)."""
    w = {"algo": algo, "steps": a.steps, "seed": a.seed}
    if algo in ("rm", "dpo"):
        w.update(
            model=a.model or first_existing(TINY_TLDR_SFT),
            data="runs/assets/tiny-tldr/preference",
            batch=a.batch_size or 32,
            lr=1e-4,
            max_prompt_length=96,
            max_response_length=48,
            max_length=160,
            beta=0.1,
        )
    elif algo == "ppo":
        w.update(
            model=a.model or first_existing(TINY_TLDR_SFT),
            reward_model=a.reward_model or first_existing(TINY_TLDR_RM),
            data="runs/assets/tiny-tldr/sft",
            batch=a.batch_size or 64,
            mini_batches=2,
            ppo_epochs=4,
            response_length=a.response_length or 32,
            temperature=0.7,
            kl_coef=0.05,
            lr=3e-5,
            max_prompt_length=96,
        )
    elif algo in ("grpo", "rloo"):
        w.update(
            model=a.model or first_existing(TINY_MATH_SFT),
            data="runs/assets/tiny-math/gsm8k",
            response_length=a.response_length or 80,
            temperature=1.0,
            lr=3e-5,
            max_prompt_length=96,
            prompt_template="Question: {question}\nAnswer:\n",
        )
        if algo == "grpo":
            w.update(batch=a.batch_size or 128, generations=8, mini_batches=2, kl_coef=0.04)
        else:
            w.update(batch=a.batch_size or 64, generations=4, mini_batches=1, kl_coef=0.01)
    return w


def ours_command(w: dict, run_name: str) -> list[str]:
    """Our script on its tiny preset, with the flags that make it do exactly `w`; evaluation shrunk to 8 prompts and
    only outside the timed loop, no model saved."""
    py, n = sys.executable, w["batch"] * w["steps"]
    common = ["--run-name", run_name, "--overwrite", "--seed", str(w["seed"]), "--num-threads", "1", "--no-save-model"]
    if w["algo"] == "rm":
        return [
            py,
            "reward_model.py",
            "tiny-tldr",
            *common,
            "--sft-model-path",
            w["model"],
            "--max-train-samples",
            str(n),
            "--per-device-train-batch-size",
            str(w["batch"]),
            "--learning-rate",
            str(w["lr"]),
            "--max-length",
            str(w["max_length"]),
            "--no-normalize",
            "--eval-every",
            "1000000",
            "--num-eval-examples",
            "8",
            "--log-every",
            "1",
        ]
    if w["algo"] == "dpo":
        return [
            py,
            "dpo.py",
            "tiny-tldr",
            *common,
            "--sft-model-path",
            w["model"],
            "--max-train-samples",
            str(n),
            "--per-device-train-batch-size",
            str(w["batch"]),
            "--learning-rate",
            str(w["lr"]),
            "--beta",
            str(w["beta"]),
            "--max-prompt-length",
            str(w["max_prompt_length"]),
            "--max-response-length",
            str(w["max_response_length"]),
            "--no-precompute-ref-logprobs",
            "--eval-task",
            "none",
            "--eval-every",
            "1000000",
            "--num-eval-examples",
            "8",
            "--log-every",
            "1",
        ]
    if w["algo"] == "ppo":
        return [
            py,
            "ppo_rlhf.py",
            "tiny-tldr",
            *common,
            "--sft-model-path",
            w["model"],
            "--reward-model-path",
            w["reward_model"],
            "--total-episodes",
            str(n),
            "--per-device-batch-size",
            str(w["batch"]),
            "--num-mini-batches",
            str(w["mini_batches"]),
            "--num-ppo-epochs",
            str(w["ppo_epochs"]),
            "--response-length",
            str(w["response_length"]),
            "--temperature",
            str(w["temperature"]),
            "--kl-coef",
            str(w["kl_coef"]),
            "--learning-rate",
            str(w["lr"]),
            "--eval-every",
            "1000000",
            "--num-eval-examples",
            "8",
        ]
    if w["algo"] == "grpo":
        return [
            py,
            "grpo_math.py",
            "tiny",
            *common,
            "--model-name-or-path",
            w["model"],
            "--total-steps",
            str(w["steps"]),
            "--questions-per-device",
            str(w["batch"] // w["generations"]),
            "--num-generations",
            str(w["generations"]),
            "--num-mini-batches",
            str(w["mini_batches"]),
            "--micro-batch-size",
            str(w["batch"] // w["mini_batches"]),
            "--max-completion-length",
            str(w["response_length"]),
            "--temperature",
            str(w["temperature"]),
            "--beta",
            str(w["kl_coef"]),
            "--learning-rate",
            str(w["lr"]),
            "--loss-type",
            "grpo",
            "--eval-every",
            "1000000",
            "--num-eval-examples",
            "8",
            "--pass-k",
            "0",
        ]
    if w["algo"] == "rloo":
        return [
            py,
            "rloo.py",
            "tiny-math",
            *common,
            "--sft-model-path",
            w["model"],
            "--total-episodes",
            str(n),
            "--per-device-batch-size",
            str(w["batch"]),
            "--rloo-k",
            str(w["generations"]),
            "--response-length",
            str(w["response_length"]),
            "--temperature",
            str(w["temperature"]),
            "--kl-coef",
            str(w["kl_coef"]),
            "--learning-rate",
            str(w["lr"]),
            "--eval-every",
            "1000000",
            "--num-eval-examples",
            "8",
        ]
    raise ValueError(w["algo"])


def train_seconds(rows: list[dict], kind: str) -> tuple[float, int]:
    """(training seconds, episodes) from our metrics rows that carry perf/episodes_per_sec. `cumulative`: the rate is
    episodes since the loop started / seconds since then, so seconds = episode / rate of the last row. `window`: each
    row's rate covers the episodes since the previous row, so seconds = sum of (episodes in window / rate)."""
    train = [r for r in rows if "perf/episodes_per_sec" in r]
    if not train:
        raise ValueError("no metrics row with perf/episodes_per_sec")
    if kind == "cumulative":
        return train[-1]["episode"] / train[-1]["perf/episodes_per_sec"], train[-1]["episode"]
    seconds, previous = 0.0, 0
    for r in train:
        seconds += (r["episode"] - previous) / r["perf/episodes_per_sec"]
        previous = r["episode"]
    return seconds, previous


def ratios(ours: dict, trl: dict) -> dict:
    """ours / TRL: speed > 1 means ours is faster, memory < 1 means ours uses less."""
    return {
        "speed_ratio": ours["episodes_per_sec"] / trl["episodes_per_sec"],
        "mem_ratio": ours["peak_rss_gb"] / trl["peak_rss_gb"],
    }


def combine(rounds: list[dict]) -> dict:
    """One result from `--repeats` rounds of `measure`: the median of the per-round speed ratios (each round's two runs
    are adjacent in time), median episodes/s and tokens/s per side, the largest peak RSS per side."""
    done = [r for r in rounds if "skipped" not in r]
    if len(done) < len(rounds) or len(rounds) == 1:
        return next((r for r in rounds if "skipped" in r), rounds[0])

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    out = {
        **done[0],
        "rounds": [
            {k: r[k] for k in ("speed_ratio", "mem_ratio")}
            | {"ours_s": r["ours"]["train_s"], "trl_s": r["trl"]["train_s"]}
            for r in done
        ],
    }
    for side in ("ours", "trl"):
        out[side] = {
            **done[0][side],
            **{k: median([r[side][k] for r in done]) for k in ("episodes_per_sec", "tokens_per_sec", "train_s")},
            "peak_rss_gb": max(r[side]["peak_rss_gb"] for r in done),
        }
    out["speed_ratio"] = median([r["speed_ratio"] for r in done])
    out["mem_ratio"] = out["ours"]["peak_rss_gb"] / out["trl"]["peak_rss_gb"]
    return out


def verdict(r: dict, target: float = 1.5) -> str:
    if r["speed_ratio"] < 1.0:
        return "FAIL (slower)"
    mem = "" if r["mem_ratio"] <= 1.0 else ", more memory"
    return ("ok" if r["speed_ratio"] >= target else f"faster, below {target}x") + mem


# ----------------------------------------------------------------------------------------------------
# Running a side as a subprocess; peak RSS from the kernel's accounting of that child
# ----------------------------------------------------------------------------------------------------


def run_child(cmd: list[str], log: Path, env: dict, timeout: float) -> tuple[int, float, float]:
    """(exit code, peak RSS in GiB, wall seconds) of `cmd`, output to `log`."""
    start = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.time() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 2**20, time.time() - start  # Linux: KiB


def child_env(extra_pythonpath: str | None = None) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        DISABLE_MLFLOW_INTEGRATION="TRUE",
        # glibc keeps its heap pages (no mapping below 64 MiB, no trimming), on both sides alike: packed batches of
        # varying length otherwise fault every freed page back in (docs/speed.md)
        MALLOC_MMAP_THRESHOLD_=str(64 * 2**20),
        MALLOC_TRIM_THRESHOLD_=str(2**31 - 1),
    )
    paths = [p for p in (extra_pythonpath, str(REPO), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def measure(algo: str, a: argparse.Namespace, out_dir: Path) -> dict:
    w = work(algo, a)
    result = {"algo": algo, "work": w}
    script = REPO / SCRIPTS[algo]
    if not script.exists():
        result["skipped"] = f"{SCRIPTS[algo]} does not exist yet"
        return result
    missing = [k for k in ("model", "reward_model") if k in w and not w[k]]
    if missing:
        result["skipped"] = f"no tiny model for {missing} (run `python -m benchmark.run tiny-tldr` / `tiny-math` first)"
        return result
    # ---- ours ----
    run_name = f"scratch_speed_{algo}"
    cmd = ours_command(w, run_name)
    gen_dir = os.environ.get("CLEAN_RLHF_GEN_TIMES")  # benchmark.tools.gpu_check: split each side's loop (gen_timer.py)
    if gen_dir:
        cmd = [cmd[0], "-m", "benchmark.tools.gen_timer", f"{gen_dir}/{algo}_ours.json", *cmd[1:]]
    phase_dir = os.environ.get("CLEAN_RLHF_PHASES")  # benchmark.tools.phases: each side's loop split into phases
    if phase_dir:
        Path(phase_dir).mkdir(parents=True, exist_ok=True)
        cmd = [cmd[0], "-m", "benchmark.tools.phases", f"{phase_dir}/{algo}_ours.json", *cmd[1:]]
    rc, rss, wall = run_child(cmd, out_dir / f"{algo}_ours.log", child_env(), a.timeout)
    if rc != 0:
        result["skipped"] = f"our script failed (exit {rc}); see {out_dir / f'{algo}_ours.log'}"
        return result
    rows = read_jsonl(REPO / "runs" / run_name / "metrics.jsonl")
    seconds, episodes = train_seconds(rows, RATE_KIND[algo])
    lengths = [r["objective/completion_length"] for r in rows if "objective/completion_length" in r]
    result["ours"] = {
        "completion_length": sum(lengths) / len(lengths) if lengths else None,  # sampled tokens an episode, mean
        "train_s": seconds,
        "episodes": episodes,
        "episodes_per_sec": episodes / seconds,
        "peak_rss_gb": rss,
        "wall_s": wall,
        "command": " ".join(cmd[1:]),
    }
    # ---- TRL ----
    trl_json = out_dir / f"{algo}_trl.json"
    trl_json.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "benchmark.tools.speed",
        "--side",
        "trl",
        "--algo",
        algo,
        "--out",
        str(trl_json),
        *[
            x
            for k, v in vars(a).items()
            if k in ("steps", "batch_size", "response_length", "model", "reward_model", "seed") and v is not None
            for x in (f"--{k.replace('_', '-')}", str(v))
        ],
    ]
    rc, rss, wall = run_child(
        cmd, out_dir / f"{algo}_trl.log", child_env(a.trl_ppo_path if algo == "ppo" else None), a.timeout
    )
    if rc != 0 or not trl_json.exists():
        result["skipped"] = f"TRL side failed (exit {rc}); see {out_dir / f'{algo}_trl.log'}"
        return result
    t = json.loads(trl_json.read_text())
    result["trl"] = {**t, "episodes_per_sec": t["episodes"] / t["train_s"], "peak_rss_gb": rss, "wall_s": wall}
    if gen_dir:  # generation seconds of the training loop's sampling calls (more than the 8 evaluation prompts)
        from benchmark.tools.gen_timer import generation_seconds

        for side in ("ours", "trl"):
            path = Path(gen_dir) / f"{algo}_{side}.json"
            if path.exists():
                result[side]["generation_s"], result[side]["generation_calls"] = generation_seconds(path, 8)
    for side in ("ours", "trl"):
        result[side]["tokens_per_sec"] = result[side]["episodes_per_sec"] * t["tokens_per_episode"]
    result.update(ratios(result["ours"], result["trl"]))
    return result


def table(results: list[dict]) -> str:
    head = (
        "| algo | TRL peer | steps x batch | ours ep/s | TRL ep/s | **speed ratio** | ours tok/s | TRL tok/s | ours "
        "peak RSS GiB | "
        "TRL peak RSS GiB | mem ratio | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in results:
        w = r["work"]
        if "skipped" in r:
            lines.append(
                f"| {r['algo']} | {TRL_NAMES[r['algo']]} | {w['steps']} x {w.get('batch')} | | | skipped: "
                f"{r['skipped']} | | | | | | |"
            )
            continue
        o, t = r["ours"], r["trl"]
        lines.append(
            f"| {r['algo']} | {TRL_NAMES[r['algo']]} | {w['steps']} x {w['batch']} | {o['episodes_per_sec']:.1f} | "
            f"{t['episodes_per_sec']:.1f} | "
            f"**{r['speed_ratio']:.2f}** | {o['tokens_per_sec']:.0f} | {t['tokens_per_sec']:.0f} | "
            f"{o['peak_rss_gb']:.2f} | "
            f"{t['peak_rss_gb']:.2f} | {r['mem_ratio']:.2f} | {verdict(r)} |"
        )
    return "\n".join(lines)


def model_shape(path: str, reward: bool) -> dict:
    """A model's matmul parameters (limits.non_embedding_parameters) and its KV cache's bytes a token (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from benchmark.tools import limits

    cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    model = cls.from_pretrained(REPO / path, local_files_only=True, **({"num_labels": 1} if reward else {}))
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_width = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    element = torch.finfo(torch.float32).bits // 8
    return {
        "n": limits.non_embedding_parameters(model),
        "kv_bytes": 2 * c.num_hidden_layers * kv_width * head_dim * element,
    }


def limit_rows(results: list[dict], machine: dict, gen_dir: str | None) -> list[dict]:
    """Each measured algorithm's training step against this CPU's limits (`machine`: the one-thread row of
    `benchmark.tools.limits --out`, as both sides run one thread): the model FLOPs of an episode
    (limits.episode_flops) x episodes per second, each side, as a share of the attainable matmul rate; and, with
    CLEAN_RLHF_GEN_TIMES, our sampling's bytes read per second (limits.decode_bytes) as a share of the bandwidth."""
    from benchmark.tools import limits
    from benchmark.tools.gen_timer import generation_calls

    peak, bandwidth = max(machine["matmul_gflops"].values()), max(machine["bandwidth_gbs"].values())
    rows = []
    for r in results:
        if "skipped" in r:
            continue
        w, o, t = r["work"], r["ours"], r["trl"]
        policy = model_shape(w["model"], reward=r["algo"] == "rm")
        n_value = model_shape(w["reward_model"], reward=True)["n"] if "reward_model" in w else 0
        online = "response_length" in w
        if online and o.get("completion_length") is None:
            continue  # a fork that logs no objective/completion_length: its tokens an episode are unknown
        completion = o["completion_length"] if online else 0.0
        tokens = t["tokens_per_episode"] - w.get("response_length", 0) + completion
        flops = limits.episode_flops(r["algo"], tokens, completion, policy["n"], n_value, w.get("ppo_epochs", 0))
        row = {"algo": r["algo"], "n": policy["n"], "n_value": n_value, "tokens": tokens, "gflop": flops / 1e9}
        for side in ("ours", "trl"):
            row[f"{side}_gflops"] = flops * r[side]["episodes_per_sec"] / 1e9
            row[f"{side}_share"] = row[f"{side}_gflops"] / peak
        path = Path(gen_dir) / f"{r['algo']}_ours.json" if gen_dir else None
        calls = generation_calls(path, 8) if path is not None and path.exists() else []
        if calls and all("steps" in c for c in calls):
            weights = policy["n"] * 4  # float32, every matmul weight once a decoding step
            moved = sum(limits.decode_bytes(c["steps"], c["contexts"], weights, policy["kv_bytes"]) for c in calls)
            row["sampling_gbs"] = moved / sum(c["seconds"] for c in calls) / 1e9
            row["sampling_share"] = row["sampling_gbs"] / bandwidth
        elif online and path is not None:  # asked for, and none to read: say so, not a bare "-"
            row["sampling_missing"] = (
                f"no sampling calls with steps in {path.name}" if path.exists() else f"no {path.name} (none written)"
            )
        rows.append(row)
    return rows


def limit_table(rows: list[dict], machine: dict) -> str:
    peak, bandwidth = max(machine["matmul_gflops"].values()), max(machine["bandwidth_gbs"].values())
    lines = [
        "| algorithm | matmul parameters (policy / value) | tokens an episode | GFLOP an episode | "
        f"ours GFLOP/s, share of {peak:.1f} | TRL GFLOP/s, share | our sampling GB/s, share of {bandwidth:.1f} |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        sampling = f"{r['sampling_gbs']:.2f}, {r['sampling_share']:.0%}" if "sampling_gbs" in r else "-"
        sampling = r.get("sampling_missing", sampling)
        lines.append(
            f"| {r['algo']} | {r['n']:,} / {r['n_value']:,} | {r['tokens']:.0f} | {r['gflop']:.3f} | "
            f"{r['ours_gflops']:.1f}, {r['ours_share']:.0%} | {r['trl_gflops']:.1f}, {r['trl_share']:.0%} | "
            f"{sampling} |"
        )
    return "\n".join(lines)


def driver(a: argparse.Namespace) -> None:
    out_dir = REPO / "runs" / "speed"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for algo in a.algos:
        rounds = []
        for i in range(a.repeats):
            print(
                f"== {algo}: ours ({SCRIPTS[algo]}) then TRL ({TRL_NAMES[algo]}), {a.steps} steps"
                + (f", round {i + 1}/{a.repeats}" if a.repeats > 1 else ""),
                flush=True,
            )
            r = measure(algo, a, out_dir)
            rounds.append(r)
            if "skipped" in r:
                print(f"   skipped: {r['skipped']}", flush=True)
                break
            print(
                f"   ours {r['ours']['train_s']:.1f}s for {r['ours']['episodes']} episodes, TRL "
                f"{r['trl']['train_s']:.1f}s "
                f"(train_runtime {r['trl'].get('train_runtime', float('nan')):.1f}s) for {r['trl']['episodes']}: "
                f"speed ratio {r['speed_ratio']:.2f}, memory ratio {r['mem_ratio']:.2f}",
                flush=True,
            )
        r = combine(rounds)
        if "rounds" in r:
            print(
                f"   {algo}: median speed ratio {r['speed_ratio']:.2f} over rounds "
                + ", ".join(f"{x['speed_ratio']:.2f}" for x in r["rounds"]),
                flush=True,
            )
        results.append(r)
    md = table(results)
    print(md)
    command = "python -m benchmark.tools.speed " + " ".join(sys.argv[1:])
    notes = "\n".join(f"- {k}: {v}" for k, v in NOTES.items() if k in a.algos)
    details = "\n".join(f"- {r['algo']} ours: `{r['ours']['command']}`" for r in results if "ours" in r)
    repeats = ""
    for r in results:
        if "rounds" in r:
            per_round = ", ".join(f"{x['speed_ratio']:.2f}" for x in r["rounds"])
            repeats += (
                f"- {r['algo']}: speed ratio and ep/s are medians of {len(r['rounds'])} alternating rounds (per-round "
                "speed ratios "
                f"{per_round}); peak RSS the largest of them\n"
            )
    (out_dir / "speed.md").write_text(
        f"# Speed and peak memory vs TRL (CPU, 1 thread)\n\n`{command}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{md}\n\n"
        "Ratios are ours / TRL (speed > 1: ours faster; memory < 1: ours smaller). Target speed ratio >= 1.5; below "
        "1.0 fails.\n"
        f"Training seconds exclude model loading and evaluation on both sides; peak RSS is of the whole process.\n\n"
        + (f"Repeated rounds:\n{repeats}\n" if repeats else "")
        + f"Differences the harness cannot remove:\n{notes}\n\nOur commands:\n{details}\n"
    )
    (out_dir / "speed.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out_dir / 'speed.md'}")
    if a.limits is not None:  # each stage against the CPU's limits (issue 70 item 2)
        machine = next((m for m in json.loads(a.limits.read_text()) if m["threads"] == 1), None)
        if machine is None:
            raise SystemExit(
                f"error: --limits {a.limits} has no one-thread row (run benchmark.tools.limits --threads 1)"
            )
        md = limit_table(limit_rows(results, machine, os.environ.get("CLEAN_RLHF_GEN_TIMES")), machine)
        (out_dir / "limits.md").write_text(f"`{command}`\n\n{md}\n")
        print(md)
    phase_dir = os.environ.get("CLEAN_RLHF_PHASES")
    if phase_dir:  # the last round's phases of each algorithm (each side's file is rewritten by every round)
        from benchmark.tools import phases

        rows = {
            r["algo"]: {s: json.loads((Path(phase_dir) / f"{r['algo']}_{s}.json").read_text()) for s in ("ours", "trl")}
            for r in results
            if all((Path(phase_dir) / f"{r['algo']}_{s}.json").exists() for s in ("ours", "trl"))
        }
        md = phases.table(rows, {r["algo"]: r["work"]["steps"] for r in results})
        (Path(phase_dir) / "phases.md").write_text(f"`CLEAN_RLHF_PHASES={phase_dir} {command}`\n\n{md}\n")
        print(md)


# ----------------------------------------------------------------------------------------------------
# The TRL side (runs in its own subprocess): build the trainer on the same work, time trainer.train()
# ----------------------------------------------------------------------------------------------------


def trl_side(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if os.environ.get("CLEAN_RLHF_GEN_TIMES"):
        from benchmark.tools.gen_timer import install_trl

        install_trl(f"{os.environ['CLEAN_RLHF_GEN_TIMES']}/{a.algo}_trl.json")
    if os.environ.get("CLEAN_RLHF_PHASES"):
        from benchmark.tools import phases

        phases.install_trl(f"{os.environ['CLEAN_RLHF_PHASES']}/{a.algo}_trl.json", a.algo)
    w = work(a.algo, a)
    t = {"rm": trl_rm, "dpo": trl_dpo, "ppo": trl_ppo, "grpo": trl_grpo, "rloo": trl_rloo}[a.algo](w)
    Path(a.out).write_text(json.dumps(t) + "\n")


def timed_train(trainer) -> dict:
    start = time.time()
    out = trainer.train()
    seconds = time.time() - start
    return {
        "train_s": seconds,
        "train_runtime": (out.metrics.get("train_runtime") if out is not None else None) or seconds,
    }


def _tokenizer(path: str, padding_side: str = "right"):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / path, local_files_only=True)
    tok.padding_side = padding_side
    return tok


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _common_trainer_args(w: dict, tmp: str) -> dict:
    return dict(
        output_dir=tmp,
        learning_rate=w["lr"],
        seed=w["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not _cuda(),  # a GPU when there is one (tools.gpu_check), as our scripts do through accelerate
        disable_tqdm=True,
        dataloader_drop_last=True,
        bf16=False,
        fp16=False,
        # TRL 1.16's configs default to activation checkpointing (recompute activations in the backward: less memory,
        # about a third more compute); our scripts keep activations, so TRL does the same here, float32 as ours
        gradient_checkpointing=False,
    )


def trl_rm(w: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    tok = _tokenizer(w["model"])
    n = w["batch"] * w["steps"]
    rows = read_jsonl(REPO / w["data"] / "train.jsonl")[:n]
    ds = Dataset.from_list([{"prompt": r["query"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in rows])
    model = AutoModelForSequenceClassification.from_pretrained(REPO / w["model"], num_labels=1, local_files_only=True)
    model.config.pad_token_id = tok.pad_token_id
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RewardConfig(
            **_common_trainer_args(w, tmp),
            per_device_train_batch_size=w["batch"],
            max_steps=w["steps"],
            max_length=w["max_length"],
            lr_scheduler_type="cosine",
            adam_epsilon=1e-5,
            max_grad_norm=1.0,
        )
        trainer = RewardTrainer(model=model, args=cfg, processing_class=tok, train_dataset=ds)
        out = timed_train(trainer)
    tokens = sum(
        len(tok(r["query"] + r["chosen"])["input_ids"]) + len(tok(r["query"] + r["rejected"])["input_ids"]) + 2
        for r in rows
    )
    return {**out, "episodes": n, "tokens_per_episode": tokens / n}


def trl_dpo(w: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    tok = _tokenizer(w["model"])
    n = w["batch"] * w["steps"]
    rows = read_jsonl(REPO / w["data"] / "train.jsonl")[:n]
    ds = Dataset.from_list([{"prompt": r["query"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(REPO / w["model"], local_files_only=True)
    ref = AutoModelForCausalLM.from_pretrained(REPO / w["model"], local_files_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = DPOConfig(
            **_common_trainer_args(w, tmp),
            per_device_train_batch_size=w["batch"],
            max_steps=w["steps"],
            beta=w["beta"],
            max_length=w["max_prompt_length"] + w["max_response_length"],
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            adam_epsilon=1e-5,
            max_grad_norm=1.0,
            precompute_ref_log_probs=False,
        )
        trainer = DPOTrainer(model=model, ref_model=ref, args=cfg, processing_class=tok, train_dataset=ds)
        out = timed_train(trainer)
    tokens = sum(
        len(tok(r["query"] + r["chosen"])["input_ids"]) + len(tok(r["query"] + r["rejected"])["input_ids"]) + 2
        for r in rows
    )
    return {**out, "episodes": n, "tokens_per_episode": tokens / n}


def trl_ppo(w: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError as e:
        raise SystemExit(
            f"error: this trl has no trl.experimental.ppo ({e}); install trl 1.12 with "
            "`pip install --no-deps --target DIR trl==1.12.0` and pass --trl-ppo-path DIR"
        ) from None
    import trl

    print(f"trl {trl.__version__} from {trl.__file__}", flush=True)
    tok = _tokenizer(w["model"], padding_side="left")
    n = w["batch"] * w["steps"]
    rows = read_jsonl(REPO / w["data"] / "train.jsonl")
    ids = [tok(r["query"], add_special_tokens=False)["input_ids"] for r in rows]
    ds = Dataset.from_dict({"input_ids": [x for x in ids if len(x) <= w["max_prompt_length"]]})
    policy = AutoModelForCausalLM.from_pretrained(REPO / w["model"], local_files_only=True)
    ref = AutoModelForCausalLM.from_pretrained(REPO / w["model"], local_files_only=True)
    reward = AutoModelForSequenceClassification.from_pretrained(
        REPO / w["reward_model"], num_labels=1, local_files_only=True
    )
    value = AutoModelForSequenceClassification.from_pretrained(
        REPO / w["reward_model"], num_labels=1, local_files_only=True
    )
    for m in (policy, ref):
        m.generation_config.pad_token_id = tok.pad_token_id
    with tempfile.TemporaryDirectory() as tmp:
        # TRL's per_device_train_batch_size is the micro-batch and local batch = micro x gradient_accumulation_steps;
        # this makes its rollout batch `batch` and its minibatches `batch / mini_batches`, as ours.
        cfg = PPOConfig(
            **_common_trainer_args(w, tmp),
            per_device_train_batch_size=w["batch"] // w["mini_batches"],
            gradient_accumulation_steps=w["mini_batches"],
            num_mini_batches=w["mini_batches"],
            total_episodes=n,
            local_rollout_forward_batch_size=w["batch"],
            num_ppo_epochs=w["ppo_epochs"],
            response_length=w["response_length"],
            temperature=w["temperature"],
            kl_coef=w["kl_coef"],
            stop_token="eos",
            missing_eos_penalty=1.0,
            num_sample_generations=0,
            sft_model_path=w["model"],
            reward_model_path=w["reward_model"],
        )
        trainer = PPOTrainer(
            args=cfg,
            processing_class=tok,
            model=policy,
            ref_model=ref,
            reward_model=reward,
            value_model=value,
            train_dataset=ds,
            eval_dataset=ds.select(range(8)),
        )
        out = timed_train(trainer)
    return {**out, "episodes": n, "tokens_per_episode": sum(len(x) for x in ids) / len(ids) + w["response_length"]}


def _math_rows(w: dict):
    from datasets import Dataset

    rows = read_jsonl(REPO / w["data"] / "train.jsonl")
    return Dataset.from_list([{"prompt": w["prompt_template"].format(**r), "answer": r["answer"]} for r in rows])


def _math_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the completion's final `#### x` equals the reference's, as our scripts' verifiable reward."""
    from benchmark.tiny_world import extract_gsm8k_answer, numbers_equal

    return [
        1.0 if numbers_equal(extract_gsm8k_answer(c), extract_gsm8k_answer(a)) else 0.0
        for c, a in zip(completions, answer)
    ]


def trl_grpo(w: dict) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tok = _tokenizer(w["model"], padding_side="left")
    ds = _math_rows(w)
    model = AutoModelForCausalLM.from_pretrained(REPO / w["model"], local_files_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        # one generation round of `batch` completions, then `mini_batches` optimizer steps of batch / mini_batches
        cfg = GRPOConfig(
            **_common_trainer_args(w, tmp),
            per_device_train_batch_size=w["batch"] // w["mini_batches"],
            steps_per_generation=w["mini_batches"],
            gradient_accumulation_steps=1,
            num_generations=w["generations"],
            max_completion_length=w["response_length"],
            temperature=w["temperature"],
            top_k=0,
            top_p=1.0,
            beta=w["kl_coef"],
            loss_type="grpo",
            num_iterations=1,
            max_steps=w["steps"] * w["mini_batches"],
            lr_scheduler_type="constant",
            log_completions=False,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=_math_reward, args=cfg, train_dataset=ds, processing_class=tok)
        out = timed_train(trainer)
    prompt_tokens = sum(len(tok(p)["input_ids"]) for p in ds["prompt"]) / len(ds)
    return {**out, "episodes": w["batch"] * w["steps"], "tokens_per_episode": prompt_tokens + w["response_length"]}


def trl_rloo(w: dict) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import RLOOConfig, RLOOTrainer

    tok = _tokenizer(w["model"], padding_side="left")
    ds = _math_rows(w)
    model = AutoModelForCausalLM.from_pretrained(REPO / w["model"], local_files_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RLOOConfig(
            **_common_trainer_args(w, tmp),
            per_device_train_batch_size=w["batch"],
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            num_generations=w["generations"],
            max_completion_length=w["response_length"],
            temperature=w["temperature"],
            top_k=0,
            top_p=1.0,
            beta=w["kl_coef"],
            num_iterations=1,
            max_steps=w["steps"],
            lr_scheduler_type="linear",
            adam_epsilon=1e-5,
            max_grad_norm=1.0,
            log_completions=False,
        )
        trainer = RLOOTrainer(model=model, reward_funcs=_math_reward, args=cfg, train_dataset=ds, processing_class=tok)
        out = timed_train(trainer)
    prompt_tokens = sum(len(tok(p)["input_ids"]) for p in ds["prompt"]) / len(ds)
    return {**out, "episodes": w["batch"] * w["steps"], "tokens_per_episode": prompt_tokens + w["response_length"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--algos", nargs="+", default=["rm", "ppo", "grpo", "rloo", "dpo"], choices=list(SCRIPTS))
    p.add_argument("--steps", type=int, default=8, help="optimisation batches (online: generation rounds) per side")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="episodes per batch (default per algorithm: rm/dpo 32 pairs, ppo/rloo 64, grpo 128)",
    )
    p.add_argument(
        "--response-length",
        type=int,
        default=None,
        help="generation budget of online algorithms (default: ppo 32, grpo/rloo 80)",
    )
    p.add_argument(
        "--model", default=None, help="policy / reward-model starting point (default: the tiny SFT model of the task)"
    )
    p.add_argument(
        "--reward-model", default=None, help="(ppo) reward and value model (default: the tiny-tldr reward model)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--repeats", type=int, default=1, help="rounds per algorithm (ours then TRL each); the table reports medians"
    )
    p.add_argument(
        "--trl-ppo-path",
        default=os.environ.get("TRL_PPO_PATH", "/work/trl112"),
        help="folder holding trl 1.12 (`pip install --no-deps --target DIR trl==1.12.0`), put first on PYTHONPATH "
        "for the TRL PPO side",
    )
    p.add_argument(
        "--limits",
        type=Path,
        default=None,
        help="JSON of `benchmark.tools.limits --out`: also each step's model FLOP/s (and, with CLEAN_RLHF_GEN_TIMES, "
        "our sampling's bytes/s) as a share of this CPU's one-thread limits (runs/speed/limits.md)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a side is killed")
    p.add_argument("--side", choices=["driver", "trl"], default="driver", help=argparse.SUPPRESS)
    p.add_argument("--algo", choices=list(SCRIPTS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    trl_side(args) if args.side == "trl" else driver(args)
