"""Metrics: what a training step logs, reduced over the processes (every process calls these in the same order: they
are collectives). The scripts compute every number; these sum, average and name them. Nothing here changes a number
that training reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from clean_rlhf_utils.engines import peak_mem_gb

if TYPE_CHECKING:
    from clean_rlhf_utils.runs import Run


def training_metrics(
    accelerator: Accelerator,
    losses: list,
    n_steps: int,
    means: dict,
    lr: float,
    epoch: int,
    episodes_per_sec: float,
    grad_norm,
) -> dict:
    """The training row logged every `--log-every` steps: each of `means` (lists of per-micro-batch scalars: accuracies,
    margins) averaged over its micro-batches and the processes; `train/loss`, the mean over the `n_steps` logged steps
    of each step's mean (`losses` holds each micro-batch's share of its step's mean over every process, so their sum
    over the processes is the sum of the steps' means); the learning rate, the epoch, the speed, the peak memory, and
    the gradient norm (None: DeepSpeed clips inside its own step and may report none). Every process calls it."""
    logged = {k: accelerator.gather(torch.stack(v).mean()[None]).mean().item() for k, v in means.items()}
    logged["train/loss"] = accelerator.gather(torch.stack(losses).sum()[None]).sum().item() / n_steps
    logged.update(
        {
            "lr": lr,
            "epoch": epoch,
            "perf/episodes_per_sec": episodes_per_sec,
            "perf/peak_mem_gb": peak_mem_gb(accelerator.device),
        }
    )
    if grad_norm is not None:
        logged["train/grad_norm"] = float(grad_norm)
    return logged


class StepSums:
    """The logged sums of one training step, one entry per micro-batch (or mini-batch) and name, reduced over the
    processes only when the step is logged: `total` sums every entry of every process, `mean` averages the processes'
    means, `max` takes the largest. Every process calls them in the same order (collectives)."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator, self.entries = accelerator, {}

    def add(self, **values: torch.Tensor) -> None:
        for name, value in values.items():
            self.entries.setdefault(name, []).append(value)

    def __contains__(self, name: str) -> bool:
        return bool(self.entries.get(name))

    def total(self, name: str) -> float:
        x = self.entries[name]
        return self.accelerator.reduce(torch.stack(x).sum().float().to(self.accelerator.device), "sum").item()

    def mean(self, x: torch.Tensor | str) -> float:
        """The mean of a tensor (or of a name's entries) over this process, averaged over the processes."""
        x = torch.stack(self.entries[x]) if isinstance(x, str) else x
        return self.accelerator.gather(x.float().mean().to(self.accelerator.device)[None]).mean().item()

    def max(self, name: str) -> float:
        return self.accelerator.reduce(torch.stack(self.entries[name]).max().to(self.accelerator.device), "max").item()

    def sum(self, x: torch.Tensor) -> float:
        """The sum of a tensor over every process."""
        return self.accelerator.reduce(x.float().sum().to(self.accelerator.device), "sum").item()

    def masked_mean(self, x: torch.Tensor, where: torch.Tensor) -> float | None:
        """The mean of `x` over its elements where `where` holds, over every process; None where none holds."""
        count = self.sum(where.float())
        return self.sum(x.float() * where.float()) / count if count else None


def log_global_means(run: Run, accelerator: Accelerator, tensors: dict, scalars: dict, step: int, episode: int) -> dict:
    """Logs the mean of each tensor of `tensors` over all its elements and every process (in order: a collective per
    tensor), then `scalars` as they are; returns the logged row."""
    logged = {k: accelerator.gather(v.float().mean()[None]).mean().item() for k, v in tensors.items()}
    logged.update(scalars)
    run.log(logged, step, episode)
    return logged


STATISTICS = {  # `ppo_micro_batch`'s statistics, averaged over the micro-batches of every process
    "approxkl": "policy/approxkl_avg",
    "clipfrac": "policy/clipfrac_avg",
    "pg_loss": "loss/policy_avg",
    "vf_loss": "loss/value_avg",
    "vf_clipfrac": "val/clipfrac_avg",
    "ratio": "val/ratio",
}


