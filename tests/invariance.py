"""Loss-aggregation invariance (issue 20), as verl and OpenRLHF test theirs: the same batch as one micro-batch, as
gradient accumulation over several micro-batches, and split over two processes gives the same gradient.

Each script contributes `Case`s from `tests/cases_<script>.py` (`cases()`); each case drives the script's own loss
functions and its own backward call, so the check covers the code `main` runs. `tests/test_invariance.py` runs the
single-process checks and launches `tests/invariance_check.py` on two gloo processes for the rest."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

CASE_MODULES = [
    "cases_sft",
    "cases_reward_model",
    "cases_dpo",
    "cases_ppo_rlhf",
    "cases_rloo",
    "cases_remax",
    "cases_grpo_math",
]


@dataclass
class Case:
    name: str
    make_model: Callable[[], torch.nn.Module]
    """a tiny model with fixed (seeded) random weights; called anew for every gradient computed"""
    items: list[Any]
    """the batch: one entry per example (a sequence, a pair, a group...), uneven lengths / valid counts on purpose"""
    reference: Callable[[torch.nn.Module, list[Any]], torch.Tensor]
    """the loss as the paper / docstring defines it over the whole batch (plain PyTorch, no accelerate)"""
    count: Callable[[list[Any]], float]
    """the units this script's mean divides by (tokens, pairs, sequences...) in some items"""
    step: Callable[[Accelerator, torch.nn.Module, list[Any], float], None]
    """one micro-batch as `main` runs it: the script's loss on these items and the script's backward call, given the
    whole mini-batch's count over every process (as `main` computes it before the micro-batches)"""
    global_count: Callable[[Accelerator, float], float]
    """the script's own reduction of this process's count to the count of every process"""
    micro_splits: tuple[int, ...] = (1, 2, 1)
    """item counts of the micro-batches for the accumulation check (must sum to len(items))"""
    atol: float = 1e-6
    rtol: float = 1e-5


def all_cases() -> list[Case]:
    out = []
    only = os.environ.get("INVARIANCE_ONLY")  # e.g. cases_sft,cases_dpo while developing
    for name in only.split(",") if only else CASE_MODULES:
        out += importlib.import_module(name).cases()
    return out


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().float()
            for p in model.parameters()
            if p.requires_grad
        ]
    )


def reference_grad(case: Case) -> torch.Tensor:
    model = case.make_model()
    case.reference(model, case.items).backward()
    return flat_grad(model)


def chunks(items: list, sizes: tuple[int, ...]) -> list[list]:
    assert sum(sizes) == len(items), f"micro_splits {sizes} do not cover {len(items)} items"
    out, start = [], 0
    for s in sizes:
        out.append(items[start : start + s])
        start += s
    return out


def accumulated_grad(case: Case, accelerator: Accelerator, local_items: list, sizes: tuple[int, ...]) -> torch.Tensor:
    """The gradient after len(sizes) accumulated micro-batches of `local_items` on this process (accelerator's
    gradient_accumulation_steps must equal len(sizes)); DDP averages over processes on the last one."""
    model = accelerator.prepare(case.make_model())
    micro = chunks(local_items, sizes)
    total = case.global_count(accelerator, sum(case.count(m) for m in micro))
    for m in micro:
        with accelerator.accumulate(model):
            case.step(accelerator, model, m, total)
    grad = flat_grad(accelerator.unwrap_model(model))
    accelerator.free_memory()
    return grad
