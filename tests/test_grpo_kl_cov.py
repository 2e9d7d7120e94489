"""grpo_kl_cov.py, the KL-Cov fork of grpo_math.py (Cui et al. 2025, arXiv:2505.22617; issue 68): its loss against a
value computed by hand from verl's `compute_policy_loss_kl_cov`, its flags refused where they mean nothing, a run."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

import grpo_kl_cov as fork
from benchmark.tools import fork_check

# Two completions, 4 token slots each; row 1 has 2 loss tokens and 2 of padding, whose log pi (-9) would be the top
# covariance if padding were a candidate or entered the means.
LOGP = [[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.25, -9.0, -9.0]]
LOG_RATIO = [[0.1, -0.2, 0.3, 0.0], [-0.1, 0.2, 0.0, 0.0]]  # log pi - log pi_old
MASK = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
ADV = [2.0, -1.0]  # one per completion, as GRPO's


def _loss(monkeypatch, **fields):
    logp = torch.tensor(LOGP, requires_grad=True)
    monkeypatch.setattr(fork, "completion_logprobs", lambda model, packed, temperature, entropy_grad: (logp, logp * 0))
    args = dataclasses.replace(fork.Args(), beta=0.0, num_mini_batches=2, kl_cov_ratio=0.5, kl_cov_coef=2.0)
    args = dataclasses.replace(args, **fields)
    fork.resolve_variant(args)
    old = logp.detach() - torch.tensor(LOG_RATIO)
    out = fork.micro_batch_loss(None, {}, torch.tensor(ADV), torch.tensor(MASK), old, None, args, 2, 6.0)
    return out, logp


def test_kl_cov_loss_is_verls_by_hand(monkeypatch):
    """verl `compute_policy_loss_kl_cov`, by hand. The 6 loss tokens (padding left out of everything):
    mean A = (4 * 2 + 2 * -1) / 6 = 1, so A - mean A is 1 on row 0 and -2 on row 1;
    log pi: -1, -2, -0.5, -3 | -1.5, -0.25, sum -8.25, mean -1.375,
    centred 0.375, -0.625, 0.875, -1.625 | -0.125, 1.125;
    cov = (A - mean A) * (log pi - mean log pi): 0.375, -0.625, 0.875, -1.625 | 0.25, -2.25.
    k = max(1, int(6 * 0.5)) = 3, the largest covariances: 0.875 (row 0 token 2), 0.375 (0, 0), 0.25 (1, 0).
    Per token -A * ratio, no clip (token (0, 2) has ratio e^0.3 = 1.35 > 1.2 with A > 0: PPO would clip it):
    row 0: -2 * (e^0.1 + e^-0.2 + e^0.3 + e^0) = -2 * (1.105171 + 0.818731 + 1.349859 + 1) = -8.547521;
    row 1: +1 * (e^-0.1 + e^0.2) = 0.904837 + 1.221403 = 2.126240;
    the penalty on the 3 chosen: coef 2 * (|0.3| + |0.1| + |-0.1|) = 1.0.
    verl's token-mean (`--loss-aggregation token`): (-8.547521 + 2.126240 + 1.0) / 6 = -0.903547."""
    out, logp = _loss(monkeypatch, loss_aggregation="token")
    assert out["cut"].tolist() == [[True, False, True, False], [True, False, False, False]]
    assert not out["clipped"].any()  # no PPO clip: verl's pg_clipfrac is 0 under kl_cov
    rows = [-2 * sum(math.exp(x) for x in LOG_RATIO[0]), math.exp(-0.1) + math.exp(0.2)]
    assert rows == pytest.approx([-8.547521, 2.126240], abs=1e-6)
    assert out["loss"].item() == pytest.approx(-0.903547, abs=1e-6)
    assert out["surrogate"].item() == pytest.approx(-0.903547, abs=1e-6)  # loss/policy holds the penalty (no KL term)
    # the gradient of a chosen token: (-A * ratio + coef * sign(log ratio)) / 6, of another -A * ratio / 6
    out["loss"].backward()
    assert logp.grad[0, 2].item() == pytest.approx((-2 * math.exp(0.3) + 2) / 6, abs=1e-6)  # -0.116620
    assert logp.grad[1, 0].item() == pytest.approx((math.exp(-0.1) - 2) / 6, abs=1e-6)  # -0.182527
    assert logp.grad[0, 1].item() == pytest.approx(-2 * math.exp(-0.2) / 6, abs=1e-6)  # -0.272910
    assert logp.grad[1, 2:].tolist() == [0.0, 0.0]
    # grpo's own aggregation (the fork's default): each row's token mean, then the mean of the 2 rows:
    # row 0 (-8.547521 + 2 * (0.1 + 0.3)) / 4 = -1.936880, row 1 (2.126240 + 2 * 0.1) / 2 = 1.163120; mean -0.386880
    out, _ = _loss(monkeypatch)
    assert out["loss"].item() == pytest.approx(-0.386880, abs=1e-6)
    stats = fork.micro_batch_stats(out, torch.tensor(MASK), torch.tensor(MASK), first_pass=False)
    assert (stats["cut"].item(), stats["clipped"].item(), stats["tokens"].item()) == (3.0, 0.0, 6.0)


