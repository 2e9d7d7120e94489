"""Loss-aggregation invariance cases of sft.py (see tests/invariance.py): the SFT loss is the mean next-token
cross-entropy over the response tokens of the whole batch, so sequences with uneven response lengths split into
micro-batches and processes must give the gradient of that one mean."""

from __future__ import annotations

import torch
from invariance import Case
from transformers import LlamaConfig, LlamaForCausalLM

import sft

PAD = 0


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
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).float()


def _examples() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    # (prompt length, response length): uneven, so each half and each micro-batch holds a different number of tokens
    shapes = [(3, 1), (2, 7), (4, 2), (1, 5), (5, 9), (2, 3)]
    ids = lambda n: torch.randint(1, 50, (n,), generator=g).tolist()  # noqa: E731
    return [{"prompt_ids": ids(p), "response_ids": ids(r)} for p, r in shapes]


def reference(model, items: list[dict]) -> torch.Tensor:
    """sum over every response token t of every sequence of -log p(y_t | x, y_<t), divided by the number of those
    tokens: each sequence on its own, no padding."""
    nll, tokens = 0.0, 0
    for it in items:
        ids = torch.tensor([it["prompt_ids"] + it["response_ids"]])
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        targets = ids[0, 1:]
        start = len(it["prompt_ids"]) - 1  # the logits at the last prompt token predict the first response token
        nll = nll - logp[start:].gather(1, targets[start:, None]).sum()
        tokens += len(it["response_ids"])
    return nll / tokens


def count(items: list[dict]) -> float:
    return float(sft.response_tokens(sft.collate_right_padded(items, PAD)))


def step(accelerator, model, items: list[dict], total: float) -> None:
    batch = sft.collate_right_padded(items, PAD)
    accelerator.backward(
        sft.micro_batch_loss(model, batch)
        * (accelerator.gradient_accumulation_steps * accelerator.num_processes / max(total, 1.0))
    )


def cases() -> list[Case]:
    return [
        Case(
            "sft/uneven-response-lengths",
            make_model,
            _examples(),
            reference,
            count,
            step,
            lambda acc, c: sft.global_count(c, acc),
            micro_splits=(1, 3, 2),
        )
    ]
