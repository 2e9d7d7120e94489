"""The papers' effects on the tiny world (issue 68): `python -m benchmark.effects run ROW... [--rounding default]`.

Each variant the library implements exists because a paper measured an effect. A row here is one such effect: the
paper and its figure, the claim in one line, the two scripts it compares (a library script, or one with one edit of a
library script: CleanRL's way, the edit is the variant), the study track and budget it runs on, the quantity the
paper claims the effect on (an entropy claim as entropy, a length claim as the length it names, a variance claim as
the gradient's norm), and the direction the paper predicts. The rows are fixed in this file before their comparison
runs: the commit that adds a row is its design (docs/effects.md names it), so a result cannot be tuned into it.

    python -m benchmark.effects list                       # the rows, their designs
    python -m benchmark.effects run dr-grpo clip-cov --jobs 2 [--rounding default] [--workdir W]
    python -m benchmark.effects record [--rounding default]   # the runs' values into benchmark/effects_values.json
    python -m benchmark.effects table                      # the table, both regimes, from the recorded values

`run` writes each row's edited scripts to WORKDIR/runs/_effects/<name>.py (from the library script as it is now: an
edit that no longer applies is one `error:` line), then runs `benchmark.run study` on them and the row's base, on the
row's track, 3 full-pipeline seeds (each its own SFT policy and reward model). Rows on one track share their base's
runs; a rerun skips what finished (the suite's cache: an edited parent changes the fork's bytes, so it reruns).
Then it records (`record`) the values of every finished run of its regime in benchmark/effects_values.json: per run
name, each quantity its rows read, the commit and script hash it ran and the host. The runs are not kept (a machine's
runs/ is not the repository's); the values are, so the table can be built, and checked, from them.
`table` gives per row and regime: the quantity's mean over seeds with its 95% bootstrap interval for each script, the
smallest difference of means the seeds could separate, and the verdict: "shown" (the intervals do not overlap, in the
paper's direction: the study's test), "opposite" (they do not overlap, the other way), "not shown" (they overlap);
for a parity claim ("equal"), "shown" when they overlap and the means differ by at most the row's tolerance. A row is
shown when it is shown under both regimes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmark import curves, runfiles, study
from benchmark.launch import ROUNDING, regime_workdir

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Fork:
    """A library script with edits: each `old` text found exactly once in `parent`.py, replaced by `new`."""

    name: str
    parent: str
    edits: tuple[tuple[str, str], ...]

    def text(self) -> str:
        text = (REPO / f"{self.parent}.py").read_text()
        for old, new in self.edits:
            if text.count(old) != 1:
                raise SystemExit(
                    f"error: the edit of {self.name} finds {text.count(old)} copies of {old.splitlines()[0].strip()!r} "
                    f"in {self.parent}.py, not 1: update its row in benchmark/effects.py"
                )
            text = text.replace(old, new)
        return text


@dataclass(frozen=True)
class Quantity:
    metric: str
    measure: str
    """`final` (its last logged value), `mean` (over every row that logs it: a training metric over the run), `drop`
    (its largest value less its last: how far it fell from its peak), or `auc`
    (the area under its curve against the update, from its first logged update to its last, divided by that span)"""
    direction: str
    """the paper's claim of the variant against the base: `higher`, `lower`, or `equal` (parity)"""
    tolerance: float = 0.0
    """(equal) the largest difference of means that still counts as parity"""

    def label(self) -> str:
        return f"{self.metric} ({self.measure})"


@dataclass(frozen=True)
class Effect:
    key: str
    paper: str
    claim: str
    base: str | Fork
    variant: str | Fork
    track: str
    quantity: Quantity
    also: tuple[Quantity, ...] = ()
    """reported beside it, not deciding"""
    design: str = ""
    """why this quantity, track and budget"""
    variant_track: str = ""
    """the variant's track where it is not the base's (another family's, or another mode of one script: online DPO
    against offline); empty: the base's"""

    def sides(self) -> tuple[tuple[str | Fork, str], tuple[str | Fork, str]]:
        """(script, track) of the base and of the variant."""
        return (self.base, self.track), (self.variant, self.variant_track or self.track)


TINY = '            max_completion_length=80,\n            loss_type="grpo",\n'
"""grpo_math.py's `tiny` preset's loss type (the only preset whose completions stop at 80 tokens)"""


def _preset_edit(line: str) -> tuple[str, str]:
    """An extra line in grpo_math.py's `tiny` preset."""
    return TINY, TINY + line


def _loss_type(loss: str) -> tuple[str, str]:
    """The `tiny` preset's loss type changed."""
    return TINY, TINY.replace('"grpo"', f'"{loss}"')


def _grpo(name: str, *edits: tuple[str, str]) -> Fork:
    return Fork(name, "grpo_math", edits)


