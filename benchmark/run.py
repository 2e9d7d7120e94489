"""Run a reproduction suite end to end: `python -m benchmark.run SUITE [--seeds 1 2 3] [--dry-run]`.

Suites:
  quick          the README's main job: SFT and RM, then PPO, RLOO, ReMax, DPO, online DPO (tiny-tldr) and GRPO
                 (tiny-math) at their `--quick` budgets, and a quick KL frontier on tiny-tldr-noisy that ranks them
                 (PPO without a KL penalty, RLOO, offline DPO; CPU, offline; the tiny world is built on first use)
  learning       `quick` plus GRPO on tiny-math's KL frontier, at `--quick` budgets: the schedule of
                 tests/test_learning.py
  tiny           tiny-tldr and tiny-math at the presets' full budgets
  tiny-tldr      SFT -> reward model -> PPO, RLOO, ReMax, DPO, online DPO on tiny-tldr
  tiny-math      SFT -> process reward model -> GRPO and its variants on tiny-math
  frontier-tldr  the KL frontier on tiny-tldr-noisy: each algorithm at several KL penalties (docs/frontier.md)
  frontier-math  the KL frontier on tiny-math
  frontier       both frontiers
  tldr           the N+ reproduction on TL;DR with Pythia (GPUs, the hub)
  math           GSM8K with Qwen2.5-0.5B-Instruct and MATH with Qwen2.5-Math-1.5B (GPUs, the hub)
  study          `--scripts A.py B.py`: each script (a fork of a library script, or one of them) on the tracks that
                 can separate variants of its family, then their ranking with 95% intervals and the figure
                 (benchmark/study.py)

Each stage is one command of an algorithm script, run as a subprocess with its own run directory under
`runs/`. A stage that fails is reported and the suite goes on with the stages that do not depend on it.
When the suite is rerun, a stage is
  skipped   when the script's `runs/<run_name>/done.json` (written at the end of a run that completed its budget)
            holds the same command arguments (a `--quick` run does not count as done for the full suite) and the
            path and sha256 of the very file that would run now (an edited fork, or another file of the same name,
            runs again), and the models it read are the ones there now (the sha256 of each needed run's done.json,
            recorded in `runs/_suite/<run_name>.stage.json` when it was launched);
  resumed   (`--resume`) when the run stopped part way (a checkpoint, no done.json) and was started by the same
            command, as recorded in that stage record, and by the same file (its provenance.json);
  rerun     (`--overwrite`) otherwise when its directory exists: another command, another script, no checkpoint, or
            a stage it needs was (re)run, now or by another invocation since. The line before it says why.
`--num-threads`, `--resume` and `--overwrite` do not count as a different command. SIGTERM or SIGINT to the suite
(a hangup as SIGTERM) is passed on to the running stages, each in a session of its own; the suite starts no other,
waits for them to checkpoint and exit (`[stopped] <run_name>`), and exits with the signal's code: the same command
resumes them. `--dry-run` prints what would
be run, with these decisions. At the end a summary table of each run's final metrics is printed and written to
`runs/<suite>_summary.md`, and the paths of what was written are printed.

One suite runs in a runs directory at a time (a lock, `runs/._suite.lock`): a second one is refused in one line
naming the first one's process, before it launches or logs anything (it would relaunch the first one's stages into
the same logs). While it runs, each stage's output (tqdm bars included) goes to `runs/_suite/<run_name>.log`, and the
suite shows
its status (benchmark/status.py): each stage waiting; running, with its time so far, progress, rate and time left
from the last tqdm update in its log (`ppo_tiny-tldr__1  running  1m02s  12/32 updates  0.90 it/s  22s left`, or
`starting` before the first); done, with its time and final headline metric (`eval/gold_reward`, `eval/accuracy`);
skipped; blocked by a failed stage it needs; or failed, with its log's path. Above them, the elapsed time and an
estimate of what is left: tqdm's remaining time of the running stages and, for the waiting ones, the durations of
finished stages of the same algorithm or script, spread over the `--jobs` slots (`unknown` until there is one).
On a terminal that status is a block redrawn in place about once a second, below the event lines. Otherwise (CI,
`nohup`, a pipe; or with `--plain`) the output is one line per event, without ANSI codes: `[run] <command>` when a
stage starts, `[ok] <run_name> in <s>s: <headline metric>`, `[FAILED] <run_name> (exit <code>); last lines of <log>:`
(then those lines, indented), `[skip] <run_name>: <why>` (finished earlier, or blocked: `depends on failed [...]`),
`[resume]` / `[rerun] <run_name>: <why>` before its `[run]`; a `[progress]` line (elapsed, estimate, each running
stage's progress) every minute; and `[end]` when the last stage ends.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmark.assets import ensure_assets
from benchmark.compare import provenance_differences, read_run
from benchmark.status import BLOCKED, DONE, FAILED, RUNNING, SKIPPED, Display, StageStatus, headline, log_tail
from clean_rlhf_utils import ownership, storage

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Stage:
    run_name: str
    script: str
    preset: str
    extra: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)
    """run names whose models this stage reads"""
    accelerate_config: str | None = None
    """real suites: launched with `accelerate launch --config_file benchmark/accelerate_configs/<this>.yaml`"""
    quick: list[str] = field(default_factory=list)
    """flags appended with `--quick`: a shorter run that still shows the learning (the tests use it)"""

    def args(self, quick: bool = False) -> list[str]:
        """The command's arguments after the script path: what the script records as `argv` in its done.json."""
        return [self.preset, "--run-name", self.run_name, *self.extra, *(self.quick if quick else [])]

    def file(self, workdir: Path = Path(".")) -> Path:
        """The script file this stage runs: `accelerate launch` takes it from the working directory, `python` by its
        path in this checkout (an absolute path, a fork's, is itself)."""
        return Path(workdir) / self.script if self.accelerate_config else REPO / self.script

    def command(self, launcher: list[str], quick: bool = False) -> list[str]:
        if self.accelerate_config:
            launcher = [
                "accelerate",
                "launch",
                "--config_file",
                f"benchmark/accelerate_configs/{self.accelerate_config}.yaml",
            ]
            return [*launcher, self.script, *self.args(quick)]
        return [*launcher, str(REPO / self.script), *self.args(quick)]


# `--quick` budgets (the learning tests): about half to 60% of each preset's episodes, where every algorithm is past
# its test margin (docs/tests.md has the measurements).
QUICK = {  # evaluations about every eighth of a run: a learning curve of about 10 points
    "ppo_tiny-tldr": ["--total-episodes", "512", "--eval-every", "1"],
    "rloo_tiny-tldr": ["--total-episodes", "1024", "--eval-every", "2"],
    "remax_tiny-tldr": ["--total-episodes", "1024", "--eval-every", "2"],
    "dpo_tiny-tldr": ["--max-train-samples", "2560", "--eval-every", "8"],  # 80 steps of 32 pairs
    "online-dpo_tiny-tldr": ["--total-episodes", "1280", "--eval-every", "8"],  # and its 40 training rows
    "grpo_tiny-math": ["--total-steps", "20", "--pass-k", "0", "--eval-every", "2"],  # past +0.2 by step 10 of 40
}


