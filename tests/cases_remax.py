"""Loss-aggregation invariance case for remax.py (issue 20): one micro-batch as `main` runs it
(`remax_micro_batch_loss`: `pack`, `packed_logprobs`, `remax_loss`, then its loss scale with the valid response tokens
of every micro-batch and process from `global_count`), against the official token mean over the whole batch.

The responses' lengths are uneven, so each micro-batch and each process holds a different number of tokens."""

from __future__ import annotations

import torch
from invariance import Case
from transformers import LlamaConfig, LlamaForCausalLM

import remax
from clean_rlhf_utils import engines

PAD, CAPACITY, TEMPERATURE = 0, 16, 0.7
# (prompt length, response length): the first half's responses hold 10 tokens, the second half's 17
SHAPES = [(3, 2), (4, 7), (5, 1), (2, 9), (6, 3), (3, 5)]


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


def plain_logprobs(model, query: list[int], response: list[int]) -> torch.Tensor:
    """The response's token logprobs under logits / T from one unpacked forward pass of query + response alone."""
    logits = model(input_ids=torch.tensor([query + response])).logits[0, len(query) - 1 : -1].float() / TEMPERATURE
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def make_items() -> list[dict]:
    """Token ids and per-token advantages A_t = clip(r - r_greedy, -c, c) - beta * KL_t (random here: the loss only
    reads them)."""
    g = torch.Generator().manual_seed(3)
    items = []
    for q, r in SHAPES:
        items.append(
            {
                "query": torch.randint(1, 50, (q,), generator=g).tolist(),
                "response": torch.randint(1, 50, (r,), generator=g).tolist(),
                "advantages": torch.randn(r, generator=g),
            }
        )
    return items


def reference(model, items):
    """The official ReMax loss (remax_trainer.py `actor_loss_fn`): sum(-A_t * log pi(y_t | x, y_<t) * mask) / mask.sum()
    over every valid response token of the batch."""
    losses = [-(it["advantages"] * plain_logprobs(model, it["query"], it["response"])) for it in items]
    return torch.cat(losses).sum() / sum(len(x) for x in losses)


def step(accelerator, model, items, total):
    width = max(len(it["response"]) for it in items)
    advantages = torch.zeros(len(items), width)
    for i, it in enumerate(items):
        advantages[i, : len(it["response"])] = it["advantages"]
    loss_sum, _ = remax.remax_micro_batch_loss(
        model, [it["query"] for it in items], [it["response"] for it in items], advantages, PAD, CAPACITY, TEMPERATURE
    )
    accelerator.backward(
        loss_sum * (accelerator.gradient_accumulation_steps * accelerator.num_processes / max(total, 1.0))
    )  # as in main


def cases() -> list[Case]:
    return [
        Case(
            "remax",
            make_model,
            make_items(),
            reference,
            count=lambda it: float(sum(len(x["response"]) for x in it)),
            step=step,
            global_count=lambda accelerator, count: engines.global_count(count, accelerator),
            micro_splits=(1, 3, 2),
        )
    ]