ACCURACY_FINAL, ACCURACY_AUC = (
    Quantity("eval/accuracy", "final", "equal", 0.05),
    Quantity("eval/accuracy", "auc", "higher"),
)
TOKEN_ENTROPY = Quantity("objective/token_entropy", "final", "higher")
DAPO = _grpo("grpo_dapo", _loss_type("dapo"))

EFFECTS = [
    Effect(
        "dr-grpo",
        "Liu et al. 2025, arXiv:2503.20783, Figure 5",
        "GRPO's 1/|o| normalisation lets the incorrect completions grow longer; Dr. GRPO's does not",
        "grpo_math",
        _grpo("grpo_dr", _loss_type("dr_grpo")),
        "tiny-math-long",
        Quantity("objective/incorrect_length", "final", "lower"),
        (Quantity("objective/correct_length", "final", "equal", 5.0), ACCURACY_FINAL),
        "the length of the sampled answers that are wrong, at the last update (tokens); 40 updates, the preset's",
    ),
    Effect(
        "clip-higher",
        "Yu et al. 2025 (DAPO), arXiv:2503.14476, Figure 2",
        "a higher upper clip (0.28 against 0.2) keeps the policy's entropy higher, and pass@k does not fall",
        "grpo_math",
        _grpo("grpo_clip_higher", _preset_edit("            epsilon_high=0.28,  # DAPO's clip-higher\n")),
        "tiny-math-offpolicy",
        TOKEN_ENTROPY,
        (Quantity("eval/pass@k", "final", "equal", 0.05), ACCURACY_FINAL),
        "the clip acts only off-policy: two passes over each batch (the second all off-policy)",
    ),
    Effect(
        "dynamic-sampling",
        "Yu et al. 2025 (DAPO), arXiv:2503.14476, Figure 6",
        "dropping the groups whose answers are all right or all wrong reaches an accuracy in fewer updates",
        "grpo_math",
        _grpo("grpo_dynamic", _preset_edit("            dynamic_sampling=True,  # DAPO's dynamic sampling\n")),
        "tiny-math-long",
        ACCURACY_AUC,
        (ACCURACY_FINAL,),
        "accuracy against the update (not the sampled episode: it samples more per update)",
    ),
    Effect(
        "clip-cov",
        "Cui et al. 2025, arXiv:2505.22617, Figure 7",
        "cutting the gradient of the few tokens of highest covariance slows the collapse of the policy's entropy",
        "grpo_math",
        "grpo_clip_cov",
        "tiny-math-long",
        TOKEN_ENTROPY,
        (ACCURACY_FINAL,),
        "the per-token entropy (the paper's; the per-completion sum grows with the length), 40 updates",
    ),
    Effect(
        "kl-cov",
        "Cui et al. 2025, arXiv:2505.22617, Figure 7",
        "a KL penalty on the few tokens of highest covariance slows the collapse of the policy's entropy",
        "grpo_math",
        "grpo_kl_cov",
        "tiny-math-long",
        TOKEN_ENTROPY,
        (ACCURACY_FINAL,),
        "as clip-cov",
    ),
    Effect(
        "cispo",
        "MiniMax-M1 2025, arXiv:2506.13585, Figure 2",
        "CISPO, which keeps the clipped tokens' gradients, learns faster per update than DAPO",
        DAPO,
        _grpo("grpo_cispo", _loss_type("cispo")),
        "tiny-math-offpolicy",
        ACCURACY_AUC,
        (ACCURACY_FINAL,),
        "both with DAPO's dynamic sampling and length penalty (CISPO's recipe); off-policy passes, where tokens clip",
    ),
    Effect(
        "gspo",
        "Zheng et al. 2025, arXiv:2507.18071, Figure 2",
        "clipping whole sequences clips a far larger share of the tokens than GRPO's per-token clip",
        "grpo_math",
        _grpo("grpo_gspo", _preset_edit('            importance_sampling_level="sequence",  # GSPO\n')),
        "tiny-math-offpolicy",
        Quantity("policy/clipfrac", "mean", "higher"),
        (ACCURACY_FINAL,),
        "the share of loss tokens clipped, over every update; off-policy passes, where the clip acts",
    ),
    Effect(
        "reinforce-pp",
        "Hu 2025, arXiv:2501.03262, section 4",
        "normalising the advantages over the global batch, not per prompt, keeps the KL to the reference lower",
        "grpo_math",
        _grpo(
            "grpo_reinforce_pp",
            _preset_edit('            advantage_estimator="reinforce_pp_baseline",  # REINFORCE++-baseline\n'),
        ),
        "tiny-math-long",
        Quantity("objective/kl", "final", "lower"),
        (ACCURACY_FINAL,),
        "the KL to the reference of the sampled completions at the last update (both with beta 0.04)",
    ),
    Effect(
        "async-grpo",
        "Noukhovitch et al. 2024, arXiv:2410.18252, Figure 4",
        "one-step-off-policy (asynchronous) GRPO reaches the accuracy of on-policy GRPO",
        "grpo_math",
        _grpo("grpo_async", _preset_edit("            async_generation=True,  # sampling overlaps training\n")),
        "tiny-math-long",
        ACCURACY_FINAL,
        (ACCURACY_AUC,),
        "parity within 0.05 accuracy",
    ),
    Effect(
        "rloo-baseline",
        "Ahmadian et al. 2024, arXiv:2402.14740, section 3",
        "REINFORCE without a baseline has a higher-variance gradient than RLOO's leave-one-out baseline",
        "rloo",
        Fork(
            "rloo_nobaseline",
            "rloo",
            (
                (
                    "    baseline = (grouped.sum(1, keepdim=True) - grouped) / (k - 1)\n",
                    "    baseline = torch.zeros_like(grouped)  # REINFORCE without a baseline\n",
                ),
            ),
        ),
        "tiny-math",
        Quantity("train/grad_norm", "mean", "higher"),
        (ACCURACY_FINAL,),
        "the gradient's norm before clipping over the run: both estimators are unbiased (the same mean gradient), so"
        " a larger norm is a larger variance; tiny-math's 0/1 reward has a mean near its spread, so it shows there",
    ),
    Effect(
        "remax-baseline",
        "Li et al. 2023 (ReMax), arXiv:2310.10505, section 4",
        "the greedy response's reward as a baseline lowers the gradient's variance of REINFORCE",
        "remax",
        Fork(
            "remax_nobaseline",
            "remax",
            (
                (
                    "advantages = remax_advantages(scores, greedy_scores, ",
                    "advantages = remax_advantages(scores, torch.zeros_like(greedy_scores), ",
                ),
            ),
        ),
        "tiny-math",
        Quantity("train/grad_norm", "mean", "higher"),
        (ACCURACY_FINAL,),
        "as rloo-baseline",
    ),
]
DPO_TINY = (
    "            learning_rate=1e-5,\n            warmup_ratio=0.05,\n            per_device_train_batch_size=32,\n"
    '            eval_task="tldr",\n            eval_every=50,\n'
)
"""dpo.py's `tiny-tldr` preset (its learning rate and evaluation interval are that preset's alone)"""
EFFECTS.append(
    Effect(
        "ipo",
        "Azar et al. 2023, arXiv:2310.12036, sections 4.2 and 5.2",
        "on deterministic preferences DPO's implicit reward margin keeps growing; IPO's stays at its target 1/(2 beta)",
        "dpo",
        Fork(
            "dpo_ipo",
            "dpo",
            (
                (
                    DPO_TINY,
                    DPO_TINY + '            loss_type="ipo",\n            ipo_average=False,  # the paper\'s sequence'
                    " log-ratios\n",
                ),
            ),
        ),
        "tiny-tldr-long",
        Quantity("eval/reward_margin", "final", "lower"),
        (Quantity("eval/gold_reward", "final", "equal", 0.05), Quantity("eval/accuracy", "final", "equal", 0.05)),
        "beta times the log-ratio margin on 200 held-out gold-labelled pairs after 4 passes (IPO's target: 0.5); both"
        " on summed sequence logprobs, so the two margins are in one unit",
    )
)
PPO_MATH = '            kl_coef=0.01,\n            eval_task="gsm8k",\n'
"""ppo_rlhf.py's `tiny-math` preset (the only one evaluated on GSM8K's answers at that KL coefficient)"""
EFFECTS.append(
    Effect(
        "clip-delta",
        "Gao et al. 2024, arXiv:2410.15115, section 4 and Figure 2",
        "a learned process reward added to the success reward is hacked (more steps, lower accuracy); Clip + Delta are"
        " not",
        "ppo_rlhf",
        Fork(
            "ppo_clip_delta",
            "ppo_rlhf",
            ((PPO_MATH, PPO_MATH + '            prm_refine="clip_delta",  # Gao et al.\n'),),
        ),
        "tiny-math-prm",
        Quantity("eval/accuracy", "final", "higher"),
        (Quantity("eval/completion_length", "final", "lower"), Quantity("objective/eos_rate", "final", "higher")),
        "greedy accuracy after 2,048 episodes of PPO with each seed's process reward model, raw (ppo_rlhf.py's default"
        " --prm-refine none) against Clip + Delta; docs/results.md's earlier runs of both were from one start",
    )
)
PPO_NOISY = '            kl_coef=0.05,\n            eval_task="tldr",\n            eval_every=3,\n'
"""ppo_rlhf.py's `tiny-tldr-noisy` preset (the only one of that KL coefficient evaluated every 3 updates)"""
PPO_KL0 = Fork("ppo_kl0", "ppo_rlhf", ((PPO_NOISY, PPO_NOISY.replace("kl_coef=0.05", "kl_coef=0.0")),))
EFFECTS.append(
    Effect(
        "overoptimisation",
        "Gao et al. 2023, arXiv:2210.10760, Figure 1; Huang et al. 2024 (N+)",
        "without a KL penalty, PPO on an imperfect reward model raises the proxy while the gold reward falls from its "
        "peak",
        "ppo_rlhf",
        PPO_KL0,
        "tiny-tldr-noisy",
        Quantity("eval/gold_reward", "drop", "higher"),
        (Quantity("eval/score", "final", "higher"), Quantity("eval/kl", "final", "higher")),
        "the gold reward's fall from its peak to the last evaluation, over PPO's study track (512 episodes, an"
        " evaluation every update); the main job's frontier showed it in 2 of 3 seeds per regime",
    )
)
GOLD_FINAL = Quantity("eval/gold_reward", "final", "higher")
KL_LOSS = (
    '    kl_loss = k2_kl(logprobs, ref_logprobs) if ref_logprobs is not None and args.kl_estimator == "k2" else kl\n'
)
"""grpo_math.py's KL loss term (k3, or k2 with --kl-estimator k2)"""
EFFECTS += [  # designed together, before any of their comparisons ran (docs/effects.md names the commit)
    Effect(
        "online-dpo",
        "Guo et al. 2024 (OAIF), arXiv:2402.04792, section 4",
        "DPO on pairs sampled from the policy and labelled as it trains (online) ends above DPO on a fixed set of pairs"
        " labelled by the same annotator (offline), which over-fits them",
        "dpo",
        "dpo",
        "tiny-tldr-long",
        GOLD_FINAL,
        (Quantity("eval/reward_margin", "final", "lower"), Quantity("eval/accuracy", "final", "equal", 0.05)),
        "the gold judge's reward of greedy summaries on 100 held-out prompts after 128 steps of 32 pairs, both"
        " labelled by the gold judge (the offline pairs' labeller): offline four passes over 1,024 pairs, online"
        " 4,096 fresh prompts; the same learning rate (5e-5, constant), beta and evaluation",
        variant_track="tiny-tldr-online-long",
    ),
    Effect(
        "ppo-vs-dpo",
        "Xu et al. 2024, arXiv:2404.10719, section 4",
        "DPO can put its mass on responses its preference pairs do not cover; PPO, sampling its own responses and"
        " scoring them with a reward model of the same pairs, ends above DPO",
        "dpo",
        "ppo_rlhf",
        "tiny-tldr-long",
        GOLD_FINAL,
        (Quantity("eval/kl", "final", "lower"),),
        "the gold judge's reward of greedy summaries on the same 100 held-out prompts: DPO converged on 1,024"
        " gold-labelled pairs (tiny-tldr-long), PPO at its preset's 1,024 episodes with the reward model of those"
        " pairs' labels (tiny-tldr); the paper compares at a matched KL, which DPO's evaluation here does not log",
        variant_track="tiny-tldr",
    ),
    Effect(
        "remax-memory",
        "Li et al. 2023 (ReMax), arXiv:2310.10505, section 5",
        "ReMax, which has no value model, trains with less memory than PPO",
        "ppo_rlhf",
        "remax",
        "tiny-tldr-noisy",
        Quantity("perf/peak_mem_gb", "final", "lower"),
        (Quantity("eval/gold_reward", "final", "equal", 0.05),),
        "the process's peak resident memory over the run (GB; a GPU's peak allocation where there is one), both at"
        " their tiny-tldr-noisy presets on the study track (512 episodes): the same policy, reference and reward"
        " model, PPO's value model and its optimizer state beside",
    ),
    Effect(
        "overoptimisation-long",
        "Gao et al. 2023, arXiv:2210.10760, Figure 1; Huang et al. 2024 (N+)",
        "without a KL penalty, PPO on an imperfect reward model raises the proxy while the gold reward falls from its "
        "peak",
        "ppo_rlhf",
        PPO_KL0,
        "tiny-tldr-noisy-long",
        Quantity("eval/gold_reward", "drop", "higher"),
        (
            Quantity("eval/score", "final", "higher"),
            Quantity("eval/kl", "final", "higher"),
            Quantity("eval/gold_reward", "final", "lower"),
        ),
        "as overoptimisation, over the preset's full 1,536 episodes (24 updates), an evaluation every update: the"
        " study track's 512 stopped at a KL of about 1",
    ),
    Effect(
        "kl-k1-loss",
        "Tang & Munos 2025, arXiv:2506.09477 (the first pitfall)",
        "k1 (log pi - log pi_ref) as a loss term has a gradient of zero mean on the policy's own samples, so it does"
        " not hold the policy near the reference; k3, GRPO's, does (its mean gradient is that of KL(pi_ref || pi))",
        "grpo_math",
        _grpo(
            "grpo_kl_k1",
            (
                KL_LOSS,
                "    kl_loss = torch.zeros_like(kl) if ref_logprobs is None else logprobs - ref_logprobs"
                "  # k1, a loss\n",
            ),
        ),
        "tiny-math-long",
        Quantity("objective/kl", "final", "higher"),
        (ACCURACY_FINAL,),
        "the KL to the reference of the sampled completions at the last update (logged as k3 whatever the loss),"
        " both at the tiny preset's beta 0.04",
    ),
]
EFFECTS.append(
    Effect(
        "kl-cov-7b",
        "Cui et al. 2025, arXiv:2505.22617, Figure 7; its 7B recipe (PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/"
        "7b_kl_cov.sh: kl_cov_ratio=0.002)",
        "a KL penalty on the tokens of highest covariance, at the share the paper's 7B runs penalise, slows the"
        " collapse of the policy's entropy",
        "grpo_math",
        Fork(
            "grpo_kl_cov_7b",
            "grpo_kl_cov",
            (("    kl_cov_ratio: float = 2e-4\n", "    kl_cov_ratio: float = 2e-3  # the paper's 7B recipe\n"),),
        ),
        "tiny-math-long",
        TOKEN_ENTROPY,
        (ACCURACY_FINAL, Quantity("policy/cut_frac", "mean", "higher")),
        "as kl-cov, at the 7B recipe's ratio (2e-3; verl's default and the 32B recipe's, 2e-4, is grpo_kl_cov.py's):"
        " the tiny policy is far smaller than either, and 2e-4 touched 0.06% of the loss tokens here",
    )
)
BF16_SAMPLER = (
    ("import functools\n", "import copy\nimport functools\n"),
    (
        "            sampler or self.policy,\n",
        "            copy.deepcopy(sampler or self.policy).to(torch.bfloat16),  # a bf16 sampler, a float32 trainer\n",
    ),
)
"""grpo_math.py sampling with a bfloat16 copy of the policy's weights (as a bf16 inference engine holds them)"""
EFFECTS.append(
    Effect(
        "sampler-correction",
        'Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training" (TIS)',
        "when the sampler's probabilities differ from the trainer's (a bf16 engine beside a float32 trainer), the"
        " truncated importance weight pi_trainer / pi_sampler (C = 2) keeps training at what the uncorrected update"
        " loses",
        _grpo("grpo_bf16_sampler", *BF16_SAMPLER, _preset_edit('            sampler_correction="none",\n')),
        _grpo(
            "grpo_bf16_sampler_tis",
            *BF16_SAMPLER,
            _preset_edit('            sampler_correction="token_truncate",\n            sampler_correction_cap=2.0,\n'),
        ),
        "tiny-math-sampler",
        Quantity("eval/accuracy", "final", "higher"),
        (
            ACCURACY_AUC,
            Quantity("mismatch/abs_logprob_diff", "mean", "higher"),
            Quantity("mismatch/capped_frac", "mean", "higher"),
        ),
        "greedy accuracy after 40 updates, both sampling with a bf16 copy of the policy and training it in float32"
        " from the trainer's own old logprobs; the correction is TIS per token with verl's cap of 2 (Yao et al.'s);"
        " the mismatch itself (mean |log pi_trainer - log pi_sampler| a completion, the share of tokens capped) is"
        " logged by the corrected side",
    )
)
SAMPLING = (
    "        args, accelerator, tokenizer, unwrapped, stream, rm, prm, vllm_sampler, synced, "
    "use_sampler_logprobs\n    )\n"
)
"""the end of grpo_math.py's `Sampling(...)` in main: what samples each step's completions"""
EFFECTS.append(
    Effect(
        "distill-vs-sft",
        "Agarwal et al. 2024 (GKD), arXiv:2306.13649, section 4",
        "a student trained on its own samples with the teacher's per-token log-probabilities (on-policy distillation)"
        " ends above one trained by maximum likelihood on as many of the teacher's samples (supervised KD)",
        _grpo(
            "grpo_sft_teacher",
            (  # the teacher samples the training batches; `sampling` (the student) still samples the evaluations
                SAMPLING,
                SAMPLING
                + "    teacher_sampling = Sampling(\n"
                + SAMPLING.replace("unwrapped", "teacher").replace("vllm_sampler", "None"),  # on itself, not vLLM
            ),
            ("            data = sampling.collect()\n", "            data = teacher_sampling.collect()\n"),
            (
                "        return distill_advantages(teacher_logprobs, old_logprobs, loss_mask)\n",
                "        return loss_mask.float()  # each token of the teacher's samples: its likelihood up (SFT)\n",
            ),
        ),
        "grpo_math",
        "tiny-math-distill",
        Quantity("eval/accuracy", "final", "higher"),
        (ACCURACY_AUC,),
        "greedy accuracy after 40 updates from the SFT policy, each seed's teacher its own GRPO policy (the tiny"
        " preset's 40 updates): the same prompts, samples per prompt, optimizer and loss (the student's ratio to its"
        " old self, idle on-policy), the sampler (teacher or student) and each token's weight (1, or log pi_teacher"
        " - log pi_student) the only differences; the maximum-likelihood side is SFT through grpo_math.py's loss (a"
        " mean over each completion's tokens), not sft.py",
    )
)
TINY_BETA = "            temperature=0.7,\n            beta=None,\n"
"""grpo_math.py's `tiny` preset's beta (None: DeepSeekMath's 0.04)"""
K1_LOSS = (
    KL_LOSS,
    "    kl_loss = torch.zeros_like(kl) if ref_logprobs is None else logprobs - ref_logprobs  # k1, a loss\n",
)
BETA_04 = (TINY_BETA, TINY_BETA.replace("beta=None,", "beta=0.4,  # ten times DeepSeekMath's 0.04"))
EFFECTS.append(
    Effect(
        "kl-k1-loss-strong",
        "Tang & Munos 2025, arXiv:2506.09477 (the first pitfall)",
        "as kl-k1-loss, at a weight where the KL term binds (beta 0.4): with k1 as the loss the KL to the reference"
        " ends higher than with k3",
        _grpo("grpo_beta04", BETA_04),
        _grpo("grpo_kl_k1_beta04", BETA_04, K1_LOSS),
        "tiny-math-long",
        Quantity("objective/kl", "final", "higher"),
        (ACCURACY_FINAL,),
        "the KL at the last update (k3, as logged) with both sides at beta 0.4: k1's mean gradient is zero at any"
        " weight, k3's grows with it; at 0.04 (kl-k1-loss) the k3 term held the KL 0.4-0.6 below k1's, inside the"
        " seeds' spread",
    )
)
BY_KEY = {e.key: e for e in EFFECTS}