# `--quick` SFT (the learning tests' starting policies): fewer epochs, each schedule run to its end; the SFT bounds of
# tests/test_learning.py hold there and RL keeps room (docs/tests.md).
SFT_QUICK = {"tiny-tldr": ["--num-train-epochs", "3"], "tiny-math": ["--num-train-epochs", "4"]}


# A seed is the whole pipeline (issue 57): seed s's RL runs start from seed s's SFT policy and reward model, each
# trained with `--seed s`, so an interval over seeds covers the variation of the start as well as of RL (one shared
# start made the intervals too narrow: a second CPU's SFT started at 0.225 where ours started at 0.165). The presets'
# model paths are seed 1's, so seed 1's commands are the presets' as they were.


def seed_flag(seed: int) -> list[str]:
    """`--seed S` for an SFT or reward-model stage; none for seed 1, the scripts' default (its command as before)."""
    return [] if seed == 1 else ["--seed", str(seed)]


def starts(family: str, seed: int, sft: str, rm: str | None = None) -> list[str]:
    """The flags that point an RL stage of `seed` at that seed's SFT policy (`sft`: the run name before `__`, e.g.
    `sft_tiny-tldr`) and reward model (`rm`); none for seed 1, whose paths are the presets'. `family`: the library
    script the stage's script is (or was forked from): grpo_math.py names its policy `--model-name-or-path`."""
    if seed == 1:
        return []
    policy = "--model-name-or-path" if family == "grpo_math" else "--sft-model-path"
    return [policy, f"runs/{sft}__{seed}/model", *(["--reward-model-path", f"runs/{rm}__{seed}/model"] if rm else [])]


def sft_stage(track: str, seed: int = 1) -> Stage:
    return Stage(f"sft_{track}__{seed}", "sft.py", track, seed_flag(seed), quick=SFT_QUICK[track])


def rm_stage(name: str, preset: str, sft: str, seed: int, quick: list[str] = ()) -> Stage:
    """The reward model `name` (`rm_tiny-tldr`) of `seed`, trained from that seed's SFT policy (`sft_tiny-tldr`)."""
    return Stage(
        f"{name}__{seed}",
        "reward_model.py",
        preset,
        ["--sft-model-path", f"runs/{sft}__{seed}/model", *seed_flag(seed)],
        needs=[f"{sft}__{seed}"],
        quick=list(quick),
    )


def rl_stage(
    algo: str, script: str, preset: str, seed: int, track: str, needs: list[str], extra: list[str] = ()
) -> Stage:
    """An RL stage of `seed`; `needs`: the model stages it starts from, as run names before `__` (`sft_tiny-tldr`), the
    first its policy and the one starting with `rm_` its reward model: seed `seed`'s of each."""
    rm = next((n for n in needs if n.startswith("rm_")), None)
    return Stage(
        f"{algo}_{track}__{seed}",
        script,
        preset,
        ["--seed", str(seed), *extra, *starts(Path(script).stem, seed, needs[0], rm)],
        needs=[n if "__" in n else f"{n}__{seed}" for n in needs],
        quick=QUICK.get(f"{algo}_{track}", []),
    )


def tiny_tldr_stages(seeds: list[int]) -> list[Stage]:
    stages = []
    rl = ["sft_tiny-tldr", "rm_tiny-tldr"]
    for s in seeds:
        stages += [
            sft_stage("tiny-tldr", s),
            rm_stage("rm_tiny-tldr", "tiny-tldr", "sft_tiny-tldr", s, quick=["--max-train-samples", "2048"]),
            rl_stage("ppo", "ppo_rlhf.py", "tiny-tldr", s, "tiny-tldr", rl),
            rl_stage("rloo", "rloo.py", "tiny-tldr", s, "tiny-tldr", rl),
            rl_stage("remax", "remax.py", "tiny-tldr", s, "tiny-tldr", rl),
            rl_stage("dpo", "dpo.py", "tiny-tldr", s, "tiny-tldr", rl[:1]),
            rl_stage("online-dpo", "dpo.py", "tiny-tldr-online", s, "tiny-tldr", rl),
        ]
    return stages


# CISPO's defaults add MiniMax-M1's dynamic sampling and length penalty; these flags sample as GRPO does, for the rows
# that compare CISPO's loss with GRPO's
GRPO_SAMPLING = ["--dynamic-sampling", "False", "--overlong-buffer", "0"]


def tiny_math_stages(seeds: list[int]) -> list[Stage]:
    stages = []
    for s in seeds:
        sft, prm = ["sft_tiny-math"], ["sft_tiny-math", f"prm_tiny-math__{s}"]
        prm_flags = ["--prm-path", f"runs/prm_tiny-math__{s}/model"]
        stages += [
            sft_stage("tiny-math", s),
            rm_stage("prm_tiny-math", "tiny-math-prm", "sft_tiny-math", s),
            rl_stage("grpo", "grpo_math.py", "tiny", s, "tiny-math", sft, ["--loss-type", "grpo"]),
            rl_stage("dr-grpo", "grpo_math.py", "tiny", s, "tiny-math", sft, ["--loss-type", "dr_grpo"]),
            rl_stage("dapo", "grpo_math.py", "tiny", s, "tiny-math", sft, ["--loss-type", "dapo"]),
            rl_stage("gspo", "grpo_math.py", "tiny", s, "tiny-math", sft, ["--importance-sampling-level", "sequence"]),
            rl_stage("cispo", "grpo_math.py", "tiny", s, "tiny-math", sft, ["--loss-type", "cispo"]),
            # ScaleRL's CISPO aggregation (Khatri et al. 2025): the loss averaged per prompt, not per token of the batch
            rl_stage(
                "cispo-prompt",
                "grpo_math.py",
                "tiny",
                s,
                "tiny-math",
                sft,
                ["--loss-type", "cispo", "--loss-aggregation", "prompt", *GRPO_SAMPLING],
            ),
            # the grpo row with CISPO's surrogate: GRPO's KL term (MiniMax-M1 has none) and sampling
            rl_stage(
                "cispo-kl",
                "grpo_math.py",
                "tiny",
                s,
                "tiny-math",
                sft,
                ["--loss-type", "cispo", "--beta", "0.04", *GRPO_SAMPLING],
            ),
            rl_stage("async-grpo", "grpo_math.py", "tiny", s, "tiny-math", sft, ["--async"]),
            # LoRA at 10x the full fine-tuning learning rate ("LoRA Without Regret", Schulman et al. 2025)
            rl_stage(
                "lora-grpo",
                "grpo_math.py",
                "tiny",
                s,
                "tiny-math",
                sft,
                ["--lora-r", "16", "--lora-alpha", "32", "--learning-rate", "5e-4"],
            ),
            rl_stage(
                "reinforce-pp-baseline",
                "grpo_math.py",
                "tiny",
                s,
                "tiny-math",
                sft,
                ["--advantage-estimator", "reinforce_pp_baseline"],
            ),
            # on-policy distillation: the SFT policy learns from the GRPO policy of the same seed, on its own samples
            rl_stage(
                "distill",
                "grpo_math.py",
                "tiny",
                s,
                "tiny-math",
                [*sft, f"grpo_tiny-math__{s}"],
                ["--advantage-estimator", "distill", "--teacher-model-path", f"runs/grpo_tiny-math__{s}/model"],
            ),
            rl_stage("ppo", "ppo_rlhf.py", "tiny-math", s, "tiny-math", sft),
            rl_stage("rloo", "rloo.py", "tiny-math", s, "tiny-math", sft),
            rl_stage("remax", "remax.py", "tiny-math", s, "tiny-math", sft),
            # Gao et al. 2024 in miniature: the raw process reward is hacked, Clip + Delta are not
            rl_stage(
                "ppo-prm-raw", "ppo_rlhf.py", "tiny-math", s, "tiny-math", prm, [*prm_flags, "--prm-refine", "none"]
            ),
            rl_stage(
                "ppo-prm-clip-delta",
                "ppo_rlhf.py",
                "tiny-math",
                s,
                "tiny-math",
                prm,
                [*prm_flags, "--prm-refine", "clip_delta"],
            ),
        ]
    return stages


