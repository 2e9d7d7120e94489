"""The tiny offline world: generators for tiny-math and tiny-tldr, the gold judge and the answer checkers.

Everything here is pure Python (no torch), seeded, and deterministic, so that `benchmark.assets` writes
byte-identical files for the same seed. The judge and the checkers are short on purpose: the algorithm
scripts copy them verbatim (one algorithm, one file) to evaluate tiny presets, and
`tests/test_conventions.py` checks that the copies have not drifted from the versions here.

tiny-math
    Grade-school word problems with 1 to 4 arithmetic steps, in GSM8K's schema (`question`, `answer`
    ending in `#### <number>`) and in a MATH-style schema (`problem`, `solution` ending in
    `\\boxed{...}`, `answer`). Every step is one line, so per-step correctness is known; the `prm`
    files hold solutions with an injected arithmetic error in TRL's stepwise-supervision format
    (`prompt`, `completions`, `labels`).

tiny-tldr
    Reddit-like posts in the TL;DR query template of "The N+ Implementation Details of RLHF with PPO"
    (`SUBREDDIT: r/...\\n\\nTITLE: ...\\n\\nPOST: ...\\n\\nTL;DR:`), each built around three key facts
    (who, what happened, how the poster feels) surrounded by filler. Reference summaries are of mixed
    quality, as human-written TL;DRs are, so that a policy imitating them leaves room for RL. The gold
    judge scores a summary by the facts it covers, the facts it invents and its length; it labels the
    preference pairs and replaces the GPT-4 judge of the real track.
"""

from __future__ import annotations

import math
import random
import re

# ---------------------------------------------------------------------------------------------
# Gold judge for tiny-tldr (copied verbatim into the algorithm scripts; keep it self-contained)
# ---------------------------------------------------------------------------------------------

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


def win_rate(policy_scores: list[float], reference_scores: list[float]) -> float:
    """Share of prompts where the policy's summary beats the reference summary under the gold judge
    (ties count one half), the tiny track's stand-in for the GPT-4 win rate of the N+ paper."""
    wins = [1.0 if p > r else 0.5 if p == r else 0.0 for p, r in zip(policy_scores, reference_scores, strict=True)]
    return sum(wins) / max(len(wins), 1)


# ---------------------------------------------------------------------------------------------
# Answer checkers for tiny-math / GSM8K / MATH (copied verbatim into the algorithm scripts)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# tiny-math generator
# ---------------------------------------------------------------------------------------------

MATH_NAMES = ["Tom", "Ann", "Sam", "Mia", "Leo", "Zoe", "Max", "Eva", "Ben", "Ivy"]
MATH_ITEMS = ["apples", "pens", "coins", "books", "eggs", "cards", "shells", "stamps"]


def _math_step(rng: random.Random, value: int, item: str) -> tuple[str, str, int]:
    """One step of a word problem: (sentence in the question, operator, operand). Operands are single
    digits so that a 2M-parameter model can learn the arithmetic from a few thousand examples."""
    op = rng.choice(["add", "sub", "mul"] if value <= 9 else ["add", "sub"])
    if op == "sub" and value <= 2:
        op = "add"
    if op == "add":
        n = rng.randint(1, 9)
        return rng.choice([f"buys {n} more {item}", f"finds {n} more {item}", f"gets {n} more {item}"]), "+", n
    if op == "sub":
        n = rng.randint(1, min(value - 1, 9))
        return rng.choice([f"gives away {n} {item}", f"loses {n} {item}", f"sells {n} {item}"]), "-", n
    return "doubles the number of " + item, "*", 2


def make_math_problem(rng: random.Random, num_steps: int) -> dict:
    """A word problem with `num_steps` arithmetic steps, its step-by-step solution and its answer."""
    name, item = rng.choice(MATH_NAMES), rng.choice(MATH_ITEMS)
    value = rng.randint(2, 15)
    sentences, steps = [f"{name} has {value} {item}."], []
    for k in range(num_steps):
        text, op, n = _math_step(rng, value, item)
        new = value + n if op == "+" else value - n if op == "-" else value * n
        prefix = "Then he" if k else "He"
        if name in ("Ann", "Mia", "Zoe", "Eva", "Ivy"):
            prefix = "Then she" if k else "She"
        sentences.append(f"{prefix} {text}.")
        steps.append({"left": value, "op": op, "right": n, "result": new})
        value = new
    sentences.append(f"How many {item} does {name} have now?")
    return {"question": " ".join(sentences), "steps": steps, "final": value, "item": item}