def script_name(s: str | Fork) -> str:
    return s.name if isinstance(s, Fork) else s


def write_forks(effects: list[Effect], folder: Path) -> dict[str, Path]:
    """Each row's scripts: a library script's path, a fork written to folder/<name>.py (rewritten only when its bytes
    change, so the suite's cache keeps its finished runs)."""
    paths = {}
    for e in effects:
        for s, _ in e.sides():
            if isinstance(s, Fork):
                path, text = folder / f"{s.name}.py", s.text()
                if not path.is_file() or path.read_text() != text:
                    folder.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(".py.tmp")
                    tmp.write_text(text)
                    os.replace(tmp, path)
                paths[s.name] = path
            else:
                paths[s] = REPO / f"{s}.py"
    return paths


def value(run: curves.Run, q: Quantity) -> float | None:
    """The run's value of the quantity; None when it logs none, or a value that is not finite (a diverged run: an
    earlier value is never taken for its last)."""
    rows = [r for r in run.rows if runfiles.is_number(r.get(q.metric))]
    if not rows or not all(np.isfinite(r[q.metric]) for r in rows):
        return None
    if q.measure == "final":
        return float(rows[-1][q.metric])
    if q.measure == "mean":
        return float(np.mean([r[q.metric] for r in rows]))
    if q.measure == "drop":
        return float(max(r[q.metric] for r in rows) - rows[-1][q.metric])
    x = np.array([r["step"] for r in rows], dtype=float)
    y = np.array([r[q.metric] for r in rows], dtype=float)
    return curves.area_under_curve(x, y, x[0], x[-1]) if x[-1] > x[0] else float(y[0])