# The KL frontier (issue 22): each algorithm at a few KL penalties (`kl_coef`, DPO's `beta`), 3 seeds, against a proxy
# reward model trained on 1,000 noisy, length-biased labels (tiny-tldr-noisy). `benchmark.results` plots the gold reward
# against `eval/kl` (the same estimator in every script) and tabulates it at fixed KL budgets.
# A strong and a weak penalty per algorithm; PPO also a middle one, where over-optimisation sets in, and none (Gao et
# al. 2022, arXiv:2210.10760: a KL penalty acts like early stopping, it does not improve gold reward against KL).
FRONTIER_TLDR = {  # algorithm: (script, preset, penalty flag, values)
    "ppo": ("ppo_rlhf.py", "tiny-tldr-noisy", "--kl-coef", ["0.05", "0.02", "0.005", "0"]),
    "rloo": ("rloo.py", "tiny-tldr-noisy", "--kl-coef", ["0.05", "0.005"]),
    "remax": ("remax.py", "tiny-tldr-noisy", "--kl-coef", ["0.05", "0.005"]),
    "dpo": ("dpo.py", "tiny-tldr-noisy", "--beta", ["0.5", "0.1"]),
    "online-dpo": ("dpo.py", "tiny-tldr-noisy-online", "--beta", ["0.5", "0.02"]),
}
# `--quick` (the CI version and the main job's frontier): shorter runs that still start at KL 0 and move the proxy
# score, evaluated on 100 prompts often enough to draw a curve; PPO keeps the preset's 1,536 episodes, over which it
# passes the gold optimum and over-optimises the reward model (docs/frontier.md)
FRONTIER_QUICK = {
    "ppo": ["--eval-every", "2", "--num-eval-examples", "100"],
    "rloo": ["--total-episodes", "512", "--eval-every", "1", "--num-eval-examples", "100"],
    "remax": ["--total-episodes", "512", "--eval-every", "1", "--num-eval-examples", "100"],
    "dpo": ["--num-train-epochs", "1", "--max-train-samples", "384", "--eval-every", "2"]
    + ["--num-eval-examples", "100", "--num-eval-pairs", "100"],
    "online-dpo": ["--total-episodes", "512", "--eval-every", "2", "--num-eval-examples", "100"],
}


def penalty_name(flag: str, value: str) -> str:
    """`--kl-coef 0.005` -> `kl0.005`, `--beta 0.1` -> `beta0.1`: the run name's suffix (benchmark.results reads it)."""
    return ("kl" if flag == "--kl-coef" else "beta") + value


NOISY_RM_QUICK = ["--num-train-epochs", "1"]  # of 2: already an imperfect proxy (the learning test's bounds)


def frontier_tldr_stages(seeds: list[int]) -> list[Stage]:
    stages = []
    for s in seeds:
        stages += [
            sft_stage("tiny-tldr", s),
            rm_stage("rm_tiny-tldr-noisy", "tiny-tldr-noisy", "sft_tiny-tldr", s, NOISY_RM_QUICK),
        ]
        for algo, (script, preset, flag, values) in FRONTIER_TLDR.items():
            for v in values:
                stages.append(
                    Stage(
                        f"{algo}-{penalty_name(flag, v)}_tiny-tldr-noisy__{s}",
                        script,
                        preset,
                        [
                            "--seed",
                            str(s),
                            flag,
                            v,
                            *starts(Path(script).stem, s, "sft_tiny-tldr", "rm_tiny-tldr-noisy"),
                        ],
                        needs=[f"sft_tiny-tldr__{s}", f"rm_tiny-tldr-noisy__{s}"],
                        quick=FRONTIER_QUICK[algo],
                    )
                )
    return stages


# The same frontier on tiny-math, for the verifiable reward: greedy accuracy against `eval/kl`. GRPO's variants sweep
# their `beta` (the KL loss term), PPO, RLOO and ReMax their `kl_coef` (the KL penalty in the reward), each at a strong
# penalty and none. Dr. GRPO and middle values are left out so that the whole sweep fits in about 2.5 hours on 2 cores
# (docs/frontier.md has the run times); one line here adds them back.
FRONTIER_MATH = {  # algorithm: (script, preset, penalty flag, values, other flags: variant, evaluations for the curve)
    "grpo": ("grpo_math.py", "tiny", "--beta", ["0.1", "0"], ["--loss-type", "grpo"]),
    "gspo": ("grpo_math.py", "tiny", "--beta", ["0.1", "0"], ["--importance-sampling-level", "sequence"]),
    "cispo": ("grpo_math.py", "tiny", "--beta", ["0.1", "0"], ["--loss-type", "cispo", *GRPO_SAMPLING]),
    "ppo": ("ppo_rlhf.py", "tiny-math", "--kl-coef", ["0.1", "0"], ["--eval-every", "4"]),
    "rloo": ("rloo.py", "tiny-math", "--kl-coef", ["0.1", "0"], ["--eval-every", "4"]),
    "remax": ("remax.py", "tiny-math", "--kl-coef", ["0.1", "0"], ["--eval-every", "8"]),
}
FRONTIER_MATH_EXTRA = {"grpo_math.py": ["--eval-every", "5", "--pass-k", "0"]}  # pass@k at the end is not plotted
FRONTIER_MATH_QUICK = {  # `--quick`: a quarter to a half of each budget, 100 evaluation problems
    "grpo_math.py": ["--total-steps", "10", "--num-eval-examples", "100"],
    "ppo_rlhf.py": ["--total-episodes", "512", "--num-eval-examples", "100"],
    "rloo.py": ["--total-episodes", "1024", "--num-eval-examples", "100"],
    "remax.py": ["--total-episodes", "512", "--num-eval-examples", "100"],
}


