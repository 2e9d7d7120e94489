"""Loss-aggregation invariance case for rloo.py (issue 20): one micro-batch as `main` runs it (`rloo_micro_batch_loss`:
`pack`, `packed_logprobs`, `sequence_logprobs`, `reinforce_loss`, then `accelerator.backward(loss)`), against the mean
over the batch's responses of the clipped sequence-level surrogate.

How `main` normalises: each micro-batch's loss is a mean over its responses, and every micro-batch holds
`micro_batch_size` responses (main refuses a batch that does not split evenly), so accelerate's 1 / accumulation steps
and DDP's average over processes make it the mean over the whole mini-batch. The case therefore splits the batch into
equal micro-batches as main does (2 + 2 here; two processes: 1 + 1 each); the responses' lengths stay uneven.
`global_count` is not used by RLOO's backward pass."""

from __future__ import annotations

import torch
from invariance import Case
from transformers import LlamaConfig, LlamaForCausalLM

import rloo

PAD, CAPACITY, TEMPERATURE, CLIPRANGE = 0, 16, 0.7, 0.2
# (prompt length, response length, advantage, old log pi(y|x) offset): offsets of +-0.5 put those ratios outside the
# clip
SHAPES = [(3, 2, 1.2, 0.0), (4, 7, -0.7, 0.5), (5, 1, 0.4, -0.5), (2, 9, -1.1, 0.05)]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=50,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(config).float().train()  # sdpa: the block-diagonal mask comes from the position ids


def plain_seq_logprob(model, query: list[int], response: list[int]) -> torch.Tensor:
    """log pi(y | x) under logits / T from one unpacked forward pass of query + response alone."""
    logits = model(input_ids=torch.tensor([query + response])).logits[0, len(query) - 1 : -1].float() / TEMPERATURE
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None]).sum()


def make_items() -> list[dict]:
    g = torch.Generator().manual_seed(2)
    model, items = make_model(), []
    for q, r, adv, offset in SHAPES:
        query, response = (
            torch.randint(1, 50, (q,), generator=g).tolist(),
            torch.randint(1, 50, (r,), generator=g).tolist(),
        )
        with torch.no_grad():
            old = plain_seq_logprob(model, query, response) + offset
        items.append({"query": query, "response": response, "advantage": adv, "old": old.item()})
    return items


def reference(model, items):
    """RLOO with TRL's sequence-level clip (rloo.py docstring): mean over responses i of
    max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps)), r_i = pi(y_i | x_i) / pi_old(y_i | x_i)."""
    losses = []
    for it in items:
        ratio = torch.exp(plain_seq_logprob(model, it["query"], it["response"]) - it["old"])
        a = it["advantage"]
        losses.append(torch.max(-a * ratio, -a * ratio.clamp(1 - CLIPRANGE, 1 + CLIPRANGE)))
    return torch.stack(losses).mean()


def step(accelerator, model, items, total):
    loss, _ = rloo.rloo_micro_batch_loss(
        model,
        [it["query"] for it in items],
        [it["response"] for it in items],
        torch.tensor([it["old"] for it in items]),
        torch.tensor([it["advantage"] for it in items]),
        PAD,
        CAPACITY,
        TEMPERATURE,
        CLIPRANGE,
    )
    accelerator.backward(loss)  # as main: the micro-batch's mean over its responses


def cases() -> list[Case]:
    items = make_items()
    return [
        Case(
            "rloo",
            make_model,
            items,
            reference,
            count=lambda it: float(len(it)),
            step=step,
            global_count=lambda accelerator, count: count,
            micro_splits=(2, 2),
        )
    ]