def format_step(step: dict, item: str) -> str:
    return f"{step['left']} {step['op']} {step['right']} = {step['result']} {item}."


def gsm8k_row(p: dict, shortcut: bool = False) -> dict:
    """GSM8K schema; `shortcut`: the answer line alone, without the working."""
    lines = [] if shortcut else [format_step(s, p["item"]) for s in p["steps"]]
    return {"question": p["question"], "answer": "".join(line + "\n" for line in lines) + f"#### {p['final']}"}


def math_row(p: dict) -> dict:
    lines = [format_step(s, p["item"]) for s in p["steps"]]
    solution = "\n".join(lines) + f"\nThe answer is $\\boxed{{{p['final']}}}$."
    return {
        "problem": p["question"],
        "solution": solution,
        "answer": str(p["final"]),
        "level": f"Level {len(p['steps'])}",
    }


def prm_row(rng: random.Random, p: dict) -> dict:
    """A solution in TRL's stepwise-supervision format, one step per line exactly as the GSM8K-style
    answer writes it, the final `#### N` line included as the last step. Half of the solutions carry one
    error at a random step, of one of two kinds: a copy error (the step starts from a number that is not
    the previous result, then computes correctly) or an arithmetic error (the result is off by 10 to 20).
    Later steps compute correctly from the wrong value, so they are wrong too: a step is labelled correct
    iff its result (for the last line, its answer) equals the true running value."""
    steps = [dict(s) for s in p["steps"]]
    error_at = rng.randrange(len(steps)) if rng.random() < 0.5 else None
    error_kind = rng.choice(["copy", "arithmetic"])
    completions, labels, value = [], [], steps[0]["left"]
    for k, s in enumerate(steps):
        left = value
        if k == error_at and error_kind == "copy":
            left = rng.choice([v for v in range(max(1, value - 9), value + 10) if v != value])
        result = left + s["right"] if s["op"] == "+" else left - s["right"] if s["op"] == "-" else left * s["right"]
        if k == error_at and error_kind == "arithmetic":
            result = rng.choice([v for v in range(max(0, result - 20), result + 21) if abs(v - result) >= 10])
        value = result
        completions.append(f"{left} {s['op']} {s['right']} = {result} {p['item']}.")
        labels.append(result == s["result"])
    completions.append(f"#### {value}")
    labels.append(value == p["final"])
    return {"prompt": p["question"], "completions": completions, "labels": labels}


# Share of the SFT solutions (`sft/train`) that skip the working and state the answer straight away, as many
# human-written solutions do. A 2M-parameter model cannot do several steps of arithmetic in one token, so
# imitating a shortcut is mostly wrong on a multi-step problem while writing the steps out is mostly right.
# With shortcuts the more common kind, the greedy SFT policy takes the shortcut while its samples write the
# steps out about 40% of the time: the correct-answer reward can teach it to show its work (chain of thought
# in miniature: accuracy and response length rise together). `gsm8k/` and `math/` always show the steps.
MATH_SHORTCUT_RATE = 0.6