def frontier_math_stages(seeds: list[int]) -> list[Stage]:
    stages = []
    for s in seeds:
        stages.append(sft_stage("tiny-math", s))
        for algo, (script, preset, flag, values, flags) in FRONTIER_MATH.items():
            for v in values:
                stages.append(
                    Stage(
                        f"{algo}-{penalty_name(flag, v)}_tiny-math-kl__{s}",
                        script,
                        preset,
                        ["--seed", str(s), *flags, *FRONTIER_MATH_EXTRA.get(script, []), flag, v, "--eval-kl"]
                        + starts(Path(script).stem, s, "sft_tiny-math"),
                        needs=[f"sft_tiny-math__{s}"],
                        quick=FRONTIER_MATH_QUICK[script],
                    )
                )
    return stages


# The real reproductions, for a GPU cluster: 8 GPUs per run, the papers' hyperparameters in the scripts' presets.
# size: (accelerate config of SFT and RM, of the RL runs); as in the presets' descriptions
PYTHIA_SIZES = {
    "1b": ("multi_gpu", "deepspeed_zero2"),
    "2.8b": ("multi_gpu", "deepspeed_zero2"),
    "6.9b": ("deepspeed_zero2", "deepspeed_zero3"),
}


def tldr_stages(seeds: list[int]) -> list[Stage]:
    """N+ (Huang et al. 2024): SFT and RM per model size and seed, then each RL algorithm on that SFT/RM pair."""
    stages = []
    for size, (sup, zero) in PYTHIA_SIZES.items():
        for s in seeds:
            sft, rm = f"sft_tldr-pythia-{size}__{s}", f"rm_tldr-pythia-{size}__{s}"
            paths = ["--sft-model-path", f"runs/{sft}/model", "--reward-model-path", f"runs/{rm}/model"]
            stages += [
                Stage(sft, "sft.py", f"tldr-pythia-{size}", ["--seed", str(s)], accelerate_config=sup),
                Stage(
                    rm,
                    "reward_model.py",
                    f"tldr-pythia-{size}",
                    ["--seed", str(s), "--sft-model-path", f"runs/{sft}/model"],
                    needs=[sft],
                    accelerate_config=sup,
                ),
                Stage(
                    f"ppo_tldr-pythia-{size}__{s}",
                    "ppo_rlhf.py",
                    f"tldr-pythia-{size}",
                    ["--seed", str(s), *paths],
                    needs=[sft, rm],
                    accelerate_config=zero,
                ),
                Stage(
                    f"rloo_tldr-pythia-{size}__{s}",
                    "rloo.py",
                    f"tldr-pythia-{size}",
                    ["--seed", str(s), *paths],
                    needs=[sft, rm],
                    accelerate_config=zero,
                ),
                Stage(
                    f"remax_tldr-pythia-{size}__{s}",
                    "remax.py",
                    f"tldr-pythia-{size}",
                    ["--seed", str(s), *paths],
                    needs=[sft, rm],
                    accelerate_config=zero,
                ),
                Stage(
                    f"dpo_tldr-pythia-{size}__{s}",
                    "dpo.py",
                    f"tldr-pythia-{size}",
                    ["--seed", str(s), "--sft-model-path", f"runs/{sft}/model"],
                    needs=[sft],
                    accelerate_config=zero,
                ),
            ]
    return stages


def math_stages(seeds: list[int]) -> list[Stage]:
    """GSM8K with Qwen2.5-0.5B-Instruct (every algorithm) and MATH with Qwen2.5-Math-1.5B (Dr. GRPO, as in its
    paper)."""
    stages = []
    for s in seeds:
        seed = ["--seed", str(s)]
        stages += [
            Stage(
                f"grpo_gsm8k-qwen2.5-0.5b__{s}",
                "grpo_math.py",
                "gsm8k-qwen2.5-0.5b",
                [*seed, "--loss-type", "grpo"],
                accelerate_config="deepspeed_zero2",
            ),
            Stage(
                f"dr-grpo_gsm8k-qwen2.5-0.5b__{s}",
                "grpo_math.py",
                "gsm8k-qwen2.5-0.5b",
                [*seed, "--loss-type", "dr_grpo"],
                accelerate_config="deepspeed_zero2",
            ),
            Stage(
                f"dapo_gsm8k-qwen2.5-0.5b__{s}",
                "grpo_math.py",
                "gsm8k-qwen2.5-0.5b",
                [*seed, "--loss-type", "dapo"],
                accelerate_config="deepspeed_zero2",
            ),
            Stage(
                f"ppo_gsm8k-qwen2.5-0.5b__{s}",
                "ppo_rlhf.py",
                "gsm8k-qwen2.5-0.5b",
                seed,
                accelerate_config="deepspeed_zero2",
            ),
            Stage(
                f"rloo_gsm8k-qwen2.5-0.5b__{s}",
                "rloo.py",
                "gsm8k-qwen2.5-0.5b",
                seed,
                accelerate_config="deepspeed_zero2",
            ),
            Stage(
                f"remax_gsm8k-qwen2.5-0.5b__{s}",
                "remax.py",
                "gsm8k-qwen2.5-0.5b",
                seed,
                accelerate_config="deepspeed_zero2",
            ),
            Stage(
                f"dr-grpo_math-qwen2.5-math-1.5b__{s}",
                "grpo_math.py",
                "math-qwen2.5-math-1.5b",
                seed,
                accelerate_config="deepspeed_zero2",
            ),
        ]
    return stages


# The README's main job and the learning tests: every tiny-tldr algorithm and GRPO on tiny-math, at the `--quick`
# budgets (the README gives its time)
QUICK_STAGES = [
    "ppo_tiny-tldr",
    "rloo_tiny-tldr",
    "remax_tiny-tldr",
    "dpo_tiny-tldr",
    "online-dpo_tiny-tldr",
    "grpo_tiny-math",
]
# ... and the KL frontier's `--quick` runs that rank them (issue 43): on tiny-tldr every algorithm reaches the judge's
# ceiling, so the first figure a newcomer opens would separate nothing; against tiny-tldr-noisy's imperfect reward
# model, gold reward against KL does: RLOO and offline DPO gain gold reward at a KL where PPO has none yet, and PPO
# without a penalty passes the gold optimum and over-optimises the proxy (runs/frontier_tiny-tldr-noisy.png)
# (algorithm_track names: `ppo-kl0` alone would also take tiny-math's frontier run of that name)
MAIN_FRONTIER_STAGES = ["ppo-kl0_tiny-tldr-noisy", "rloo-kl0.005_tiny-tldr-noisy", "dpo-beta0.1_tiny-tldr-noisy"]
# The learning tests' schedule (tests/test_learning.py): the main job plus one run of tiny-math's frontier, in one queue
LEARNING_FRONTIER_STAGES = ["grpo-beta0_tiny-math-kl"]
LONG_FIRST = [
    "ppo-kl0_tiny-tldr-noisy"
]  # the main job's longest run starts as soon as its models exist: no lone run at the end


def models_then_long_runs_first(stages: list[Stage]) -> list[Stage]:
    """SFT and reward models first (what RL needs), then the long runs, then the rest in order."""
    return sorted(
        stages,
        key=lambda st: (
            st.script not in ("sft.py", "reward_model.py"),
            st.run_name.rsplit("__", 1)[0] not in LONG_FIRST,
        ),
    )


