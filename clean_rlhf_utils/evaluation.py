"""Evaluation harnesses: greedy responses to held-out prompts, scored by what the script passes in (its truncation, its
reward model's score, its task judge, its KL estimate). Nothing here changes a number: evaluating reads the policy and
never draws from the training's random stream (a sampled KL forks its own)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from clean_rlhf_utils.data import left_pad
from clean_rlhf_utils.engines import shard_length, zero3
from clean_rlhf_utils.packing import padded_attention


@torch.no_grad()
def evaluate_greedy_responses(
    policy,
    tokenizer,
    rows: list[dict],
    accelerator: Accelerator,
    batch_size: int,
    max_new_tokens: int,
    truncate: Callable,
    judge: Callable,
    score: Callable | None = None,
    kl: Callable | None = None,
    frozen: tuple = (),
) -> dict:
    """The means over `rows` (each with its `prompt_ids`) of `eval/completion_length`, `eval/eos_rate`, `eval/score`
    (with `score`), `eval/kl` (with `kl`) and of every value `judge` gives, in that order, for greedy responses of at
    most `max_new_tokens` tokens, cut by `truncate(responses)` (the script's stop rule; PAD after the end).
    `score(queries, responses)` and `kl(queries, qmask)` take a left-padded batch and give a list of one number per row,
    `judge(text, row)` a dict of numbers per row. The rows are split between the processes; `frozen`: the models that
    `score` and `kl` run, switched with the policy to padded attention (`padded_attention`)."""
    policy.eval()
    records = []
    # under ZeRO-3 every forward pass is a collective: every rank gets as many rows (the last one repeated), so as
    # many batches, and `generate` keeps stepping until every rank is done
    with accelerator.split_between_processes(rows, apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), batch_size):
            batch = shard[start : start + batch_size]
            queries, qmask = left_pad([r["prompt_ids"] for r in batch], tokenizer.pad_token_id)
            queries, qmask = queries.to(accelerator.device), qmask.to(accelerator.device)
            with padded_attention(policy, *frozen):
                out = policy.generate(
                    input_ids=queries,
                    attention_mask=qmask,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    synced_gpus=zero3(accelerator),
                )
                responses = truncate(out[:, queries.shape[1] :])
                scores = score(queries, responses) if score is not None else None
                kls = kl(queries, qmask) if kl is not None else None
            for i, (r, resp) in enumerate(zip(batch, responses)):
                rec = {
                    "completion_length": int((resp != tokenizer.pad_token_id).sum()),
                    "eos_rate": bool((resp == tokenizer.eos_token_id).any()),
                }
                if scores is not None:
                    rec["score"] = scores[i]
                if kls is not None:
                    rec["kl"] = kls[i]
                records.append({**rec, **judge(tokenizer.decode(resp, skip_special_tokens=True), r)})
    records = gather_object(records[: shard_length(len(rows), accelerator)])  # without the padded rows
    policy.train()
    return {f"eval/{k}": sum(r[k] for r in records) / len(records) for k in records[0]}
