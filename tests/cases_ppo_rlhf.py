"""Loss-aggregation invariance cases of ppo_rlhf.py (issue 20): a tiny PolicyAndValue (random Llama policy and value
model), query + response items of uneven lengths (one truncated without EOS), driven through `ppo_micro_batch`, the
function `main` runs for every micro-batch (its `pack`, losses and loss-scaled backward passes). The reference is the
definition: the clipped policy loss averaged over every valid response token of the batch, plus vf_coef times the
clipped value loss averaged over every valid value position (up to EOS+1), each sequence run alone."""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType
from invariance import Case
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

import ppo_rlhf as ppo
from clean_rlhf_utils import engines, packing

PAD, EOS, W = 0, 2, 6  # W: the rollout's width, response_length here
ARGS = ppo.Args(temperature=0.7, cliprange=0.2, cliprange_value=0.2, vf_coef=0.5)
QUERY_LENGTHS = [3, 5, 2, 4, 6, 3]
RESPONSE_LENGTHS = [2, 5, 1, 6, 3, 4]  # 6 = W without EOS: truncated, its score at its last token
KEYS = ("logprobs", "values", "returns", "advantages", "padding_mask", "padding_mask_p1")


def make_model() -> ppo.PolicyAndValue:
    torch.manual_seed(0)
    config = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=50,
        pad_token_id=PAD,
        eos_token_id=EOS,
        attention_dropout=0.0,
    )
    policy = LlamaForCausalLM(LlamaConfig(**config)).float()
    value_model = LlamaForSequenceClassification(LlamaConfig(**config, num_labels=1)).float()
    value_model.config.reward_bias = 0.3  # the value model starts as a reward model: its bias is part of every value
    for m in (policy, value_model):
        packing.use_packed_attention(m)
    return ppo.PolicyAndValue(policy, value_model)


def alone(model: ppo.PolicyAndValue, query: list[int], response: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of the response tokens (len(response),) and values at the W positions before each response token and
    at its last token, clamped (W,), from one unpacked forward pass under SDPA."""
    ids = torch.tensor([query + response])
    at = (torch.arange(W) + len(query) - 1).clamp(max=ids.shape[1] - 1)
    with packing.padded_attention(model.policy, model.value_model):
        logits = model.policy(input_ids=ids).logits[0, len(query) - 1 : -1].float() / (ARGS.temperature + 1e-7)
        hidden = model.value_model.model(input_ids=ids).last_hidden_state[0, at]
    logprobs = logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)
    return logprobs, model.value_model.score(hidden).squeeze(-1) + model.value_model.config.reward_bias


def make_items() -> list[dict]:
    """Rollout rows as main builds them: logprobs and values near the initial model's (so some ratios and values are
    clipped, some not), random returns and advantages, the masks of `main` (tokens past EOS; values past EOS+1)."""
    model, g = make_model(), torch.Generator().manual_seed(1)
    items = []
    for nq, nr in zip(QUERY_LENGTHS, RESPONSE_LENGTHS):
        query = torch.randint(3, 50, (nq,), generator=g).tolist()
        response = torch.randint(3, 50, (nr,), generator=g).tolist()
        if nr < W:
            response[-1] = EOS
        s = nr - 1  # index of the last real token
        idx = torch.arange(W)
        mask, mask_p1 = idx > s, idx > s + 1
        with torch.no_grad():
            logprobs, values = alone(model, query, response)
        old = torch.full((W,), ppo.INVALID_LOGPROB)
        old[:nr] = logprobs + 0.4 * torch.randn(nr, generator=g)
        items.append(
            {
                "query": query,
                "response": response,
                "logprobs": old,
                "values": (values + 0.4 * torch.randn(W, generator=g)).masked_fill(mask_p1, 0),
                "returns": torch.randn(W, generator=g).masked_fill(mask_p1, 0),
                "advantages": torch.randn(W, generator=g).masked_fill(mask, 0),
                "padding_mask": mask,
                "padding_mask_p1": mask_p1,
            }
        )
    return items


def reference(model: ppo.PolicyAndValue, items: list[dict]) -> torch.Tensor:
    """sum over every valid token of max(-A r, -A clip(r, 1 +- eps)) / tokens + vf_coef * 0.5 * sum over every
    valid value position of max((v - R)^2, (clip(v, v_old +- eps) - R)^2) / positions."""
    pg, vf, tokens, positions = 0.0, 0.0, 0, 0
    eps, eps_v = ARGS.cliprange, ARGS.cliprange_value
    for it in items:
        logprobs, values = alone(model, it["query"], it["response"])
        n, valid_p1 = len(it["response"]), ~it["padding_mask_p1"]
        ratio = torch.exp(logprobs - it["logprobs"][:n])
        adv = it["advantages"][:n]
        pg = pg + torch.max(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)).sum()
        v, v_old, ret = values[valid_p1], it["values"][valid_p1], it["returns"][valid_p1]
        vf = vf + 0.5 * torch.max((v - ret) ** 2, (v.clamp(v_old - eps_v, v_old + eps_v) - ret) ** 2).sum()
        tokens, positions = tokens + n, positions + int(valid_p1.sum())
    return pg / tokens + ARGS.vf_coef * vf / positions


def count(items: list[dict]) -> torch.Tensor:
    """(valid tokens, valid value positions): the two denominators of `ppo_micro_batch`'s means"""
    return torch.tensor(
        [
            float(sum((~it["padding_mask"]).sum() for it in items)),
            float(sum((~it["padding_mask_p1"]).sum() for it in items)),
        ]
    )


def global_count(accelerator, c: torch.Tensor) -> tuple[float, float]:
    return engines.global_count(c[0].item(), accelerator), engines.global_count(c[1].item(), accelerator)


def stepper(separate: bool):
    def step(accelerator, model, items: list[dict], total: tuple[float, float]) -> None:
        # main's default: separate backward passes in a plain single process only (DDP: one backward per step)
        separate_backward = separate and accelerator.distributed_type == DistributedType.NO
        rollout = {k: torch.stack([it[k] for it in items]) for k in KEYS}
        ppo.ppo_micro_batch(
            model,
            accelerator,
            [it["query"] for it in items],
            [it["response"] for it in items],
            rollout,
            total,
            ARGS,
            separate_backward,
            PAD,
        )

    return step


def cases() -> list[Case]:
    items = make_items()
    return [
        Case(
            f"ppo_rlhf_{name}",
            make_model,
            items,
            reference,
            count,
            stepper(separate),
            global_count,
            micro_splits=(1, 3, 2),
        )
        for name, separate in (("one_backward", False), ("separate_backward", True))
    ]