@dataclass
class Side:
    script: str
    values: list[float] = field(default_factory=list)
    versions: set = field(default_factory=set)
    """the script hashes its seeds' runs recorded: more than one, and the seeds are not one program's sample"""

    def cell(self) -> str:
        if not self.values:
            return "no runs"
        lo, hi = curves.bootstrap_ci(np.array(self.values))
        return f"{np.mean(self.values):.3f} [{lo:.3f}, {hi:.3f}]" + (
            "" if len(self.values) >= curves.MIN_SEEDS_FOR_CI else f" ({len(self.values)} seeds)"
        )


def verdict(q: Quantity, base: Side, variant: Side) -> tuple[str, float | None]:
    """The verdict of one regime, and the smallest difference the seeds could separate."""
    if min(len(base.values), len(variant.values)) < curves.MIN_SEEDS_FOR_CI:
        return "not measured (fewer than 3 seeds)", None
    mixed = [f"{s.script}'s seeds ran {len(s.versions)} versions of it" for s in (base, variant) if len(s.versions) > 1]
    if mixed:  # a script edited between its seeds' runs: one sample is one program's; rerun the older seeds
        return f"not measured ({'; '.join(mixed)})", None
    (bl, bh), (vl, vh) = (curves.bootstrap_ci(np.array(s.values)) for s in (base, variant))
    smallest = ((bh - bl) + (vh - vl)) / 2
    diff = float(np.mean(variant.values) - np.mean(base.values))
    if q.direction == "equal":
        overlap = not (vh < bl or bh < vl)
        return ("shown" if overlap and abs(diff) <= q.tolerance else "not shown"), smallest
    if vh < bl or bh < vl:
        return ("shown" if (diff > 0) == (q.direction == "higher") else "opposite"), smallest
    return "not shown", smallest


