"""Loss-aggregation invariance cases for grpo_math.py (issue 20): GRPO, Dr. GRPO and DAPO, each one micro-batch as
`main` runs it (`pack`, then `micro_batch_loss`: `completion_logprobs`, `clipped_surrogate`, `k3_kl`, `aggregate_loss`,
then `accelerator.backward(loss * gradient_accumulation_steps)`), against each paper's aggregate over the whole batch.

How `main` normalises: grpo and dr_grpo divide by `num_sequences` = this process's mini-batch size (equal on every
process; DDP then averages the processes), so `global_count` is this process's count; dapo divides by
`mini_batch_norms`, the loss tokens of every process / the number of processes."""

from __future__ import annotations

import torch
from invariance import Case
from transformers import LlamaConfig, LlamaForCausalLM

import grpo_math as grpo
from clean_rlhf_utils import packing

PAD, CAPACITY, MAX_COMPLETION_LENGTH, TEMPERATURE, G = 0, 20, 16, 0.7, 3
# (prompt length, completion length, advantage): the first half's completions hold 12 tokens, the second half's 22
SHAPES = [(3, 2, 1.2), (4, 7, -0.7), (5, 3, 0.4), (3, 9, -1.1), (6, 1, 0.9), (4, 12, -0.3)]


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


def plain_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion's logprobs under logits / T from one unpacked forward pass of prompt + completion alone."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def make_items() -> list[dict]:
    """Token ids, advantages, and old / reference logprobs near the model's own (noise of 0.3 nats, so some ratios
    fall outside the clip range and some KL terms are large); groups of G, each item's prompt weight G / (its group's
    completion tokens) fixed over the whole batch, as `main` fixes it before splitting."""
    g = torch.Generator().manual_seed(1)
    model, items = make_model(), []
    for p, c, adv in SHAPES:
        prompt = torch.randint(1, 50, (p,), generator=g).tolist()
        completion = torch.randint(1, 50, (c,), generator=g).tolist()
        with torch.no_grad():
            lp = plain_logprobs(model, prompt, completion)
        items.append(
            {
                "prompt": prompt,
                "completion": completion,
                "advantage": adv,
                "old": lp + 0.3 * torch.randn(c, generator=g),
                "ref": lp + 0.3 * torch.randn(c, generator=g),
            }
        )
    for start in range(0, len(items), G):
        group = items[start : start + G]
        for it in group:
            it["weight"] = G / sum(len(x["completion"]) for x in group)
    return items


def padded(items: list[dict], key: str, width: int) -> torch.Tensor:
    out = torch.zeros(len(items), width)
    for i, it in enumerate(items):
        out[i, : len(it[key])] = it[key]
    return out


def make_case(name: str, args: grpo.Args, off_policy: bool, items: list[dict]) -> Case:
    grpo.resolve_variant(args)
    by_tokens = args.loss_aggregation == "token"

    def reference(model, items):
        """Per token (DeepSeekMath eq. 3, DAPO eq. 8): -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
        + beta * (exp(ref - logp) - (ref - logp) - 1), r = exp(logp - old); then grpo: mean over sequences of each
        sequence's token mean; dr_grpo: token sum / (sequences * max_completion_length); dapo: token sum / tokens;
        prompt (ScaleRL): mean over the groups of G of each group's token sum / its tokens."""
        losses = []
        for it in items:
            lp = plain_logprobs(model, it["prompt"], it["completion"])
            log_ratio = lp - (it["old"] if off_policy else lp.detach())
            if args.importance_sampling_level == "sequence":  # GSPO eq. 7: one ratio per sequence, the tokens' mean
                log_ratio = log_ratio.mean().expand_as(lp)
            ratio, a = torch.exp(log_ratio), it["advantage"]
            if args.loss_type == "cispo":  # MiniMax-M1 eq. 4: -sg(min(r, 1 + eps_high)) A log pi
                surrogate = -ratio.detach().clamp(max=1 + args.epsilon_high) * a * lp
            else:
                surrogate = -torch.min(ratio * a, ratio.clamp(1 - args.epsilon_low, 1 + args.epsilon_high) * a)
            d = it["ref"] - lp
            losses.append(surrogate + args.beta * (torch.exp(d) - d - 1))
        if args.loss_aggregation == "sequence":
            return torch.stack([x.mean() for x in losses]).mean()
        if args.loss_aggregation == "fixed":
            return torch.cat(losses).sum() / (len(losses) * MAX_COMPLETION_LENGTH)
        if args.loss_aggregation == "prompt":
            groups = [torch.cat(losses[i : i + G]) for i in range(0, len(losses), G)]
            return torch.stack([x.mean() for x in groups]).mean()
        return torch.cat(losses).sum() / sum(len(x) for x in losses)

    def count(items):  # main: dapo counts loss tokens, grpo / dr_grpo sequences (its mini-batch size)
        return float(sum(len(it["completion"]) for it in items)) if by_tokens else float(len(items))

    def global_count(accelerator, count):
        # mini_batch_norms of a mask holding `count` loss tokens: the tokens of every process / processes
        return grpo.mini_batch_norms(torch.ones(1, int(count)), args, accelerator)[1] if by_tokens else count

    def step(accelerator, model, items, total):
        packed = packing.pack_completions(
            [it["prompt"] for it in items], [it["completion"] for it in items], PAD, CAPACITY
        )
        width = packed["mask"].shape[1]
        old = padded(items, "old", width) if off_policy else None
        ref = padded(items, "ref", width) if args.beta > 0 else None
        advantages = torch.tensor([it["advantage"] for it in items])
        sequences, tokens = (None, total) if by_tokens else (int(total), None)  # the one aggregate_loss reads
        weights = torch.tensor([it["weight"] for it in items]) if args.loss_aggregation == "prompt" else None
        out = grpo.micro_batch_loss(
            model, packed, advantages, packed["mask"], old, ref, args, sequences, tokens, seq_weights=weights
        )
        n = accelerator.num_processes  # as in main
        accelerator.backward(out["loss"] * (accelerator.gradient_accumulation_steps * n / max(n, 1.0)))

    return Case(name, make_model, items, reference, count, step, global_count, micro_splits=(1, 3, 2))


def cases() -> list[Case]:
    items = make_items()
    common = {"temperature": TEMPERATURE, "max_completion_length": MAX_COMPLETION_LENGTH, "epsilon_low": 0.2}
    return [
        make_case("grpo_math/grpo", grpo.Args(loss_type="grpo", beta=0.04, epsilon_high=0.2, **common), True, items),
        make_case(
            "grpo_math/dr_grpo", grpo.Args(loss_type="dr_grpo", beta=0.04, epsilon_high=0.2, **common), False, items
        ),
        make_case("grpo_math/dapo", grpo.Args(loss_type="dapo", beta=0.0, epsilon_high=0.28, **common), True, items),
        make_case(
            "grpo_math/gspo",
            grpo.Args(importance_sampling_level="sequence", beta=0.0, epsilon_high=0.25, **common),
            True,
            items,
        ),
        make_case("grpo_math/cispo", grpo.Args(loss_type="cispo", beta=0.0, epsilon_high=0.3, **common), True, items),
        make_case(
            "grpo_math/cispo-prompt",
            grpo.Args(loss_type="cispo", loss_aggregation="prompt", beta=0.04, epsilon_high=0.3, **common),
            True,
            items,
        ),
    ]