def make_tiny_math(seed: int, n_train: int, n_test: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    problems = {}
    seen: set[str] = set()
    for split, n in (("train", n_train), ("test", n_test)):
        rows = []
        while len(rows) < n:
            p = make_math_problem(rng, rng.randint(1, 4))
            if p["question"] in seen:  # the test split never repeats a training question
                continue
            seen.add(p["question"])
            rows.append(p)
        problems[split] = rows
    out = {}
    for split, rows in problems.items():
        out[f"gsm8k/{split}"] = [gsm8k_row(p) for p in rows]
        out[f"math/{split}"] = [math_row(p) for p in rows]
        out[f"prm/{split}"] = [prm_row(rng, p) for p in rows]
    # the SFT data: the training problems, some with shortcut answers; its own generator, so that adding it
    # changed none of the files above
    sft_rng = random.Random(seed + 7)
    out["sft/train"] = [gsm8k_row(p, shortcut=sft_rng.random() < MATH_SHORTCUT_RATE) for p in problems["train"]]
    out["sft/test"] = out["gsm8k/test"]
    return out


# ---------------------------------------------------------------------------------------------
# tiny-tldr generator
# ---------------------------------------------------------------------------------------------

TLDR_SUBREDDITS = ["relationships", "AskReddit", "personalfinance", "tifu", "jobs", "pets"]
TLDR_NAMES = ["Alex", "Jordan", "Sam", "Chris", "Taylor", "Morgan", "Jamie", "Casey"]
TLDR_EVENTS = {
    "rent": ["never pays the rent", "wants me to pay all the rent"],
    "car": ["crashed my car", "keeps borrowing my car"],
    "dog": ["hates my dog", "forgot to feed my dog"],
    "cat": ["is allergic to my cat", "let my cat out"],
    "wedding": ["did not invite me to the wedding", "wants to cancel the wedding"],
    "job": ["got me fired from my job", "lied about my job"],
    "phone": ["broke my phone", "reads my phone"],
    "laptop": ["spilled coffee on my laptop", "took my laptop"],
    "party": ["threw a party without me", "ruined my party"],
    "exam": ["made me miss my exam", "cheated on the exam"],
}
TLDR_FILLER = [
    "This has been going on for a while.",
    "I do not know what to do.",
    "Sorry for the long post.",
    "We have known each other for years.",
    "I tried talking about it once.",
    "Thanks for reading.",
    "It happened again last week.",
    "Everyone says I should let it go.",
]
TLDR_TITLES = [
    "Need advice about my {who}",
    "My {who} and the {what}",
    "Am I wrong to feel {feel}?",
    "What do I do about my {who}?",
]


def _summary(rng: random.Random, who: str, name: str, event: str, feel: str, quality: str, facts: list[str]) -> str:
    if quality == "missing_fact":
        # most often the summary stops before saying how the poster feels; sometimes it names the person
        # instead of saying who they are
        parts = [f"{name} {event}", f"I feel {feel}"] if rng.random() < 0.1 else [f"my {who} {event}"]
        return ", ".join(parts)
    if quality == "invented_fact":
        # the summary adds a person and an event that are not in the post
        other_who = rng.choice([w for w in TLDR_FACT_WORDS["who"] if w not in facts])
        other_what = rng.choice([w for w in TLDR_FACT_WORDS["what"] if w not in facts])
        return f"my {who} {event} and my {other_who} {rng.choice(TLDR_EVENTS[other_what])}, I feel {feel}"
    if quality == "long":
        return f"so basically my {who} {name} {event} and honestly I feel really {feel} about all of it"
    return f"my {who} {event}, I feel {feel}"


TLDR_QUALITIES = ["good", "missing_fact", "invented_fact", "long"]
# The reference summaries (SFT data) are of mixed quality, like human TL;DRs, and the most common kind
# is not the best: a greedy SFT policy imitates the mode (a summary that leaves out a fact), so RL towards
# the (learned) judge has room to do better than both the SFT policy and the references.
TLDR_REFERENCE_WEIGHTS = [0.2, 0.55, 0.1, 0.15]


def make_tldr_post(rng: random.Random, idx: int) -> dict:
    who = rng.choice(TLDR_FACT_WORDS["who"])
    what = rng.choice(TLDR_FACT_WORDS["what"])
    feel = rng.choice(TLDR_FACT_WORDS["feel"])
    name = rng.choice(TLDR_NAMES)
    event = rng.choice(TLDR_EVENTS[what])
    subreddit = rng.choice(TLDR_SUBREDDITS)
    title = rng.choice(TLDR_TITLES).format(who=who, what=what, feel=feel)
    filler = rng.sample(TLDR_FILLER, 2)
    body = [f"My {who} {name} {event}.", filler[0], f"I feel {feel} about it.", filler[1]]
    if rng.random() < 0.5:
        body[0], body[1] = body[1], body[0]
    post = " ".join(body)
    query = f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
    facts = [who, what, feel]
    return {
        "id": f"t3_{idx:06d}",
        "subreddit": subreddit,
        "title": title,
        "post": post,
        "query": query,
        "facts": facts,
        "_parts": (who, name, event, feel),
    }


def make_tiny_tldr(seed: int, n_sft: int, n_pref: int, n_eval: int) -> dict[str, list[dict]]:
    rng = random.Random(seed + 1)
    out: dict[str, list[dict]] = {}
    idx = 0
    for split, n in (("sft/train", n_sft), ("sft/validation", n_eval), ("sft/test", n_eval)):
        rows = []
        for _ in range(n):
            p = make_tldr_post(rng, idx)
            idx += 1
            quality = rng.choices(TLDR_QUALITIES, TLDR_REFERENCE_WEIGHTS)[0]
            summary = _summary(rng, *p.pop("_parts"), quality, p["facts"])
            # the response starts with a space, as in the N+ preprocessing (query ends with "TL;DR:")
            rows.append({**p, "summary": summary, "reference_response": " " + summary})
        out[split] = rows
    for split, n in (("preference/train", n_pref), ("preference/validation", n_eval * 2)):
        rows = []
        while len(rows) < n:
            p = make_tldr_post(rng, idx)
            idx += 1
            parts = p.pop("_parts")
            qa, qb = rng.sample(TLDR_QUALITIES, 2)
            a, b = (" " + _summary(rng, *parts, q, p["facts"]) for q in (qa, qb))
            sa, sb = gold_judge(a, p["facts"]), gold_judge(b, p["facts"])
            if sa == sb:  # the gold judge has no preference: a labeller would flip a coin, we skip it
                continue
            chosen, rejected = (a, b) if sa > sb else (b, a)
            # `confidence` mimics the 1-9 confidence of OpenAI's labellers: the gold score gap, bucketed
            confidence = min(9, 1 + int(8 * abs(sa - sb)))
            rows.append(
                {
                    **p,
                    "chosen": chosen,
                    "rejected": rejected,
                    "chosen_score": max(sa, sb),
                    "rejected_score": min(sa, sb),
                    "confidence": confidence,
                }
            )
        out[split] = rows
    return out


# ---------------------------------------------------------------------------------------------
# tiny-tldr-noisy: the same posts and SFT data, preference labels from a noisy, length-biased labeller
# ---------------------------------------------------------------------------------------------

# Human preference labels are noisy and favour longer answers (Singhal et al. 2023, "A Long Way to Go: Investigating
# Length Correlations in RLHF", arXiv:2310.03716). The labeller prefers a over b with probability
# sigmoid((gold(a) - gold(b)) / NOISY_TEMPERATURE + NOISY_LENGTH_BIAS * (words(a) - words(b))): a reward model
# trained on few such labels is an imperfect proxy of the gold judge that a policy can over-optimise (Gao et al.
# 2022, "Scaling Laws for Reward Model Overoptimization", arXiv:2210.10760).
NOISY_TEMPERATURE = 0.25
NOISY_LENGTH_BIAS = 0.3


def noisy_label(rng: random.Random, a: str, b: str, facts: list[str]) -> bool:
    """Whether the noisy, length-biased labeller prefers summary a over summary b."""
    margin = (gold_judge(a, facts) - gold_judge(b, facts)) / NOISY_TEMPERATURE
    margin += NOISY_LENGTH_BIAS * (len(a.split()) - len(b.split()))
    return rng.random() < 1.0 / (1.0 + math.exp(-margin))


def make_tiny_tldr_noisy(seed: int, n_pref: int, n_eval: int) -> dict[str, list[dict]]:
    """Preference pairs over new posts: `preference/train` labelled by the noisy labeller, `preference/validation` by
    the gold judge (ties skipped), so a reward model's validation accuracy is its accuracy against the gold judge."""
    rng = random.Random(seed + 2)
    out: dict[str, list[dict]] = {}
    idx = 10**6  # ids apart from tiny-tldr's
    for split, n, noisy in (("preference/train", n_pref, True), ("preference/validation", n_eval * 2, False)):
        rows = []
        while len(rows) < n:
            p = make_tldr_post(rng, idx)
            idx += 1
            parts = p.pop("_parts")
            qa, qb = rng.sample(TLDR_QUALITIES, 2)
            a, b = (" " + _summary(rng, *parts, q, p["facts"]) for q in (qa, qb))
            sa, sb = gold_judge(a, p["facts"]), gold_judge(b, p["facts"])
            if noisy:
                a_wins = noisy_label(rng, a, b, p["facts"])
            elif sa == sb:
                continue
            else:
                a_wins = sa > sb
            chosen, rejected = (a, b) if a_wins else (b, a)
            rows.append(
                {
                    **p,
                    "chosen": chosen,
                    "rejected": rejected,
                    "chosen_score": gold_judge(chosen, p["facts"]),
                    "rejected_score": gold_judge(rejected, p["facts"]),
                }
            )
        out[split] = rows
    return out