def unique(stages: list[Stage]) -> list[Stage]:
    """The stages of several suites, each once: a stage two suites share (their SFT) is the same command."""
    seen: dict[str, Stage] = {}
    for st in stages:
        assert seen.setdefault(st.run_name, st) == st, f"two different stages named {st.run_name}"
    return list(seen.values())


SUITES = {
    "quick": lambda seeds: models_then_long_runs_first(  # QUICK_STAGES, MAIN_FRONTIER_STAGES at --quick budgets
        unique(tiny_tldr_stages(seeds) + tiny_math_stages(seeds) + frontier_tldr_stages(seeds))
    ),
    "learning": lambda seeds: models_then_long_runs_first(  # `quick` and LEARNING_FRONTIER_STAGES
        unique(
            tiny_tldr_stages(seeds)
            + tiny_math_stages(seeds)
            + frontier_tldr_stages(seeds)
            + frontier_math_stages(seeds)
        )
    ),
    "tiny-tldr": tiny_tldr_stages,
    "tiny-math": tiny_math_stages,
    "tiny": lambda seeds: tiny_tldr_stages(seeds) + tiny_math_stages(seeds),
    "tldr": tldr_stages,
    "frontier-tldr": frontier_tldr_stages,
    "frontier-math": frontier_math_stages,
    "frontier": lambda seeds: frontier_tldr_stages(seeds) + frontier_math_stages(seeds),
    "math": math_stages,
}


# flags that change how a run is launched, not what it computes: left out when commands are compared
LAUNCH_FLAGS = {"--resume": 0, "--overwrite": 0, "--num-threads": 1}  # flag: number of values it takes


def same_run_args(argv: list[str]) -> list[str]:
    """`argv` without LAUNCH_FLAGS, for comparing the command of a finished or stopped run with a stage's."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in LAUNCH_FLAGS:
            i += 1 + (LAUNCH_FLAGS[flag] if "=" not in argv[i] else 0)
            continue
        out.append(argv[i])
        i += 1
    return out


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _difference(was: list[str], now: list[str]) -> str:
    """The arguments that differ, common start and end left out: `was '--total-episodes 512', now (none)`."""
    k = 0
    while k < min(len(was), len(now)) and was[k] == now[k]:
        k += 1
    j = 0
    while j < min(len(was), len(now)) - k and was[len(was) - 1 - j] == now[len(now) - 1 - j]:
        j += 1

    def show(a: list[str]) -> str:
        return repr(shlex.join(a[k : len(a) - j])) if a[k : len(a) - j] else "(none)"

    return f"was {show(was)}, now {show(now)}"


SUITE_DIR = "_suite"  # the suite's own files under runs/: each stage's record and log


def stage_record(runs_dir: Path, run_name: str) -> Path:
    """Where the suite records the arguments it launched a stage with: outside the run directory, which the script's
    `--overwrite` deletes and which a new run must find empty, and in `runs/_suite/` with the stages' logs, so that a
    glob of run directories (`runs/ppo_tiny-tldr__*`) takes run directories only."""
    return runs_dir / SUITE_DIR / f"{run_name}.stage.json"


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def script_change(recorded, script: Path) -> str | None:
    """Why a run whose record (done.json's or provenance.json's `script`: its path, relative to the checkout or
    absolute, and the sha256 of its bytes) says it was made by another file than `script` as it is now; None when it
    was made by this file with these bytes. The cache is keyed by the code, not only by the arguments: a fork edited
    after its first study, or another file of the same name, runs again."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("sha256"), str) or not recorded.get("path"):
        return "its record does not say which script made it (no path and sha256)"
    was = Path(str(recorded["path"]))
    if (was if was.is_absolute() else REPO / was).resolve() != script.resolve():
        return f"it was made by {recorded['path']}, and this stage runs {script}"
    now = _sha256(script)
    if now is None:
        return f"its script {script} cannot be read"
    if now != recorded["sha256"]:
        return f"{script.name} changed since it ran (sha256 {recorded['sha256'][:12]} then, {now[:12]} now)"
    return None


# Rounding regimes (issue 57): CPUs round differently (vector width, reduction order) and RL turns a last digit into
# another run, so a claim must hold on more than one. `--rounding default` runs every stage with torch's portable
# kernels (ATEN_CPU_CAPABILITY=default: no AVX2 / AVX-512 in ATen's own kernels; the BLAS is unchanged), a second host
# on one machine. Its runs go to WORKDIR/rounding-default/runs, never beside the native ones.
ROUNDING = {"native": {}, "default": {"ATEN_CPU_CAPABILITY": "default"}}
REGIME_ENV = ("ATEN_CPU_CAPABILITY",)


def regime_change(run_dir: Path) -> str | None:
    """Why a run was made under another rounding regime than the one stages get now (this process's environment, which
    they inherit); None when the same, or for a run that predates the record (provenance.json's `numerics_env`)."""
    started = ((_read_json(run_dir / "provenance.json") or {}).get("started") or {}).get("host") or {}
    recorded = started.get("numerics_env")
    if not isinstance(recorded, dict):
        return None
    for key in REGIME_ENV:
        if recorded.get(key) != os.environ.get(key):
            was, now = recorded.get(key) or "(unset)", os.environ.get(key) or "(unset)"
            return f"it ran with {key}={was} and the suite runs with {now}: another rounding regime"
    return None


def regime_workdir(workdir: Path, rounding: str) -> Path:
    """Where a suite of `rounding` runs: WORKDIR itself for the machine's own regime, WORKDIR/rounding-<name> else."""
    return Path(workdir) if rounding == "native" else Path(workdir) / f"rounding-{rounding}"


def needs_fingerprint(runs_dir: Path, needs: list[str]) -> dict[str, str | None]:
    """The sha256 of each needed run's done.json (its command, script hash and finishing time): the suite records it
    when it launches a stage, so a stage built on a model that was rebuilt later, by another invocation, runs again."""
    return {name: _sha256(runs_dir / name / "done.json") for name in needs}


def refuse_foreign(runs_dir: Path, run_name: str, action: str, why: str) -> tuple[str, str]:
    """`decide`'s answer, or ("refuse", why) for a rerun whose directory (deleted by `--overwrite`) is not recognisably
    a run of this library (`storage.not_a_run_problem`): the suite never deletes what is not a run."""
    if action == "rerun":
        problem = storage.not_a_run_problem(
            runs_dir / run_name, "rerunning it (--overwrite)", "move what is yours out of it"
        )
        if problem:
            return "refuse", problem.removeprefix("error: ")
    return action, why


