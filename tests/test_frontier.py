"""The KL frontier (issue 22): the shared `eval/kl` estimator, the noisy preference data of tiny-tldr-noisy, and the
tables of benchmark/frontier.py on hand-made curves. The runs themselves are tested in tests/test_learning.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmark import tiny_world
from benchmark.frontier import Curve, best_within, frontier_tables, overoptimised, plot_frontier, read_curves
from clean_rlhf_utils import data, judges


@pytest.fixture(scope="module")
def models(assets):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizer")
    policy = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-neox").eval()
    reference = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-neox").eval()
    with torch.no_grad():  # a reference that differs from the policy
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return tokenizer, policy, reference


def _queries(tokenizer):
    texts = ["SUBREDDIT: r/advice\n\nTITLE: my roommate\n\nPOST: hello\n\nTL;DR:", "TL;DR:", "my dog ate the cake"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    return ids, data.left_pad(ids, tokenizer.pad_token_id)


def test_sampled_kl_is_the_k1_sum_over_each_sampled_response(models, monkeypatch):
    """KL(pi || pi_ref) ~ sum_t log pi(y_t | x, y_<t) - log pi_ref(y_t | x, y_<t), y ~ pi at temperature 1 (Schulman
    2020, k1): recomputed by hand on each prompt + response alone (no padding), the response cut after its first EOS
    (which counts); and the training's random stream is left as it was."""
    tokenizer, policy, reference = models
    ids, (queries, qmask) = _queries(tokenizer)
    sampled = []
    generate = policy.generate

    def generate_with_an_early_eos(**kw):  # a random model rarely samples EOS: put one in the first response
        out = generate(**kw)
        out[0, queries.shape[1] + 3] = tokenizer.eos_token_id
        sampled.append(out)
        return out

    monkeypatch.setattr(policy, "generate", generate_with_an_early_eos)
    before = torch.get_rng_state()
    kl = judges.sampled_kl(policy, reference, queries, qmask, 12, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
    assert torch.equal(torch.get_rng_state(), before)
    responses = sampled[0][:, queries.shape[1] :]
    expected = []
    for q, resp in zip(ids, responses.tolist()):
        resp = resp[: resp.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in resp else resp
        seq = torch.tensor([q + resp])
        total = 0.0
        for model, sign in ((policy, 1), (reference, -1)):
            with torch.no_grad():
                logp = model(seq).logits[0, len(q) - 1 : -1].double().log_softmax(-1)
            total += sign * sum(logp[t, tok].item() for t, tok in enumerate(resp))
        expected.append(total)
    assert any(len(r) > 1 for r in responses.tolist())
    np.testing.assert_allclose(kl, expected, atol=1e-4)
    # the same prompts draw the same responses whatever the training's random state (its own seed)
    torch.manual_seed(123)
    again = judges.sampled_kl(policy, reference, queries, qmask, 12, tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
    assert again == kl
    # the policy against itself: exactly 0 (eval/kl at step 0 of every run)
    assert judges.sampled_kl(policy, policy, queries, qmask, 12, tokenizer.pad_token_id, tokenizer.eos_token_id, 0) == [
        0.0
    ] * len(ids)


def test_noisy_labels_disagree_with_gold_and_validation_is_gold():
    """tiny-tldr-noisy: the training labels come from a noisy, length-biased labeller (a proxy the RM can only
    partly learn), the validation labels from the gold judge, so an RM's eval/accuracy is its accuracy against gold."""
    data = tiny_world.make_tiny_tldr_noisy(0, 1000, 200)
    train, val = data["preference/train"], data["preference/validation"]
    assert len(train) == 1000 and len(val) == 400
    agree = np.mean([r["chosen_score"] > r["rejected_score"] for r in train])
    assert 0.6 < agree < 0.85, agree
    longer = [np.mean([len(r["chosen"].split()) > len(r["rejected"].split()) for r in rows]) for rows in (train, val)]
    assert longer[0] > longer[1] + 0.2, longer  # the length bias: the longer summary wins far more often than by gold
    assert all(r["chosen_score"] > r["rejected_score"] for r in val)
    assert data == tiny_world.make_tiny_tldr_noisy(0, 1000, 200)  # seeded: the same files every build


def test_noisy_labeller_follows_its_formula():
    """P(a > b) = sigmoid((gold(a) - gold(b)) / 0.25 + 0.3 * (words(a) - words(b))), checked by frequency."""
    facts = ["boss", "car", "angry"]
    a, b = " my boss broke my car", " my boss broke my car, I feel angry"  # gold 2/3 and 1; a has 3 fewer words
    p = 1 / (1 + np.exp(-((2 / 3 - 1) / 0.25 + 0.3 * -3)))
    rng = random.Random(0)
    freq = np.mean([tiny_world.noisy_label(rng, a, b, facts) for _ in range(20000)])
    assert abs(freq - p) < 0.01, (freq, p)


def _curve(algo, penalty, seed, kl, gold, proxy=None):
    return Curve(
        algo, penalty, seed, np.array(kl, float), np.array(gold, float), None if proxy is None else np.array(proxy)
    )


def test_frontier_best_within_budget_and_over_optimisation():
    a = _curve("ppo", "kl0.005", 1, [0, 0.5, 1.5, 3.0], [0.6, 0.9, 1.0, 0.7], [-0.5, 1.0, 1.5, 1.6])
    b = _curve("ppo", "kl0.05", 1, [0, 0.3, 0.6], [0.6, 0.8, 0.95])
    assert best_within([a, b], 0.5) == {1: 0.9}  # a's 0.9 at KL 0.5 beats b's 0.8 at 0.3
    assert best_within([a, b], 1.0) == {1: 0.95}
    assert best_within([a, b], 10) == {1: 1.0}
    assert overoptimised(a)  # gold 1.0 -> 0.7 after its peak while the proxy rose 1.5 -> 1.6
    falling_proxy = _curve("dpo", "beta0.1", 1, [0, 1, 2], [0.6, 0.9, 0.5], [0, 1.0, 0.2])
    assert not overoptimised(falling_proxy)  # gold and proxy fall together: not the proxy's over-optimisation
    assert not overoptimised(_curve("ppo", "kl0.05", 1, [0, 1, 2], [0.6, 0.9, 0.85], [0, 1, 2]))  # a drop < 0.1


def test_frontier_table_separates_only_non_overlapping_intervals(tmp_path):
    curves = []
    for seed, (x, y, z) in enumerate([(0.90, 0.50, 0.88), (0.92, 0.52, 0.93), (0.91, 0.55, 0.90)], start=1):
        curves.append(_curve("online-dpo", "beta0.1", seed, [0, 0.2], [0.6, x], [0, 1]))
        curves.append(_curve("ppo", "kl0.05", seed, [0, 0.2, 1.0], [0.6, y, 1.0], [0, 1, 1.2]))
        curves.append(_curve("rloo", "kl0.05", seed, [0, 0.2], [0.6, z], [0, 1]))
    md = frontier_tables(curves, [0.25, 2.0])
    assert "KL <= 0.25: online-dpo > ppo" in md and "KL <= 0.25: rloo > ppo" in md
    assert "online-dpo > rloo" not in md and "rloo > online-dpo" not in md  # their intervals overlap
    assert "KL <= 2: ppo > online-dpo" in md  # with more KL, PPO reaches 1.0 in every seed
    row = next(line for line in md.splitlines() if line.startswith("| ppo |"))
    assert "1.000 [1.000, 1.000] (3)" in row
    plot_frontier(curves, "tiny-tldr-noisy", tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_one_seed_shows_its_value_and_the_order_at_each_budget(tmp_path):
    """The main job's frontier has one seed (issue 43): a cell is the value, not a zero-width interval, and the order
    of the algorithms at each KL budget is stated as a measured gap, not as a separation."""
    curves = [
        _curve("ppo", "kl0", 1, [0, 0.6, 2.6, 8.4], [0.673, 0.986, 1.0, 0.283], [-0.7, 1.8, 1.7, 3.3]),
        _curve("rloo", "kl0.005", 1, [0, 0.01, 0.03], [0.673, 0.8, 0.903], [-0.7, 0.2, 0.9]),
    ]
    md = frontier_tables(curves, [0.25, 1.0])
    row = next(line for line in md.splitlines() if line.startswith("| rloo |"))
    assert row == "| rloo | kl0.005 | 0.903 (1) | 0.903 (1) |"
    assert "Separated (non-overlapping 95% intervals over 3 or more seeds): none." in md
    assert "KL <= 0.25: rloo 0.903 > ppo 0.673; KL <= 1: ppo 0.986 > rloo 0.903." in md
    assert "| ppo | kl0 | 1 of 1 | 1.000 (2.60) -> 0.283 (8.40) | 1.70 -> 3.30 |" in md
    plot_frontier(curves, "tiny-tldr-noisy", tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_a_non_finite_evaluation_is_not_a_point_of_the_frontier(tmp_path, capsys):
    """A run that diverged keeps its finite evaluations; a NaN would make every budget's best NaN (np.max)."""
    run = tmp_path / "ppo-kl0.05_tiny-tldr-noisy__1"
    run.mkdir()
    rows = [
        {"step": 0, "episode": 0, "eval/kl": 0.0, "eval/gold_reward": 0.6, "eval/score": 0.1},
        {"step": 1, "episode": 8, "eval/kl": 0.2, "eval/gold_reward": 0.8, "eval/score": 0.5},
        {"step": 2, "episode": 16, "eval/kl": float("nan"), "eval/gold_reward": 0.9, "eval/score": 0.7},
        {"step": 3, "episode": 24, "eval/kl": 0.4, "eval/gold_reward": float("nan"), "eval/score": 0.9},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "done.json").write_text(json.dumps({"step": 3}))
    (curve,) = read_curves(tmp_path, "tiny-tldr-noisy")
    assert curve.kl.tolist() == [0.0, 0.2] and curve.gold.tolist() == [0.6, 0.8]
    assert "ppo-kl0.05_tiny-tldr-noisy__1: 2 of its 4 evaluations are not finite" in capsys.readouterr().err
    assert best_within([curve], 1.0) == {1: 0.8}


def test_the_frontier_is_a_command_over_any_runs_grouped_by_their_full_name(tmp_path, capsys):
    """Issue 49 item 5: `python -m benchmark.frontier --help` works, and runs of any name (a fork's,
    `rloo_batchmean_...`, no `-kl<v>` naming) are grouped by the name without `__<seed>`; the separation is stated."""
    from benchmark import frontier

    with pytest.raises(SystemExit) as exit_:
        frontier.main(["--help"])
    assert exit_.value.code == 0 and "RUN_DIR" in capsys.readouterr().out
    dirs = []
    for group, golds in (
        ("rloo_tiny-tldr-noisy", (0.90, 0.92, 0.91)),
        ("rloo_batchmean_tiny-tldr-noisy", (0.7, 0.72, 0.75)),
    ):
        for seed, gold in enumerate(golds, start=1):
            run = tmp_path / f"{group}__{seed}"
            run.mkdir()
            rows = [
                {"step": 0, "episode": 0, "eval/kl": 0.0, "eval/gold_reward": 0.6, "eval/score": 0.0},
                {"step": 1, "episode": 64, "eval/kl": 0.2, "eval/gold_reward": gold, "eval/score": 1.0},
            ]
            (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
            (run / "done.json").write_text("{}")
            dirs.append(str(run))
    out = tmp_path / "f"
    assert frontier.main([*dirs, "--budgets", "0.25", "1", "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| rloo_tiny-tldr-noisy | - | 0.910 [0.900, 0.920] (3) | 0.910 [0.900, 0.920] (3) |" in md
    assert "| rloo_batchmean_tiny-tldr-noisy | - | 0.723 [" in md
    assert "KL <= 0.25: rloo_tiny-tldr-noisy > rloo_batchmean_tiny-tldr-noisy" in md
    assert out.with_suffix(".png").stat().st_size > 10_000
    # runs without eval/kl: one error line that says what is missing
    plain = tmp_path / "plain" / "rloo_tiny-tldr__1"
    plain.mkdir(parents=True)
    (plain / "metrics.jsonl").write_text(json.dumps({"step": 0, "episode": 0, "eval/gold_reward": 0.6}) + "\n")
    (plain / "done.json").write_text("{}")
    capsys.readouterr()
    assert frontier.main([str(plain), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: no finished run of the 1 read has a point of the frontier: none logs eval/kl (run the scripts with "
        "--eval-kl)"
    ]


@pytest.mark.parametrize("budget", ["nan", "inf", "-0.5"])
def test_a_kl_budget_that_no_run_can_meet_or_every_run_meets_is_refused(budget, tmp_path, capsys):
    """Issue 67 item 7: `--budgets nan` was accepted (a column no run can fill); now one line before any run is read."""
    from benchmark import frontier

    with pytest.raises(SystemExit):
        frontier.main([str(tmp_path / "nothing"), "--budgets", "0.5", budget])
    assert f"argument --budgets: {budget} is not a KL budget (a finite number >= 0" in capsys.readouterr().err
