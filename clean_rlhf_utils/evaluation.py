"""Evaluation harnesses: they take the script's scoring as arguments and change no training number. Math questions:
greedy pass@1, and from k samples per question pass@k (any right), maj@k (the majority answer right) and mean@k."""

from __future__ import annotations

from collections import Counter

from accelerate.utils import gather_object

from clean_rlhf_utils.data import left_pad
from clean_rlhf_utils.engines import shard_length, zero3


def majority_vote(answers: list[str | None]) -> str | None:
    """The most common answer (None does not vote); ties go to the earliest sample."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


def vote_key(answer: str | None, answer_format: str) -> str | None:
    """Answers that vote together: GSM8K numbers by value (6, 6.0, 06; the extractor returns plain decimals), MATH
    LaTeX without spaces."""
    if answer is None:
        return None
    return repr(float(answer)) if answer_format == "gsm8k" else answer.replace(" ", "")


def evaluate_math(
    sample,
    tokenizer,
    rows: list[dict],
    accelerator,
    k: int,
    temperature: float,
    answer_format: str,
    success_reward,
    extract_answer,
    kl=None,
    kl_batch: int = 1,
) -> tuple[dict, list[dict]]:
    """k completions per evaluation question (`rows` of `prompt_ids`, `prompt`, `gold`; `sample(prompts, temperature)`
    returns the completions; k = 1 and T = 0: greedy pass@1, `eval/accuracy`); with k > 1 pass@k (any of the k right),
    maj@k (the majority answer right) and mean@k. The script's `success_reward(text, gold, answer_format)` grades and
    its `extract_answer(text, answer_format)` gives the answer that votes; `kl(queries, mask)` (--eval-kl) gives
    KL(pi || pi_ref) per prompt, `kl_batch` prompts at a time (`eval/kl`). Each process takes a shard; under ZeRO-3
    the shards are padded to equal size (every forward pass is a collective) and the padded duplicates dropped
    after."""
    records = []
    with accelerator.split_between_processes(rows, apply_padding=zero3(accelerator)) as shard:
        completions = sample([r["prompt_ids"] for r in shard for _ in range(k)], temperature)[0] if shard else []
        for j, row in enumerate(shard):
            outs = completions[j * k : (j + 1) * k]
            texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
            correct = [success_reward(t, row["gold"], answer_format) for t in texts]
            keys = [vote_key(extract_answer(t, answer_format), answer_format) for t in texts]
            vote = majority_vote(keys)
            records.append(
                {
                    "question": row["prompt"],
                    "gold": row["gold"],
                    "completion": texts[0],
                    "correct": correct,
                    "maj_correct": vote is not None and correct[keys.index(vote)] == 1.0,
                    "length": sum(len(o) for o in outs) / k,
                    "eos": sum(tokenizer.eos_token_id in o for o in outs) / k,
                }
            )
        if kl is not None:  # (--eval-kl) KL(pi || pi_ref) of one sample per question
            for start in range(0, len(shard), kl_batch):
                queries, qmask = left_pad(
                    [r["prompt_ids"] for r in shard[start : start + kl_batch]], tokenizer.pad_token_id
                )
                kls = kl(queries.to(accelerator.device), qmask.to(accelerator.device))
                for rec, value in zip(records[start : start + kl_batch], kls):
                    rec["kl"] = value
    records = gather_object(records[: shard_length(len(rows), accelerator)])  # without the padded rows
    n = len(records)
    if k == 1:
        metrics = {
            "eval/accuracy": sum(r["correct"][0] for r in records) / n,
            "eval/completion_length": sum(r["length"] for r in records) / n,
            "eval/eos_rate": sum(r["eos"] for r in records) / n,
        }
        if kl is not None:
            metrics["eval/kl"] = sum(r["kl"] for r in records) / n
        return metrics, records
    return {
        "eval/pass@k": sum(max(r["correct"]) for r in records) / n,
        "eval/maj@k": sum(r["maj_correct"] for r in records) / n,
        "eval/mean@k": sum(sum(r["correct"]) / k for r in records) / n,
        "eval/k": k,
    }, records