def decide(
    runs_dir: Path,
    run_name: str,
    args: list[str],
    rebuilt: list[str] = (),
    script: Path | None = None,
    needs: list[str] = (),
) -> tuple[str, str]:
    """What the suite does with a stage whose command arguments (after the script path) are `args`, and why:
    "skip" (done.json with these arguments, made by `script` as it is now from the models it needs as they are now),
    "resume" (checkpoint, no done.json, launched with these arguments by `script` as it is now), "rerun" (the
    directory exists otherwise: launched with --overwrite) or "run" (no directory). `rebuilt`: the stages it needs
    that were run in this invocation, so that what it finished earlier was built on older models. `script` None: the
    arguments alone decide (a caller that does not know the file)."""
    run_dir, args = runs_dir / run_name, same_run_args(args)
    if not run_dir.exists():
        return "run", "new run"
    if rebuilt:
        return "rerun", f"it needs {', '.join(rebuilt)}, run again now"
    done = _read_json(run_dir / "done.json")
    record = _read_json(stage_record(runs_dir, run_name))
    if done is not None:
        was = same_run_args([str(a) for a in done.get("argv") or []])
        if was != args:
            return (
                "rerun",
                f"its done.json is from another command, the budget or flags differ: {_difference(was, args)}",
            )
        changed = (script_change(done.get("script"), script) or regime_change(run_dir)) if script is not None else None
        if changed:
            return "rerun", changed
        built_on = (record or {}).get("needs")
        if isinstance(built_on, dict):  # a record without it (older suites, a run by hand): the arguments decide
            now = needs_fingerprint(runs_dir, [n for n in needs if n in built_on])
            older = [n for n, h in now.items() if h != built_on[n]]
            if older:
                return "rerun", f"it was built on an earlier {', '.join(older)}, which was run again since"
        return "skip", "finished earlier with the same command and script (done.json)"
    if (run_dir / "done.json").exists():
        return "rerun", "its done.json is unreadable"
    if storage.checkpoint_to_resume(run_dir)[0] is None:
        return "rerun", "it did not finish (no done.json) and has no complete checkpoint to resume"
    if record is None:
        return "rerun", "it did not finish and there is no record of the command that started it"
    was = same_run_args([str(a) for a in record.get("argv") or []])
    if was != args:
        return "rerun", f"it did not finish, and was started by another command: {_difference(was, args)}"
    if script is not None:
        started = ((_read_json(run_dir / "provenance.json") or {}).get("started") or {}).get("script")
        changed = script_change(started, script) or regime_change(run_dir)
        if changed:
            return "rerun", f"it did not finish, and not with this script: {changed}"
    return "resume", "it stopped part way (a checkpoint, no done.json); same command and script"


def final_metrics(run_dir: Path) -> dict:
    """The last value of every metric in a run's metrics.jsonl; unreadable lines are skipped."""
    last: dict = {}
    for row in read_run(run_dir).rows:
        last.update(row)
    return last


LAUNCH = {"run": [], "rerun": ["--overwrite"], "resume": ["--resume"]}  # flags appended per decision


SEED_RANGE = (0, 2**31 - 1)  # the scripts' `--seed` range (clean_rlhf_utils/args.py)


def check_seeds(seeds: list[int]) -> None:
    """The suites' and the study's `--seeds`, refused in one line when the suite starts rather than by each stage
    later: out of the scripts' range, or given twice (two stages of one name)."""
    low, high = SEED_RANGE
    bad = [s for s in seeds if not low <= s <= high]
    if bad:
        raise SystemExit(
            f"error: --seeds {' '.join(map(str, bad))}: a seed must be in [{low}, {high}] (the scripts' --seed)"
        )
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise SystemExit(f"error: --seeds gives {' '.join(map(str, twice))} more than once; give each seed once")
    if not seeds:
        raise SystemExit("error: --seeds is empty; give at least one seed")


def accelerate_config_problem(path: Path) -> str | None:
    """Why `accelerate launch --config_file PATH` would fail on the file itself, found with accelerate's own reader
    before anything is launched (accelerate would stop each stage with a traceback of its own); None when it loads."""
    if not path.is_file():
        return f"the accelerate config {path} {'is not a regular file' if path.exists() else 'does not exist'}"
    try:
        from accelerate.commands.config.config_args import load_config_from_file

        load_config_from_file(str(path))
    except Exception as e:  # YAML errors, accelerate's ValueErrors: whatever `accelerate launch` would stop on
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        return f"the accelerate config {path} is not one accelerate can read ({type(e).__name__}: {first})"
    return None


def check_accelerate_configs(stages: list[Stage], workdir: Path, dry_run: bool = False) -> None:
    """Every accelerate config the stages launch with (from the working directory, as `accelerate launch` reads it)
    loads, before the first stage: one line naming the file; a dry run, which launches nothing, prints it instead."""
    for name in sorted({st.accelerate_config for st in stages if st.accelerate_config}):
        problem = accelerate_config_problem(Path(workdir) / f"benchmark/accelerate_configs/{name}.yaml")
        if problem:
            line = f"{problem}; restore it (git checkout -- benchmark/accelerate_configs) or fix it"
            if not dry_run:
                raise SystemExit(f"error: {line}")
            print(f"# [warning] {line}")


def run_suite(
    suite: str,
    seeds: list[int],
    workdir: Path = Path("."),
    dry_run: bool = False,
    launcher: list[str] | None = None,
    jobs: int = 1,
    only: list[str] | None = None,
    quick: bool = False,
    live: bool | None = None,
    stages: list[Stage] | None = None,
) -> dict[str, str]:
    """Run the stages of `suite` with `workdir` as the working directory (runs land in workdir/runs).

    `jobs` > 1 runs that many independent stages at once, each with one thread per job's share of the cores
    (on a 2-core CPU, two 1-thread runs get more done than one 2-thread run of these tiny models).
    `only` keeps the stages whose algorithm (run name before `_`, e.g. `ppo`) or algorithm and track (run name
    before `__`, e.g. `ppo_tiny-tldr`) is listed, plus the stages they need. `quick` appends each stage's
    shorter budget (`Stage.quick`). Suite `quick`: the tiny suite's QUICK_STAGES and the frontier's
    MAIN_FRONTIER_STAGES (or `only`), always `quick`; suite `learning` adds LEARNING_FRONTIER_STAGES. `live`: redraw
    a status block on the terminal (benchmark/status.py); False prints event lines only, None (the default) does so
    when stdout is not a terminal. `stages`: these instead of the suite's (the study's)."""
    if jobs < 1:  # 0 never starts a stage and waits for one forever
        raise SystemExit(f"error: --jobs is {jobs}; it must be at least 1")
    check_seeds(seeds)
    asked = only
    if suite in ("quick", "learning"):
        main_job = QUICK_STAGES + MAIN_FRONTIER_STAGES
        only, quick = only or main_job + (LEARNING_FRONTIER_STAGES if suite == "learning" else []), True
    launcher = launcher or [sys.executable]
    runs_dir = Path(workdir) / "runs"
    stages = stages if stages is not None else SUITES[suite](seeds)
    if only:
        keep = {
            st.run_name for st in stages if st.run_name.split("_")[0] in only or st.run_name.rsplit("__", 1)[0] in only
        }
        for st in stages:  # the SFT/RM stages the kept ones depend on
            if st.run_name in keep:
                keep |= set(st.needs)
        stages = [st for st in stages if st.run_name in keep]
        names = {
            part for st in SUITES[suite](seeds) for part in (st.run_name.split("_")[0], st.run_name.rsplit("__", 1)[0])
        }
        unknown = sorted(set(asked or []) - names)
        if unknown:  # a misspelt name would run nothing and exit 0
            raise SystemExit(
                f"error: --only {' '.join(unknown)} names no stage of suite {suite}; its names are {sorted(names)}"
            )
    check_accelerate_configs(stages, workdir, dry_run)
    status: dict[str, str] = {}
    if dry_run:
        for stage in stages:  # what is needed comes first; "dry-run" marks a stage that would be run now
            rebuilt = [d for d in stage.needs if status.get(d) == "dry-run"]
            decision = decide(runs_dir, stage.run_name, stage.args(quick), rebuilt, stage.file(workdir), stage.needs)
            action, why = refuse_foreign(runs_dir, stage.run_name, *decision)
            if action == "skip":
                print(f"# [skip] {stage.run_name}: {why}")
                status[stage.run_name] = "skipped"
                continue
            if action == "refuse":
                print(f"# [refused] {stage.run_name}: {why}")
                status[stage.run_name] = "failed"
                continue
            if action != "run":
                print(f"# [{action}] {stage.run_name}: {why}")
            print(shlex.join(stage.command(launcher, quick) + LAUNCH[action]))
            status[stage.run_name] = "dry-run"
        return status
    # one suite at a time in a runs directory: a second would relaunch the first one's stages into the same logs
    # (runs/_suite/<stage>.log) and show the first one's lines as its own failure
    refused = ownership.take_lock(runs_dir / SUITE_DIR)
    if refused:
        owner = refused.split(" is in use by ", 1)[-1].split("; wait for it", 1)[0]
        raise SystemExit(
            f"error: another suite runs in {runs_dir} ({owner}); wait for it to end or stop it, or give this one "
            "another --workdir"
        )
    try:
        return _run_suite(suite, stages, runs_dir, workdir, launcher, jobs, quick, live)
    finally:
        ownership.release_lock(runs_dir / SUITE_DIR)


