"""Evaluation harnesses: greedy responses to held-out prompts, scored by functions the script passes in (its
truncation, its reward model scoring, its KL estimate, its answer check) and by the tiny world's gold judge (copied
verbatim from benchmark/tiny_world.py; tests/test_conventions.py checks the copy). Nothing here changes a
training number: evaluating draws no random number from the training's stream."""

from __future__ import annotations

import re

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from clean_rlhf_utils.data import left_pad
from clean_rlhf_utils.engines import shard_length, zero3

TLDR_FACT_WORDS = {
    "who": [
        "roommate",
        "boyfriend",
        "girlfriend",
        "boss",
        "sister",
        "brother",
        "neighbor",
        "friend",
        "coworker",
        "landlord",
    ],
    "what": ["rent", "car", "dog", "cat", "wedding", "job", "phone", "laptop", "party", "exam"],
    "feel": ["angry", "sad", "confused", "anxious", "happy", "jealous", "tired", "worried"],
}


TLDR_MAX_WORDS = 12


def gold_judge(summary: str, facts: list[str]) -> float:
    """Gold reward of a tiny-tldr summary: the share of the post's key `facts` it mentions, minus 0.5 for
    every fact word it invents (a fact word of the tiny world that is not one of this post's facts),
    minus 0.1 for every whitespace-separated token past TLDR_MAX_WORDS (digits and symbols count, so
    padding cannot dodge it). Repeated words count towards length, so repeating a fact cannot earn more
    than mentioning it once. Range: about [-inf, 1]; 1 is a perfect summary."""
    words = re.findall(r"[a-z]+", summary.lower())
    vocab = {w for group in TLDR_FACT_WORDS.values() for w in group}
    covered = sum(1 for f in facts if f in words) / len(facts)
    invented = len({w for w in words if w in vocab and w not in facts})
    too_long = max(0, len(summary.split()) - TLDR_MAX_WORDS)
    return covered - 0.5 * invented - 0.1 * too_long


@torch.no_grad()
def evaluate(
    policy,
    tokenizer,
    rows: list[dict],
    args,
    accelerator: Accelerator,
    truncate,
    reward_model=None,
    score=None,
    reference=None,
    kl=None,
    correct=None,
) -> dict:
    """Greedy responses (`generate`, up to `args.response_length` tokens) to the evaluation `rows` (from
    `data.prepare_prompts`), `truncate(responses, eos_id, pad_id)` applied, and their means over every process:
    length and EOS rate; `eval/score` with a reward model, `score(reward_model, queries, responses, pad_id)`;
    `eval/kl` with `--eval-kl` and a reference, `kl(policy, reference, queries, qmask, response_length, pad_id, eos_id,
    synced)`; `--eval-task tldr`: `eval/gold_reward` (`gold_judge`) and the win rate against the
    reference response; `gsm8k` / `boxed`: `eval/accuracy` (`correct(text, gold, answer_format)`)."""
    policy.eval()
    records = []
    # under ZeRO-3 every forward pass is a collective: every rank gets as many rows (the last one repeated), so as
    # many batches, and `generate` keeps stepping until every rank is done
    with accelerator.split_between_processes(rows, apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            batch = shard[start : start + args.per_device_eval_batch_size]
            queries, qmask = left_pad([r["prompt_ids"] for r in batch], tokenizer.pad_token_id)
            queries, qmask = queries.to(accelerator.device), qmask.to(accelerator.device)
            out = policy.generate(
                input_ids=queries,
                attention_mask=qmask,
                max_new_tokens=args.response_length,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                synced_gpus=zero3(accelerator),
            )
            responses = truncate(out[:, queries.shape[1] :], tokenizer.eos_token_id, tokenizer.pad_token_id)
            scores = [None] * len(batch)
            if reward_model is not None:
                scores = score(reward_model, queries, responses, tokenizer.pad_token_id).tolist()
            kls = [None] * len(batch)
            if args.eval_kl and reference is not None:
                kls = kl(
                    policy,
                    reference,
                    queries,
                    qmask,
                    args.response_length,
                    tokenizer.pad_token_id,
                    tokenizer.eos_token_id,
                    zero3(accelerator),
                )
            for r, resp, score_, kl_ in zip(batch, responses, scores, kls):
                text = tokenizer.decode(resp, skip_special_tokens=True)
                rec = {
                    "score": score_,
                    "kl": kl_,
                    "length": int((resp != tokenizer.pad_token_id).sum()),
                    "eos": bool((resp == tokenizer.eos_token_id).any()),
                }
                if args.eval_task == "tldr":
                    rec["gold_reward"], rec["reference_gold_reward"] = (
                        gold_judge(text, r["facts"]),
                        gold_judge(r["reference"], r["facts"]),
                    )
                elif args.eval_task in ("gsm8k", "boxed"):
                    rec["correct"] = correct(text, r["gold"], args.answer_format)
                records.append(rec)
    records = gather_object(records[: shard_length(len(rows), accelerator)])  # without the padded rows
    policy.train()
    n = len(records)
    metrics = {
        "eval/completion_length": sum(r["length"] for r in records) / n,
        "eval/eos_rate": sum(r["eos"] for r in records) / n,
    }
    if reward_model is not None:
        metrics["eval/score"] = sum(r["score"] for r in records) / n
    if args.eval_kl and reference is not None:
        metrics["eval/kl"] = sum(r["kl"] for r in records) / n
    if args.eval_task == "tldr":
        metrics["eval/gold_reward"] = sum(r["gold_reward"] for r in records) / n
        metrics["eval/win_rate"] = (
            sum(
                1.0
                if r["gold_reward"] > r["reference_gold_reward"]
                else 0.5
                if r["gold_reward"] == r["reference_gold_reward"]
                else 0.0
                for r in records
            )
            / n
        )
    elif args.eval_task in ("gsm8k", "boxed"):
        metrics["eval/accuracy"] = sum(r["correct"] for r in records) / n
    return metrics
