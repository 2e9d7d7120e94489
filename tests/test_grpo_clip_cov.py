"""grpo_clip_cov.py, the Clip-Cov fork of grpo_math.py (Cui et al. 2025, arXiv:2505.22617; issue 60): the tokens it
cuts, by hand."""

from __future__ import annotations

import dataclasses

import torch

import grpo_clip_cov as fork


def test_clip_cov_cuts_random_tokens_inside_the_covariance_band_that_ppo_did_not_clip():
    # A and log pi of 4 loss tokens: mean A 0, mean log pi -1.625, covariances A * (log pi + 1.625):
    # 1.25, 2.75, 2.25, 0.75; the band (1, 5) holds tokens 0, 1 and 2
    logp = torch.tensor([[-1.0, -3.0, -0.5, -2.0]], requires_grad=True)
    adv, mask = torch.tensor([[2.0, -2.0, 2.0, -2.0]]), torch.ones(1, 4)
    args = dataclasses.replace(fork.Args(), clip_cov_ratio=0.5)  # int(0.5 * 4) = 2 tokens cut
    clipped = torch.tensor([[False, True, False, False]])  # PPO clipped token 1: not a candidate
    keep = fork.clip_cov_keep(logp, adv, mask, clipped, args)
    assert keep.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    (keep * -adv * logp).sum().backward()  # the cut tokens get no gradient, the others -A
    assert logp.grad.tolist() == [[0.0, 2.0, 0.0, 2.0]]
    # the paper's ratio: max(1, int(2e-4 * 4)) = 1 token, one of the three candidates
    for seed in range(5):
        torch.manual_seed(seed)
        cut = fork.clip_cov_keep(logp, adv, mask, torch.zeros(1, 4, dtype=torch.bool), fork.Args()) == 0
        assert cut.sum() == 1 and not cut[0, 3]
    # padding is never a candidate, nor does it enter the means
    padded = fork.clip_cov_keep(
        torch.tensor([[-1.0, -3.0, -0.5, -2.0, 9.0]]), torch.tensor([[2.0, -2.0, 2.0, -2.0, 9.0]]),
        torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]]), torch.zeros(1, 5, dtype=torch.bool), args,
    )  # fmt: skip
    assert padded[0, 4] == 1 and padded[0, 3] == 1 and (padded[0, :3] == 0).sum() == 2
    assert fork.PARENT == "grpo_math" and (fork.Args().clip_cov_lb, fork.Args().clip_cov_ub) == (1.0, 5.0)


def test_the_tokens_cut_are_logged_apart_from_ppos_clip(monkeypatch):
    """Issue 69: `policy/clipfrac` counted PPO's clipped tokens and the tokens Clip-Cov cut together; verl's
    `pg_clipfrac` under clip_cov counts the cut ones alone. The 4 tokens of the test above, off-policy: token 1's ratio
    exp(-0.5) = 0.61 < 1 - 0.2 with A < 0, so PPO clips it; Clip-Cov cuts the other two candidates, tokens 0 and 2
    (ratio 0.5 of 4 tokens): 1 token clipped, 2 cut, logged apart."""
    logp = torch.tensor([[-1.0, -3.0, -0.5, -2.0]], requires_grad=True)
    monkeypatch.setattr(fork, "completion_logprobs", lambda model, packed, temperature, entropy_grad: (logp, logp * 0))
    args = dataclasses.replace(fork.Args(), clip_cov_ratio=0.5, beta=0.0)
    fork.resolve_variant(args)
    old = logp.detach() + torch.tensor([[0.0, 0.5, 0.0, 0.0]])  # token 1: ratio exp(-0.5) = 0.61 < 1 - 0.2, A < 0
    adv, mask = torch.tensor([[2.0, -2.0, 2.0, -2.0]]), torch.ones(1, 4)
    out = fork.micro_batch_loss(None, {}, adv, mask, old, None, args, 1, 4.0)
    assert out["clipped"].tolist() == [[False, True, False, False]]
    assert out["cut"].tolist() == [[True, False, True, False]]
    stats = fork.micro_batch_stats(out, mask, mask, first_pass=False)
    assert (stats["clipped"].item(), stats["cut"].item(), stats["tokens"].item()) == (1.0, 2.0, 4.0)
    out["loss"].backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0 and logp.grad[0, 3] != 0  # the cut tokens: no gradient


def test_clip_cov_flags_that_would_cut_nothing_are_refused():
    """Issue 67 item 6: under --loss-type cispo (no PPO clip, no Clip-Cov), with an empty covariance window, or with
    a share of tokens above 1, Clip-Cov's flags trained silently; each is now one error line before anything loads."""
    import re

    import pytest

    from clean_rlhf_utils.args import check_needs, check_ranges

    for args, said in (
        (fork.Args(loss_type="cispo", clip_cov_ratio=0.01), "--clip-cov-ratio 0.01 acts only with a --loss-type with"),
        (fork.Args(clip_cov_lb=6.0), "--clip-cov-lb 6.0 acts only with a --loss-type with PPO's clip (not cispo) and"),
        (fork.Args(clip_cov_ub=0.5), "--clip-cov-ub 0.5 acts only with"),
    ):
        with pytest.raises(SystemExit, match=f"^error: {re.escape(said)}"):
            check_needs(args)
    check_needs(fork.Args(clip_cov_lb=0.5, clip_cov_ub=2.0, clip_cov_ratio=0.01))  # a window with room: fine
    with pytest.raises(SystemExit, match="clip-cov-ratio"):
        check_ranges(fork.Args(clip_cov_ratio=1.5))