def _run_suite(
    suite: str,
    stages: list[Stage],
    runs_dir: Path,
    workdir: Path,
    launcher: list[str],
    jobs: int,
    quick: bool,
    live: bool | None,
) -> dict[str, str]:
    """`run_suite` once it holds the runs directory's suite lock."""
    status: dict[str, str] = {}
    if any(stage.preset.startswith("tiny") for stage in stages):  # the tiny world, built on first use
        ensure_assets(runs_dir / "assets")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # allowed ones
    threads = max(1, cores // max(jobs, 1))
    suite_dir = runs_dir / SUITE_DIR
    display = Display(  # every line below goes through it: on a terminal, above the redrawn block
        f"{suite} suite",
        [
            StageStatus(st.run_name, script=Path(st.script).name, log=str(suite_dir / f"{st.run_name}.log"))
            for st in stages
        ],
        jobs,
        live,
    )
    pending = list(stages)
    running: dict[str, tuple[subprocess.Popen, float, Path, object]] = {}
    stopping: list[int] = []  # the signals the suite got: passed on to the running stages, which checkpoint and stop

    def pass_on(signum, frame) -> None:  # a terminal's hangup stops the stages as SIGTERM does
        stopping.append(signum)
        for proc, *_ in running.values():
            if proc.returncode is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)
                except ProcessLookupError:
                    pass

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, pass_on) for sig in handled} if main_thread else {}
    try:
        while (pending and not stopping) or running:
            for stage in [] if stopping else list(pending):  # stopped: no new stage starts
                if len(running) >= jobs:
                    break
                bad = [d for d in stage.needs if status.get(d) in ("failed", "blocked")]
                if bad:
                    status[stage.run_name] = "blocked"
                    display[stage.run_name].state, display[stage.run_name].note = (
                        BLOCKED,
                        f"needs failed {', '.join(bad)}",
                    )
                    display.event(f"[skip] {stage.run_name}: depends on failed {bad}")
                    pending.remove(stage)
                    continue
                if any(d in running or any(p.run_name == d for p in pending) for d in stage.needs):
                    continue  # wait for what it needs: whether it was run now decides whether this stage can be kept
                rebuilt = [d for d in stage.needs if status.get(d) == "ok"]
                decision = decide(
                    runs_dir, stage.run_name, stage.args(quick), rebuilt, stage.file(workdir), stage.needs
                )
                action, why = refuse_foreign(runs_dir, stage.run_name, *decision)
                if action == "skip":
                    status[stage.run_name] = "skipped"
                    display[stage.run_name].state = SKIPPED
                    display[stage.run_name].headline = headline(final_metrics(runs_dir / stage.run_name))
                    display.event(f"[skip] {stage.run_name}: {why}")
                    pending.remove(stage)
                    continue
                if action == "refuse":  # its directory holds what is not a run: left as it is
                    status[stage.run_name] = "failed"
                    display[stage.run_name].state, display[stage.run_name].note = FAILED, "not a run's directory"
                    display[stage.run_name].log = ""
                    display.event(f"[FAILED] {stage.run_name}: {why}")
                    pending.remove(stage)
                    continue
                if not (Path(workdir) / stage.script).exists() and not (REPO / stage.script).exists():
                    status[stage.run_name] = "failed"
                    display[stage.run_name].state, display[stage.run_name].note = (
                        FAILED,
                        f"{stage.script} does not exist",
                    )
                    display[stage.run_name].log = ""  # nothing was launched, so there is no log to read
                    display.event(f"[missing] {stage.run_name}: {stage.script} does not exist")
                    pending.remove(stage)
                    continue
                cmd = stage.command(launcher, quick)
                if jobs > 1 and not stage.accelerate_config:
                    cmd += ["--num-threads", str(threads)]
                cmd += LAUNCH[action]
                shown = display[stage.run_name]
                shown.state, shown.started, shown.progress = RUNNING, time.time(), None
                display.event(
                    *([f"[{action}] {stage.run_name}: {why}"] if action != "run" else []), f"[run] {shlex.join(cmd)}"
                )
                record = stage_record(runs_dir, stage.run_name)
                record.parent.mkdir(parents=True, exist_ok=True)
                if action != "resume":  # a resumed run keeps the record of the command that started it
                    built_on = needs_fingerprint(runs_dir, stage.needs)  # the models it reads, as they are now
                    record.write_text(json.dumps({"argv": stage.args(quick), "command": cmd, "needs": built_on}) + "\n")
                log = runs_dir / SUITE_DIR / f"{stage.run_name}.log"  # beside the stage's record
                f = open(log, "a" if action == "resume" else "w")
                if action == "resume":
                    f.write(f"\n--- resumed: {shlex.join(cmd)}\n")
                    f.flush()
                env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
                if jobs > 1:
                    env["OMP_NUM_THREADS"] = str(threads)
                # a session of its own: a terminal's Ctrl-C reaches the suite alone, which passes it on once (a
                # second SIGINT stops a script at once, without its checkpoint)
                proc = subprocess.Popen(
                    cmd, cwd=workdir, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
                running[stage.run_name] = (proc, time.time(), log, f)
                pending.remove(stage)
            for name, (proc, t0, log, f) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                f.close()
                del running[name]
                shown = display[name]
                shown.seconds = time.time() - t0
                if rc == 0:
                    status[name] = "ok"
                    shown.state, shown.headline = DONE, headline(final_metrics(runs_dir / name))
                    lines = [f"[ok] {name} in {shown.seconds:.0f}s" + (f": {shown.headline}" if shown.headline else "")]
                    if not (runs_dir / name / "done.json").exists():
                        lines.append(
                            f"warning: {name} exited 0 without writing {runs_dir / name / 'done.json'}; it will be run "
                            "again by the next invocation"
                        )
                    display.event(*lines)
                elif stopping:  # stopped by the signal the suite passed on: its checkpoint is resumed by a rerun
                    status[name] = "stopped"
                    shown.state, shown.note = FAILED, f"stopped (exit {rc})"
                    display.event(f"[stopped] {name} (exit {rc}); the same command resumes it")
                else:
                    status[name] = "failed"
                    shown.state, shown.note = FAILED, f"exit {rc}"
                    # the log's last lines as a terminal shows them (a tqdm bar once, not each update), indented
                    tail = log_tail(log.read_text(errors="replace"))
                    display.event(
                        f"[FAILED] {name} (exit {rc}); last lines of {log}:", *(f"    {line}" for line in tail)
                    )
            if running:
                display.tick()
                time.sleep(0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc, *_ in running.values():  # the suite itself failed: it leaves no stage running without it
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    for stage in pending:  # never started: the suite was stopped
        status[stage.run_name] = "stopped"
    display.close()
    lines = [f"# {suite} suite", "", "| run | status | final metrics |", "| --- | --- | --- |"]
    for stage in stages:
        m = final_metrics(runs_dir / stage.run_name)
        shown = ", ".join(
            f"{k} {v:.3f}"
            for k, v in m.items()
            if k.startswith("eval/") and isinstance(v, float) and "confidence" not in k
        )
        lines.append(f"| {stage.run_name} | {status[stage.run_name]} | {shown} |")
    finished = [read_run(runs_dir / st.run_name) for st in stages if (runs_dir / st.run_name / "done.json").exists()]
    lines += ["", *(f"> warning: {line}" for line in provenance_differences(finished))]  # mixed code or hosts
    summary = "\n".join(lines).rstrip() + "\n"
    (runs_dir / f"{suite}_summary.md").write_text(summary)
    print(summary)
    print(f"wrote {runs_dir / f'{suite}_summary.md'}\nstage logs and records: {suite_dir}/", flush=True)
    if stopping:
        name = signal.Signals(stopping[0]).name
        print(f"stopped by {name}: every stage it started has ended; run the same command to go on", flush=True)
        raise SystemExit(128 + stopping[0])
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted([*SUITES, "study"]))
    parser.add_argument(
        "--scripts", nargs="+", default=None, help="suite study: the scripts to compare (rloo_batchmean.py rloo.py)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds of the RL stages")
    parser.add_argument("--workdir", default=".", help="working directory; runs are written to WORKDIR/runs")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument(
        "--jobs", type=int, default=1, help="independent stages run at once (threads split between them)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="keep these algorithms (ppo, grpo) or algorithm_track names (ppo_tiny-tldr) and what they need",
    )
    parser.add_argument(
        "--quick", action="store_true", help="shorter RL runs (the learning tests); not the README's numbers"
    )
    parser.add_argument(
        "--shared-starts",
        action="store_true",
        help="study: every seed from seed 1's SFT and reward model (paired); default: each seed its own",
    )
    parser.add_argument("--name", default=None, help="study: the name of its outputs (default: the scripts' names)")
    parser.add_argument(
        "--rounding",
        choices=sorted(ROUNDING),
        default="native",
        help="native: the machine's kernels; default: ATEN_CPU_CAPABILITY=default, a second rounding regime on one "
        "machine, its runs under WORKDIR/rounding-default/",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="one line per event even on a terminal (no redrawn status block); the default off a terminal",
    )
    a = parser.parse_args()
    live = False if a.plain else None  # None: the block on a terminal, event lines otherwise
    if (a.suite == "study") != (a.scripts is not None):
        raise SystemExit("error: --scripts goes with the suite study, and the study needs it")
    check_seeds(a.seeds)
    if a.rounding != "native":
        if a.suite in ("tldr", "math"):
            raise SystemExit(
                f"error: --rounding {a.rounding} is for the tiny world on a CPU, not the GPU suite {a.suite}"
            )
        os.environ.update(ROUNDING[a.rounding])  # every stage inherits it; the cache compares it (regime_change)
        a.workdir = str(regime_workdir(Path(a.workdir), a.rounding))
        if not a.dry_run:  # a dry run makes nothing
            Path(a.workdir).mkdir(parents=True, exist_ok=True)
        regime = " ".join(f"{k}={v}" for k, v in ROUNDING[a.rounding].items())
        print(f"# rounding {a.rounding}: {regime}; runs in {a.workdir}/runs")
    if a.suite == "study":
        suite_only = [flag for flag, given in (("--only", a.only is not None), ("--quick", a.quick)) if given]
        if suite_only:  # the study runs every track of each script's family at its own budgets
            raise SystemExit(
                f"error: {' and '.join(suite_only)} {'act' if len(suite_only) > 1 else 'acts'} on the suites, not the "
                "study, which runs each script on every "
                "track of its family at the study's budgets (benchmark/study.py); leave them out"
            )
        from benchmark import study

        status = study.run_study(
            a.scripts,
            a.seeds,
            Path(a.workdir),
            a.dry_run,
            jobs=a.jobs,
            live=live,
            shared_starts=a.shared_starts,
            name=a.name,
        )
        sys.exit(1 if any(s == "failed" for s in status.values()) else 0)
    study_only = [
        flag for flag, given in (("--shared-starts", a.shared_starts), ("--name", a.name is not None)) if given
    ]
    if study_only:  # the suites always train each seed's own models and write SUITE_summary.md
        verb = "act" if len(study_only) > 1 else "acts"
        raise SystemExit(f"error: {' and '.join(study_only)} {verb} on the study, not the suites; leave them out")
    status = run_suite(a.suite, a.seeds, Path(a.workdir), a.dry_run, jobs=a.jobs, only=a.only, quick=a.quick, live=live)
    if a.suite == "quick" and not a.dry_run:  # the main job ends with whether this install reproduces the library
        from benchmark import reference, reproduce

        try:
            verdicts, line, _ = reproduce.reproduce(Path(a.workdir) / "runs")
            print("\n".join(["", "# python -m benchmark.reproduce", *(v.line for v in verdicts), line]), flush=True)
        except (reproduce.ReproduceError, reference.ReferenceError) as e:
            print(f"\n# python -m benchmark.reproduce: {e}", flush=True)
    sys.exit(1 if any(s == "failed" for s in status.values()) else 0)


if __name__ == "__main__":
    main()