VALUES = REPO / "benchmark" / "effects_values.json"
"""every recorded run's values of the quantities of its track's rows, by regime, host and run name, with what produced
it: the table's data (the runs themselves are not kept), written by `record` (and `run`, for its regime)"""


def host_key(host: dict | None) -> str:
    """A host as its record names it: the CPU, torch's kernel capability and the BLAS (one regime's rounding on one
    host: the native regime of two CPUs is two regimes, so their runs are never one sample)."""
    host = host or {}
    return " ".join(str(host[k]) for k in ("cpu", "cpu_capability", "blas") if host.get(k)) or " ".join(
        str(x) for x in host.values()
    )


def load(path: Path = VALUES) -> dict:
    """The record: regime -> host -> run name -> entry. An entry written as regime -> run name (before hosts were a
    level of their own) is moved under its host."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    for entries in data.values():
        for name in [n for n, v in entries.items() if "values" in v]:
            entry = entries.pop(name)
            entries.setdefault(host_key(entry.get("host")), {})[name] = entry
    return data


def record(workdir: Path, regime: str, seeds: list[int], path: Path = VALUES) -> list[str]:
    """The values of every finished run of the rows in the regime's runs folder, written into `path` under the host
    they ran on (a run recorded before on that host is replaced; others, and other hosts', are kept); returns the run
    names recorded."""
    runs_dir = (workdir if regime == "native" else regime_workdir(workdir, regime)) / "runs"
    data = load(path)
    mine = data.setdefault(regime, {})
    wanted: dict[str, list[Quantity]] = {}
    for e in EFFECTS:
        for s, track in e.sides():
            for seed in seeds:
                name = study.run_name(Path(f"{script_name(s)}.py"), track, seed)
                wanted.setdefault(name, []).extend(q for q in (e.quantity, *e.also) if q not in wanted.get(name, []))
    done = []
    for name, quantities in wanted.items():
        d = runs_dir / name
        if not runfiles.is_run_dir(d):
            continue
        run = curves.read_run(d)
        if not run.finished:  # a stopped run's last value is not its final one
            continue
        started = (run.provenance or {}).get("started", run.provenance or {})
        host = {k: started.get("host", {}).get(k) for k in ("cpu", "cpu_capability", "blas")}
        mine.setdefault(host_key(host), {})[name] = {
            "values": {q.label(): value(run, q) for q in quantities},
            "commit": started.get("git", {}).get("commit"),
            "script_sha256": started.get("script", {}).get("sha256"),
            "host": host,
        }
        done.append(name)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return done


def measure(e: Effect, recorded: dict, seeds: list[int], q: Quantity) -> tuple[Side, Side]:
    """Each script's values of `q` over the seeds one host's record of one regime holds (run name -> its entry)."""
    sides = []
    for s, track in e.sides():
        side = Side(script_name(s) if track == e.track else f"{script_name(s)} on {track}")
        for seed in seeds:
            entry = recorded.get(study.run_name(Path(f"{script_name(s)}.py"), track, seed))
            v = None if entry is None else entry["values"].get(q.label())
            if v is not None:
                side.values.append(v)
                side.versions.add(entry.get("script_sha256"))
        sides.append(side)
    return sides[0], sides[1]


@dataclass
class Result:
    host: str
    base: Side
    variant: Side
    verdict: str
    smallest: float | None


def results(e: Effect, q: Quantity, regime: dict, seeds: list[int]) -> list[Result]:
    """One regime's verdicts of `q`: one per host on which both scripts have every seed (a host's runs are one sample;
    two hosts' are never pooled); where none has, the host with the most runs, "not measured"."""
    out = []
    for host in sorted(regime):
        base, variant = measure(e, regime[host], seeds, q)
        out.append(Result(host, base, variant, *verdict(q, base, variant)))
    complete = [r for r in out if r.smallest is not None]
    if complete:
        return complete
    if not out:
        return [Result("", Side(script_name(e.base)), Side(script_name(e.variant)), *verdict(q, Side(""), Side("")))]
    return [max(out, key=lambda r: len(r.base.values) + len(r.variant.values))]


def regime_verdict(rs: list[Result]) -> str:
    """The regime's verdict: its hosts' when they agree, else each host's."""
    verdicts = {r.verdict for r in rs}
    return (
        rs[0].verdict if len(verdicts) == 1 else "differs by host: " + "; ".join(f"{r.host}: {r.verdict}" for r in rs)
    )


def short_host(host: str) -> str:
    return host.replace("(R)", "").replace("  ", " ") or "-"


def both_verdict(verdicts: list[str]) -> str:
    if len(set(verdicts)) == 1:
        return verdicts[0]
    return "not yet" if any("not measured" in v for v in verdicts) else "differ"


def brief(seeds: list[int], path: Path = VALUES) -> str:
    """One line a row: its deciding quantity under each regime (base, variant, smallest separable difference, verdict,
    host) and the row's verdict."""
    data = load(path)
    lines = [
        "| row | quantity, the paper's direction | native: base / variant (separable) | verdict | default: base / "
        "variant (separable) | verdict | both |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in EFFECTS:
        cells, verdicts = [], []
        for regime in ("native", "default"):
            rs = results(e, e.quantity, data.get(regime, {}), seeds)
            cell = "; ".join(
                f"{r.base.cell()} / {r.variant.cell()}"
                + ("" if r.smallest is None else f" ({r.smallest:.3f})")
                + (f", {short_host(r.host)}" if r.host else "")
                for r in rs
            )
            verdicts.append(regime_verdict(rs))
            cells += [cell, verdicts[-1]]
        q = e.quantity
        lines.append(f"| {e.key} | {q.label()}, {q.direction} | {' | '.join(cells)} | {both_verdict(verdicts)} |")
    return "\n".join(lines)


def table(seeds: list[int], path: Path = VALUES) -> str:
    data = load(path)
    lines = [
        "| row | quantity, the paper's direction | track | regime | host | base | variant | separable | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in EFFECTS:
        verdicts = []
        for regime in ("native", "default"):
            for q in (e.quantity, *e.also):
                rs = results(e, q, data.get(regime, {}), seeds)
                if q is e.quantity:
                    verdicts.append(regime_verdict(rs))
                name = f"**{q.label()}**, {q.direction}" if q is e.quantity else f"{q.label()}, {q.direction}"
                for r in rs:
                    lines.append(
                        f"| {e.key} | {name} | {e.track} | {regime} | {short_host(r.host)} | "
                        f"{r.base.script}: {r.base.cell()} | {r.variant.script}: {r.variant.cell()} | "
                        f"{'-' if r.smallest is None else f'{r.smallest:.3f}'} | {r.verdict} |"
                    )
        both = verdicts[0] if len(set(verdicts)) == 1 else " / ".join(verdicts)
        lines.append(f"| {e.key} | | | **both** | | | | | **{both}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["list", "run", "record", "table"])
    parser.add_argument("rows", nargs="*", help="run: the rows to run (their keys: `list`); default every row")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--workdir", default=".")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rounding", choices=sorted(ROUNDING), default="native")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--brief", action="store_true", help="table: one line a row, its deciding quantity")
    a = parser.parse_args(argv)
    unknown = [r for r in a.rows if r not in BY_KEY]
    if unknown:
        raise SystemExit(f"error: no row {', '.join(unknown)}; the rows are {', '.join(BY_KEY)}")
    effects = [BY_KEY[r] for r in a.rows] if a.rows else EFFECTS
    workdir = Path(a.workdir)
    if a.command == "list":
        for e in effects:
            print(f"{e.key}: {e.paper}: {e.claim}")
            (base, bt), (variant, vt) = e.sides()
            print(
                f"  {script_name(variant)}{'' if vt == bt else f' on {vt}'} against {script_name(base)} on {bt}: "
                f"{e.quantity.label()} {e.quantity.direction}; {e.design}"
            )
        return 0
    if a.command == "table":
        print(brief(a.seeds) if a.brief else table(a.seeds))
        return 0
    if a.command == "record":
        names = record(workdir, a.rounding, a.seeds)
        print(f"recorded {len(names)} runs of {a.rounding} into {VALUES}")
        return 0
    if a.rounding != "native":
        os.environ.update(ROUNDING[a.rounding])
        workdir = regime_workdir(workdir, a.rounding)
        workdir.mkdir(parents=True, exist_ok=True)
    paths = write_forks(effects, workdir / "runs" / "_effects")  # beside the runs: a checkout holds no copies
    failed = False
    on: dict[str, list[str]] = {}  # one study per track: the rows on it share their bases
    for e in effects:
        for s, track in e.sides():
            on.setdefault(track, [])
            if script_name(s) not in on[track]:
                on[track].append(script_name(s))
    for track, names in on.items():
        status = study.run_study(
            [str(paths[n]) for n in names], a.seeds, workdir, a.dry_run, a.jobs, name=f"effects_{track}", tracks=[track]
        )
        failed |= any(s == "failed" for s in status.values())
    if not a.dry_run:  # the runs are not kept: their values are (the table's data)
        names = record(Path(a.workdir), a.rounding, a.seeds)
        print(f"recorded {len(names)} runs of {a.rounding} into {VALUES}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
