"""The tiny world's gold judge, answer checkers and generators, on hand-written cases."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from benchmark import tiny_world as tw

FACTS = ["roommate", "rent", "angry"]


@pytest.mark.parametrize(
    "summary, expected",
    [
        (" my roommate never pays the rent, I feel angry", 1.0),  # all three facts, 9 words
        (" my roommate never pays the rent", 2 / 3),  # leaves out the feeling
        (" I do not know", 0.0),  # no fact at all
        (" my roommate never pays the rent, I feel sad", 2 / 3 - 0.5),  # "sad" is invented, "angry" missing
        (" my roommate never pays the rent, I feel angry and sad", 1.0 - 0.5),  # all facts, "sad" invented; 11 words
        (" my roommate never pays the rent, I feel sad sad and angry", 1.0 - 0.5),  # "sad" twice counts once; 12 words
        (" my roommate never pays the rent and so I feel very very angry about it", 1.0 - 0.1 * 3),  # 15 words
        (
            " my roommate never pays the rent and my boss crashed my car, I feel angry",
            1.0 - 0.5 * 2 - 0.1 * 3,
        ),  # boss, car invented; 15 words
        (
            " my roommate and my boss and my boss never pay the rent, I feel angry",
            1.0 - 0.5 * 1 - 0.1 * 3,
        ),  # boss counts once; 15 words
        (" so my roommate never ever pays the rent and I feel really really angry", 1.0 - 0.1 * 2),  # 14 words
        (
            " roommate roommate roommate roommate roommate roommate roommate roommate roommate roommate rent angry "
            "angry",
            1.0 - 0.1 * 1,
        ),
        (" MY ROOMMATE never pays the RENT, I feel Angry", 1.0),  # case does not matter
        ("", 0.0),
        (" ...!!", 0.0),
        (" my roommate is late with the rental, I feel angry", 2 / 3),  # "rental" is not "rent"
        (" my roommates want rent", 1 / 3),  # "roommates" is not "roommate" either: whole words only
        (" rent", 1 / 3),
        (" my roommate never pays the rent, I feel angry 1 2 3 4 5", 1.0 - 0.1 * 2),  # digits count towards length
        (" my roommate never pays the rent, I feel angry - - - - -", 1.0 - 0.1 * 2),  # so does punctuation
    ],
)
def test_gold_judge_hand_cases(summary, expected):
    assert tw.gold_judge(summary, FACTS) == pytest.approx(expected)


def test_gold_judge_repetition_never_beats_saying_it_once():
    once = tw.gold_judge(" my roommate never pays the rent, I feel angry", FACTS)
    assert tw.gold_judge(" my roommate never pays the rent, I feel angry angry angry", FACTS) == once  # 11 words
    assert tw.gold_judge(" my roommate never pays the rent, I feel angry angry angry angry angry angry", FACTS) < once


def test_win_rate_counts_ties_as_half():
    assert tw.win_rate([1.0, 0.5, 0.2, 0.7], [0.5, 0.5, 0.9, 0.1]) == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    with pytest.raises(ValueError):
        tw.win_rate([1.0], [0.5, 0.5])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("#### 42", "42"),
        ("3 + 4 = 7 apples.\n#### 7", "7"),
        ("so the total is 1,234\n#### 1,234", "1234"),
        ("#### $5", "5"),
        ("#### -3", "-3"),
        ("#### 2.5", "2.5"),
        ("#### 7.", "7"),
        ("#### 3\nwait, no\n#### 4", "4"),  # the last marker wins
        ("####12", "12"),
        ("   ####    8   ", "8"),
        ("#### 10 apples", "10"),  # units after the number are ignored
        ("so we get #### 12 and then some more text", "12"),  # marker in the middle, text after it
        ("#### 1,234.5", "1234.5"),
        ("#### 0", "0"),
        ("The answer is 42", None),  # no marker
        ("####", None),
        ("#### abc", None),
        ("", None),
        ("#### \n", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert tw.extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is $\\boxed{6}$.", "6"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{ 7 }", "7"),
        ("\\boxed{}", ""),
        ("\\boxed{x^{2}+1}", "x^{2}+1"),
        ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
        ("\\boxed{3", None),  # never closes
        ("the answer is 3", None),
        ("", None),
        ("\\boxed{(1, 2]}", "(1, 2]"),
        ("\\boxed{a}{b}", "a"),
        ("\\boxed{  x + 1  }", "x + 1"),
        ("\\boxed{1} and \\boxed{2", None),  # the last box is the answer, and it never closes
        ("\\boxed{\\sqrt{2}} so $\\boxed{\\sqrt{2}}$.", "\\sqrt{2}"),
    ],
)
def test_extract_boxed_answer(text, expected):
    assert tw.extract_boxed_answer(text) == expected


@pytest.mark.parametrize(
    "predicted, gold, expected",
    [
        ("6", "6.0", True),
        ("06", "6", True),
        ("1,000", "1000", True),
        ("6", "7", False),
        (None, "6", False),
        ("abc", "6", False),
        ("-2", "-2", True),
        ("2.50", "2.5", True),
        ("", "6", False),
        (" 6 ", "6", True),
    ],
)
def test_numbers_equal(predicted, gold, expected):
    assert tw.numbers_equal(predicted, gold) is expected


STEP = re.compile(r"^(-?\d+) ([+\-*]) (\d+) = (-?\d+) \w+\.$")  # a wrong solution can go negative


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def test_math_rows_are_consistent_and_checkable():
    data = tw.make_tiny_math(seed=3, n_train=300, n_test=50)
    assert [len(data[f"{kind}/{split}"]) for kind in ("gsm8k", "math", "prm") for split in ("train", "test")] == [
        300,
        50,
    ] * 3
    for row, mrow in zip(data["gsm8k/train"] + data["gsm8k/test"], data["math/train"] + data["math/test"], strict=True):
        *lines, final = row["answer"].split("\n")
        assert 1 <= len(lines) <= 4
        value = int(re.search(r"has (\d+)", row["question"]).group(1))
        for line in lines:
            a, op, b, c = STEP.match(line).groups()
            assert int(a) == value and int(c) == _apply(int(a), op, int(b))
            value = int(c)
        assert tw.extract_gsm8k_answer(row["answer"]) == str(value) and final == f"#### {value}"
        assert tw.extract_boxed_answer(mrow["solution"]) == mrow["answer"] == str(value)
        assert mrow["problem"] == row["question"] and mrow["level"] == f"Level {len(lines)}"
    train_questions = {r["question"] for r in data["gsm8k/train"]}
    assert not train_questions & {r["question"] for r in data["gsm8k/test"]}


def test_sft_rows_are_the_training_problems_some_without_working():
    data = tw.make_tiny_math(seed=3, n_train=1000, n_test=50)
    shortcuts = 0
    for sft, gsm in zip(data["sft/train"], data["gsm8k/train"], strict=True):
        assert sft["question"] == gsm["question"]
        # the same (right) final answer either way: a shortcut skips the working, it is not a wrong label
        assert tw.extract_gsm8k_answer(sft["answer"]) == tw.extract_gsm8k_answer(gsm["answer"])
        if sft["answer"] != gsm["answer"]:
            assert sft["answer"] == gsm["answer"].split("\n")[-1] and sft["answer"].startswith("#### ")
            shortcuts += 1
    assert abs(shortcuts / 1000 - tw.MATH_SHORTCUT_RATE) < 0.05
    assert data["sft/test"] == data["gsm8k/test"]  # evaluation always on full solutions' answers


def first_error_or_none(labels: list[bool]) -> int | None:
    return next((k for k, ok in enumerate(labels) if not ok), None)


def test_prm_labels_follow_the_true_running_value():
    data = tw.make_tiny_math(seed=4, n_train=400, n_test=10)
    with_error = 0
    for gsm, prm in zip(data["gsm8k/train"], data["prm/train"]):
        true_results = [int(STEP.match(line).group(4)) for line in gsm["answer"].split("\n")[:-1]]
        *steps, last = prm["completions"]
        assert len(prm["labels"]) == len(steps) + 1 and last.startswith("#### ")
        true_steps = [STEP.match(line).groups() for line in gsm["answer"].split("\n")[:-1]]
        assert prm["prompt"] == gsm["question"] and len(steps) == len(true_steps)
        previous = int(true_steps[0][0])  # the value the question starts from
        for k, step in enumerate(steps):
            a, op, b, c = STEP.match(step).groups()
            assert (op, b) == true_steps[k][1:3]  # an error changes a number, never the operation
            chains, computes = int(a) == previous, int(c) == _apply(int(a), op, int(b))
            if k == first_error_or_none(prm["labels"]):  # one error: a copy error or an arithmetic error, not both
                assert chains != computes
            else:  # every other step starts from the previous (possibly wrong) result and computes correctly
                assert chains and computes
            assert prm["labels"][k] == (int(c) == true_results[k])
            previous = int(c)
        assert last == f"#### {previous}"  # the final line states the solution's own (possibly wrong) result
        assert prm["labels"][-1] == (int(last[5:]) == true_results[-1])
        first_wrong = first_error_or_none(prm["labels"])
        if first_wrong is not None:
            with_error += 1
            assert not any(prm["labels"][first_wrong:])  # once wrong, every later step is wrong
    assert 0.35 < with_error / 400 < 0.65


def test_tldr_rows_follow_the_n_plus_template_and_pairs_follow_the_judge():
    data = tw.make_tiny_tldr(seed=5, n_sft=300, n_pref=300, n_eval=20)
    template = re.compile(r"^SUBREDDIT: r/\w+\n\nTITLE: .+\n\nPOST: .+\n\nTL;DR:$", re.S)
    assert [
        len(data[k]) for k in ("sft/train", "sft/validation", "sft/test", "preference/train", "preference/validation")
    ] == [300, 20, 20, 300, 40]
    for split in ("sft/train", "sft/validation", "sft/test", "preference/train", "preference/validation"):
        for row in data[split]:
            assert template.match(row["query"]) and row["post"] in row["query"] and row["title"] in row["query"]
            assert row["query"].startswith(f"SUBREDDIT: r/{row['subreddit']}\n\n")
            words = re.findall(r"[a-z]+", row["post"].lower())
            assert len(row["facts"]) == 3 and all(f in words for f in row["facts"])  # the post states its three facts
    for split in ("sft/train", "sft/validation", "sft/test"):
        for row in data[split]:
            assert row["reference_response"].startswith(" ") and row["reference_response"] == " " + row["summary"]
    for row in data["preference/train"] + data["preference/validation"]:
        assert row["chosen"].startswith(" ") and row["rejected"].startswith(" ")
        assert tw.gold_judge(row["chosen"], row["facts"]) > tw.gold_judge(row["rejected"], row["facts"])
        assert row["chosen_score"] == tw.gold_judge(row["chosen"], row["facts"])
        assert row["rejected_score"] == tw.gold_judge(row["rejected"], row["facts"])
        assert 1 <= row["confidence"] <= 9
    train = {r["query"] for r in data["sft/train"] + data["preference/train"]}
    held_out = {r["query"] for r in data["sft/validation"] + data["sft/test"] + data["preference/validation"]}
    assert not train & held_out
    assert len({r["id"] for split in data.values() for r in split}) == sum(len(v) for v in data.values())


def test_reference_summaries_leave_room_for_rl():
    rows = tw.make_tiny_tldr(seed=6, n_sft=2000, n_pref=0, n_eval=0)["sft/train"]
    scores = [round(tw.gold_judge(r["reference_response"], r["facts"]), 3) for r in rows]
    assert 0.5 < sum(scores) / len(scores) < 0.85
    mode, _ = Counter(scores).most_common(1)[0]
    assert mode < 1.0  # the most common reference is not the best summary, so imitation is not optimal