def statistics_to_log(per_row: dict, stats: list[dict], step_rewards, n_steps) -> dict:
    """The tensors whose means over every process are logged (`log_global_means`): the rollout's `per_row`, the
    micro-batches' `stats` and the process rewards and steps, if any."""
    tensors = per_row | {name: torch.stack([s[k] for s in stats]) for k, name in STATISTICS.items()}
    if step_rewards is not None:
        tensors["objective/process_reward"] = step_rewards.sum(1)
        tensors["objective/num_steps"] = torch.tensor(n_steps, dtype=torch.float, device=step_rewards.device)
    return tensors


def log_evaluation(run: Run, accelerator: Accelerator, metrics: dict, step: int, episode: int, when: str) -> None:
    run.log(metrics, step, episode)
    accelerator.print(f"{when}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


def grouped_step_metrics(
    sums: StepSums, data: dict, args, B: int, lr: float, speed: float, teacher_kl=None, kl: bool = False
) -> dict:
    """grpo_math.py's step 5 training metrics, over every process: the rewards of every sampled completion (kept by
    dynamic sampling or not), the loss and its pieces from the micro-batches' `sums` (B completions per process were
    trained on), the sampler-trainer mismatch, `teacher_kl` per completion (distillation) and the KL to the reference
    (`kl`)."""
    everything, G, processes = data["everything"], args.num_generations, sums.accelerator.num_processes
    tokens = max(sums.total("tokens"), 1.0)
    logged = {
        "objective/reward": sums.mean(everything["reward"]),
        "objective/reward_std": sums.mean(everything["reward"].view(-1, G).std(dim=1)),
        "objective/entropy": sums.total("entropy") / (B * processes),
        "objective/completion_length": sums.mean(everything["lengths"]),
        "objective/num_steps": sums.mean(everything["num_steps"]),
        "objective/truncated_rate": sums.mean(everything["truncated"]),
        "loss/policy": sums.mean("loss"),
        "policy/clipfrac": sums.total("clipped") / tokens,
        "policy/ratio": sums.total("ratio") / tokens,
        "train/grad_norm": sums.mean("grad_norm"),
        "lr": lr,
        "perf/episodes_per_sec": speed,
        "perf/peak_mem_gb": peak_mem_gb(sums.accelerator.device),
        **{
            f"objective/{k}": sums.mean(everything[k])
            for k in ("success", "format", "overlong", "outcome_rm", "process_rm")
            if k in everything
        },
    }
    # per token, as Cui et al. 2025 (arXiv:2505.22617) and verl measure it: objective/entropy sums each completion's
    # tokens, so it grows with the length
    logged["objective/token_entropy"] = sums.total("entropy") / max(sums.sum(data["batch"]["lengths"]), 1.0)
    if "success" in everything:  # the lengths of right and wrong answers: Dr. GRPO's claim (Liu et al. 2025)
        for name, where in (("correct", everything["success"] > 0), ("incorrect", everything["success"] <= 0)):
            if (length := sums.masked_mean(everything["lengths"], where)) is not None:
                logged[f"objective/{name}_length"] = length
    if "cut" in sums:  # tokens a variant cut or penalised (grpo_clip_cov.py, grpo_kl_cov.py)
        logged["policy/cut_frac"] = sums.total("cut") / tokens
    if teacher_kl is not None:  # reverse KL(student || teacher) per completion, from the student's samples
        logged["objective/teacher_kl"] = sums.mean(teacher_kl)
    if "is_weight" in sums:  # the sampler-trainer mismatch, and its correction (Yao et al. 2025)
        first = max(sums.total("first_tokens"), 1.0)
        logged["mismatch/abs_logprob_diff"] = sums.total("mismatch_abs") / first
        logged["mismatch/max_abs_logprob_diff"] = sums.max("mismatch_max")
        logged["mismatch/ratio_error"] = sums.total("ratio_error") / first
        logged["mismatch/is_weight"] = sums.total("is_weight") / tokens
        logged["mismatch/capped_frac"] = sums.total("is_capped") / tokens
    if kl:  # summed over each response's tokens, averaged over responses; beta 0 has no reference
        logged["objective/kl"] = sums.total("kl") / (B * processes)
    if args.dynamic_sampling:
        logged["objective/groups_dropped"] = sums.mean(
            torch.tensor(data["dropped"] / (len(everything["completions"]) // G))
        )
        logged["perf/sampling_rounds"] = sums.mean(torch.tensor(float(data["rounds"])))
    return logged
