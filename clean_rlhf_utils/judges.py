"""Judges: what an evaluation scores with, and nothing a training loss reads. The tiny world's gold judge of tiny-tldr
summaries and the final-answer parsers of GSM8K and MATH (copies of benchmark/tiny_world.py's, kept equal by
tests/test_conventions.py's COPIED), the majority vote of maj@k, and `sampled_kl`, the KL estimate of `eval/kl` that
every RL script logs the same way (the x-axis of the benchmark's KL frontier; tests/test_frontier.py)."""

from __future__ import annotations

import re
from collections import Counter

import torch

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


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last `####` (GSM8K's final-answer marker), commas, `$` and a trailing period
    removed; None when there is no `####` followed by a number."""
    matches = re.findall(r"####\s*\$?\s*(-?[\d,]*\.?\d+)", text)
    if not matches:
        return None
    return matches[-1].replace(",", "").rstrip(".")


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (MATH's final-answer marker), with nested braces matched;
    None when there is none or its braces never close."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def numbers_equal(predicted: str | None, gold: str) -> bool:
    """Numeric comparison of two answer strings (so `6`, `6.0` and `06` agree); False for a missing or
    non-numeric prediction, never an exception."""
    if predicted is None:
        return False
    try:
        return abs(float(predicted.replace(",", "")) - float(gold.replace(",", ""))) < 1e-6
    except ValueError:
        return False


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


@torch.no_grad()
def sampled_kl(policy, reference, queries, qmask, response_length: int, pad_id: int, eos_id: int, synced: bool) -> list:
    """(--eval-kl) KL(pi || pi_ref) per prompt, estimated the same way in every script (the x-axis of the benchmark's
    gold-reward-against-KL frontier): one response sampled at temperature 1, then the sum over its tokens of
    log pi - log pi_ref (the unbiased k1 estimator, Schulman 2020 "Approximating KL Divergence"). Its own generator
    seeded from the prompts, so evaluating leaves the training's random stream alone and repeats exactly."""
    devices = [queries.device.index or 0] if queries.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(queries.sum()))
        out = policy.generate(
            input_ids=queries,
            attention_mask=qmask,
            max_new_tokens=response_length,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
            synced_gpus=synced,
        )
    responses = out[:, queries.shape[1] :]
    ended = (responses == eos_id).long()
    # the response up to its first EOS, from positions, not from the pad id: a sampled pad token is a token
    valid = (ended.cumsum(1) - ended == 0).long()
    mask = torch.cat([qmask, valid], 1)
    inputs = {
        "input_ids": torch.cat([queries, responses], 1).masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - mask).clamp(min=0),
    }
    kl = torch.zeros(len(queries), device=queries.device)
    for model, sign in ((policy, 1.0), (reference, -1.0)):
        logits = model(**inputs, logits_to_keep=responses.shape[1] + 1).logits[:, :-1].float()
        logprobs = torch.gather(logits.log_softmax(-1), 2, responses[..., None])[..., 0]
        kl += sign * (logprobs * valid).sum(1)
    return kl.tolist()
