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
