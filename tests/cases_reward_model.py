"""Loss-aggregation invariance cases of reward_model.py (see tests/invariance.py): the Bradley-Terry loss is the mean
over the pairs of the whole batch, the process (PRM) loss the mean over the labelled steps of the whole batch, so pairs
of uneven lengths and solutions with uneven step counts, split into micro-batches and processes, must give the
gradient of that one mean."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from invariance import Case
from transformers import LlamaConfig, LlamaForSequenceClassification

import reward_model as rm

PAD = 0
CENTER = 0.01
BIAS = 0.25


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=50,
        pad_token_id=PAD,
        num_labels=1,
        attn_implementation="eager",
    )
    model = LlamaForSequenceClassification(config).float()
    model.config.reward_bias = BIAS
    return model


def _ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, 50, (n,), generator=g).tolist()


def _pairs() -> list[dict]:
    g = torch.Generator().manual_seed(2)
    out = []
    # (prompt, chosen response, rejected response) lengths and margins: uneven lengths in every micro-batch
    for p, c, r, m in [(3, 2, 5, 0.0), (5, 6, 1, 0.5), (2, 3, 3, 0.0), (4, 1, 7, 1.0), (6, 4, 2, 0.0), (1, 5, 5, 0.25)]:
        prompt = _ids(g, p)
        out.append({"chosen": prompt + _ids(g, c), "rejected": prompt + _ids(g, r), "margin": m})
    return out


def _solutions() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    # (tokens, steps): the halves hold 5 and 11 labelled steps; a step's label sits on its last token (the separator)
    for n, k in [(6, 1), (10, 3), (8, 1), (14, 5), (9, 2), (12, 4)]:
        labels = [-100] * n
        for pos in torch.randperm(n - 1, generator=g)[: k - 1].tolist() + [n - 1]:
            labels[pos] = int(torch.randint(0, 2, (), generator=g))
        out.append({"input_ids": _ids(g, n), "labels": labels})
    return out


def _reward(model, ids: list[int]) -> torch.Tensor:
    """The score head at the sequence's last token, alone (no padding), plus the stored bias."""
    return model(input_ids=torch.tensor([ids])).logits[0, 0] + BIAS


def outcome_reference(model, items: list[dict]) -> torch.Tensor:
    """(1/N) sum over pairs of [-log sigmoid(r_c - r_r - m) + coef * (r_c + r_r)^2] (Bradley-Terry with margin, Llama 2;
    reward centering, Eisenstein et al. 2023)."""
    total = 0.0
    for it in items:
        rc, rr = _reward(model, it["chosen"]), _reward(model, it["rejected"])
        total = total - F.logsigmoid(rc - rr - it["margin"]) + CENTER * (rc + rr) ** 2
    return total / len(items)


def process_reference(model, items: list[dict]) -> torch.Tensor:
    """(1/S) sum over every labelled step s of every solution of BCE(sigmoid(score at s's separator), label_s), S the
    labelled steps of the whole batch."""
    total, steps = 0.0, 0
    for it in items:
        scores = model.score(model.model(input_ids=torch.tensor([it["input_ids"]])).last_hidden_state)[0, :, 0]
        for pos, label in enumerate(it["labels"]):
            if label != -100:
                total = total + F.binary_cross_entropy_with_logits(scores[pos], torch.tensor(float(label)))
                steps += 1
    return total / steps


def _case(name: str, objective: str, items: list[dict], reference) -> Case:
    args = rm.Args(objective=objective, center_rewards_coef=CENTER)

    def collate(batch: list[dict]) -> dict:
        return rm.collate(batch, PAD, objective, pack=True)

    def step(accelerator, model, batch: list[dict], total: float) -> None:
        loss_sum, _ = rm.micro_batch_loss(model, collate(batch), args)
        accelerator.backward(
            loss_sum * (accelerator.gradient_accumulation_steps * accelerator.num_processes / max(total, 1.0))
        )  # as in main

    return Case(
        name,
        make_model,
        items,
        reference,
        lambda batch: float(rm.loss_units(collate(batch), objective)),
        step,
        lambda acc, c: rm.global_count(c, acc),
        micro_splits=(1, 3, 2),
    )


def cases() -> list[Case]:
    return [
        _case("reward_model/outcome-uneven-pairs", "outcome", _pairs(), outcome_reference),
        _case("reward_model/process-uneven-steps", "process", _solutions(), process_reference),
    ]