def test_kl_cov_takes_at_least_one_token_and_none_without_loss_tokens():
    logp, adv, mask = torch.tensor(LOGP), torch.tensor(ADV), torch.tensor(MASK)
    # verl's default 2e-4: int(6 * 2e-4) = 0, max(1, 0) = 1: the top covariance alone, 0.875 at (0, 2)
    assert fork.kl_cov_tokens(logp, adv, mask, fork.Args().kl_cov_ratio).nonzero().tolist() == [[0, 2]]
    assert not fork.kl_cov_tokens(logp, adv, torch.zeros(2, 4), 0.5).any()  # verl: k = min(ratio, 0) = 0
    tokens = torch.tensor([[2.0, 2.0, 2.0, 2.0], [-1.0, -1.0, 0.0, 0.0]])  # per-token advantages (B, T), as verl's
    assert fork.kl_cov_tokens(logp, tokens, mask, 0.5).equal(fork.kl_cov_tokens(logp, adv, mask, 0.5))
    assert (fork.Args().kl_cov_ratio, fork.Args().kl_cov_coef, fork.PARENT) == (2e-4, 1.0, "grpo_math")


def test_cispo_and_gspo_train_without_kl_cov(monkeypatch):
    defaults = {"kl_cov_ratio": 2e-4, "kl_cov_coef": 1.0}  # given, its flags would be refused (below)
    for fields in ({"loss_type": "cispo"}, {"importance_sampling_level": "sequence"}):
        out, _ = _loss(monkeypatch, **fields, **defaults)
        assert not out["cut"].any(), fields


def test_kl_cov_flags_are_refused_where_they_mean_nothing():
    """KL-Cov replaces PPO's clip on token ratios that can leave 1: under CISPO, GSPO's sequence ratio or on policy
    (|log ratio| 0, no gradient) its flags would be ignored; the clip's bounds have no clip to bound."""
    from clean_rlhf_utils.args import check_needs, check_ranges

    moving = {"num_mini_batches": 2}
    for fields, said in (
        ({"loss_type": "cispo", "kl_cov_ratio": 0.01, **moving}, "--kl-cov-ratio 0.01"),
        ({"importance_sampling_level": "sequence", "kl_cov_coef": 0.5, **moving}, "--kl-cov-coef 0.5"),
        ({"kl_cov_ratio": 0.01}, "--kl-cov-ratio 0.01"),  # one iteration, one mini-batch: on policy
    ):
        with pytest.raises(SystemExit, match=f"^error: {re.escape(said)} acts only with a token ratio that can "):
            check_needs(fork.Args(**fields))
    for partner in (moving, {"num_iterations": 2}, {"async_generation": True}):
        check_needs(fork.Args(kl_cov_ratio=0.01, kl_cov_coef=0.5, **partner))
    for fields, said in (
        ({"kl_cov_ratio": 1.5}, "--kl-cov-ratio is 1.5; it must be in (0, 1]"),
        ({"kl_cov_ratio": 0.0}, "--kl-cov-ratio is 0.0; it must be in (0, 1]"),
        ({"kl_cov_coef": 0.0}, "--kl-cov-coef is 0.0; it must be above 0"),
    ):
        with pytest.raises(SystemExit, match=f"^error: {re.escape(said)}$"):
            check_ranges(fork.Args(**fields))
    with pytest.raises(SystemExit, match=r"^error: --epsilon-high 0.28 bounds PPO's clip, which KL-Cov replaces"):
        fork.resolve_variant(fork.Args(epsilon_high=0.28))
    with pytest.raises(SystemExit, match=r"^error: --epsilon-low 0.1 bounds PPO's clip, .* --loss-type dapo\)"):
        fork.resolve_variant(fork.Args(loss_type="dapo", epsilon_low=0.1))
    fork.resolve_variant(fork.Args(loss_type="cispo", epsilon_high=2.0))  # CISPO's cap
    fork.resolve_variant(fork.Args(importance_sampling_level="sequence", epsilon_low=1e-3))  # GSPO's bounds


def test_the_fork_is_its_parent_and_its_recorded_variant(capsys):
    assert fork_check.main([fork.__file__]) == 0
    assert "grpo_math.py and its recorded variant (grpo_kl_cov.variant.diff), nothing else" in capsys.readouterr().out


def test_a_tiny_run_penalises_tokens_and_logs_them(assets, tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(0)  # untrained completions are never right: random rewards to learn from
    monkeypatch.setattr(fork, "success_reward", lambda text, gold, fmt: float(torch.rand(1, generator=gen) < 0.5))
    args = fork.Args(
        model_name_or_path=str(assets / "models" / "tiny-llama"),
        dataset_name_or_path=str(assets / "tiny-math" / "gsm8k"),
        dataset_config=None,
        prompt_template="Question: {question}\nAnswer:\n",
        max_prompt_length=96,
        questions_per_device=2,
        num_generations=4,
        total_steps=2,
        max_completion_length=12,
        micro_batch_size=4,
        num_mini_batches=2,
        learning_rate=1e-4,
        eval_every=2,
        num_eval_examples=4,
        pass_k=0,
        output_dir=str(tmp_path),
        run_name="kl_cov",
        num_threads=1,
        seed=3,
        kl_cov_ratio=0.1,
    )
    fork.main(args)
    rows = [json.loads(line) for line in (tmp_path / "kl_cov" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss/policy" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # int(0.1 * tokens) of each micro-batch, at least one, out of all the loss tokens
        assert 0.05 < r["policy/cut_frac"] <= 0.1 + 1e-6 and r["policy/clipfrac"] == 0.0, r
        assert math.isfinite(r["loss/policy"])
