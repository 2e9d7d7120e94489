"""grpo_math.py: answer checkers, every piece of the GRPO / Dr. GRPO / DAPO math against hand-computed values,
padding invariance, errors on bad input, short end-to-end runs (one and two processes) and a slow learning test."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import grpo_math as grpo
from clean_rlhf_utils import data, judges, loading, packing, prompts
from clean_rlhf_utils.args import check_ranges
from tests.launch import free_port, launch_cmd

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------------------------
# Answer checkers
# ---------------------------------------------------------------------------------------------------------------

GSM8K_CASES = [  # (completion, gold, reward)
    ("2 + 3 = 5 apples.\n#### 5", "5", 1.0),
    ("#### 5", "5", 1.0),
    ("#### 6", "5", 0.0),
    ("The answer is 5", "5", 0.0),  # no marker: no answer
    ("", "5", 0.0),
    ("####", "5", 0.0),
    ("#### five", "5", 0.0),
    ("#### 3\n#### 5", "5", 1.0),  # several answers: the last one counts
    ("#### 5\n#### 3", "5", 0.0),
    ("answer: 5 #### 4", "5", 0.0),
    ("#### 1,234", "1234", 1.0),  # commas
    ("#### 1,234,567", "1234567", 1.0),
    ("#### 1000", "1,000", 1.0),  # a gold answer with a comma
    ("#### $18", "18", 1.0),  # dollars
    ("#### $ 18", "18", 1.0),
    ("#### $1,000.50", "1000.5", 1.0),
    ("#### 18 apples", "18", 1.0),  # units after the number
    ("#### 18 apples.", "18", 1.0),
    ("#### -7", "-7", 1.0),  # negative
    ("#### -7", "7", 0.0),
    ("#### 7", "-7", 0.0),
    ("#### 2.5", "2.5", 1.0),  # decimals
    ("#### 2.50", "2.5", 1.0),
    ("#### 6.0", "6", 1.0),
    ("#### 06", "6", 1.0),
    ("#### .5", "0.5", 1.0),
    ("#### -0.5", "-0.5", 1.0),
    ("#### 5.", "5", 1.0),  # a trailing period
    ("####5", "5", 1.0),  # no space
    ("#### 0", "0", 1.0),
    ("#### 3.14159", "3.14159", 1.0),
    ("#### 3.14", "3.14159", 0.0),
    ("5 + 7 = 12 pens.\n12 - 2 = 10 pens.\n#### 10", "10", 1.0),
    ("5 + 7 = 12 pens.\n#### 12 - 2 = 10", "10", 0.0),  # the number right after #### is the answer
    ("#### 12\n", "12", 1.0),
]


@pytest.mark.parametrize("text, gold, expected", GSM8K_CASES)
def test_gsm8k_reward(text, gold, expected):
    assert grpo.success_reward(text, gold, "gsm8k") == expected


GSM8K_EXTRACTIONS = [  # (text, what extract_gsm8k_answer returns)
    ("#### $1,234", "1234"),
    ("#### 1\n#### 2", "2"),
    ("no answer", None),
    ("#### -3.5 kg", "-3.5"),
    ("####", None),
    ("#### $ 7.", "7"),
    ("x = 3\n#### 42\nThe end.", "42"),
    ("#### 1,000,000", "1000000"),
    ("#### 3/4", "3"),
    ("#### \\frac{1}{2}", None),
    ("#### 12 - 2 = 10", "12"),
    ("### 5", None),
    ("#### 0.25", "0.25"),
    ("#### 5%", "5"),
]


@pytest.mark.parametrize("text, expected", GSM8K_EXTRACTIONS)
def test_gsm8k_extractor(text, expected):
    assert grpo.extract_gsm8k_answer(text) == expected


MATH_CASES = [  # (completion, gold, reward), graded by math-verify
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\tfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{3}", 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{(1,2]}", "(1,2]", 1.0),  # intervals
    ("\\boxed{[1,2]}", "(1,2]", 0.0),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)", 1.0),
    ("\\boxed{x \\in [2, 5)}", "[2,5)", 1.0),
    ("\\boxed{x=3}", "3", 1.0),  # `x = 3` style
    ("\\boxed{x = 3}", "3", 1.0),
    ("\\boxed{10\\text{ cm}}", "10", 1.0),  # \text units
    ("\\boxed{10 \\text{ inches}}", "10", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("The answer is 5.", "5", 0.0),  # no box: no answer
    ("", "5", 0.0),
    ("\\boxed{5", "5", 0.0),  # a box that never closes
    ("\\boxed{}", "5", 0.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # nested braces
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{2}}{2}", 0.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # several boxes: the last one counts
    ("first \\boxed{4} then \\boxed{3}", "4", 0.0),
    ("\\boxed{6}", "5", 0.0),
    ("\\boxed{-4}", "-4", 1.0),
    ("\\boxed{-4}", "4", 0.0),
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("\\boxed{12.0}", "12", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{\\$5}", "5", 1.0),
    ("\\boxed{\\text{(C)}}", "C", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0),
    ("The final answer is $\\boxed{7}$.", "7", 1.0),
]


@pytest.mark.parametrize("text, gold, expected", MATH_CASES)
def test_math_reward_with_math_verify(text, gold, expected):
    assert grpo.success_reward(text, gold, "boxed") == expected


def test_math_verify_errors_count_as_wrong(monkeypatch):
    import math_verify

    def boom(*a, **k):
        raise TimeoutError("too slow")

    monkeypatch.setattr(math_verify, "verify", boom)
    assert grpo.success_reward("\\boxed{1}", "1", "boxed") == 0.0


def test_format_reward():
    assert grpo.format_reward("1 + 2 = 3 apples.\n#### 3", True, "gsm8k") == 1.0
    assert grpo.format_reward("1 + 2 = 3 apples.\n#### 3\n", True, "gsm8k") == 1.0
    assert grpo.format_reward("1 + 2 = 3 apples.\n#### 3", False, "gsm8k") == 0.0  # truncated: no EOS
    assert grpo.format_reward("#### 3 apples and more", True, "gsm8k") == 0.0
    assert grpo.format_reward("#### 3\nmore text", True, "gsm8k") == 0.0
    assert grpo.format_reward("So the answer is $\\boxed{\\frac{1}{2}}$.", True, "boxed") == 1.0
    assert grpo.format_reward("\\boxed{1}\nand then", True, "boxed") == 0.0


def test_majority_vote_groups_equal_numbers():
    keys = [judges.vote_key(a, "gsm8k") for a in ["6", "6.0", "7", None, "7", "06"]]
    assert judges.majority_vote(keys) == repr(6.0)
    assert judges.majority_vote([None, None]) is None
    assert judges.majority_vote(["b", "a", "a", "b"]) == "b"  # ties go to the earliest sample


# ---------------------------------------------------------------------------------------------------------------
# GRPO math, by hand
# ---------------------------------------------------------------------------------------------------------------


def test_group_advantages_for_each_variant_on_g4():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 1.0, 1.0]])
    # group 1: mean 0.25, deviations (0.75, -0.25, -0.25, -0.25), unbiased variance (0.5625 + 3 * 0.0625) / 3 = 0.25
    # group 3: mean 1, deviations (1, -1, 0, 0), unbiased variance 2 / 3
    eps = 1e-4
    s3 = math.sqrt(2 / 3)
    expected_scaled = torch.tensor(
        [
            [0.75 / (0.5 + eps), -0.25 / (0.5 + eps), -0.25 / (0.5 + eps), -0.25 / (0.5 + eps)],
            [0.0, 0.0, 0.0, 0.0],
            [1 / (s3 + eps), -1 / (s3 + eps), 0.0, 0.0],
        ]
    )
    for loss_type in ("grpo", "dapo"):  # both divide by the group std
        args = grpo.Args(loss_type=loss_type)
        grpo.resolve_variant(args)
        torch.testing.assert_close(grpo.group_advantages(rewards, args.scale_rewards, eps), expected_scaled)
    args = grpo.Args(loss_type="dr_grpo")
    grpo.resolve_variant(args)
    assert args.scale_rewards is False
    torch.testing.assert_close(
        grpo.group_advantages(rewards, args.scale_rewards, eps),
        torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.0, 0.0, 0.0, 0.0], [1.0, -1.0, 0.0, 0.0]]),
    )


def test_clip_higher_is_asymmetric():
    lp = lambda ratio: torch.tensor([[math.log(ratio)]])  # noqa: E731  the log-ratio of a token
    pos, neg = torch.tensor([1.0]), torch.tensor([-1.0])
    # positive advantage: clipped at 1 + 0.28
    loss, clipped = grpo.clipped_surrogate(lp(1.5), pos, 0.2, 0.28)
    assert loss.item() == pytest.approx(-1.28) and clipped.item()
    loss, clipped = grpo.clipped_surrogate(lp(1.25), pos, 0.2, 0.28)
    assert loss.item() == pytest.approx(-1.25) and not clipped.item()  # inside 1.28, though outside PPO's 1.2
    loss, clipped = grpo.clipped_surrogate(lp(1.25), pos, 0.2, 0.2)
    assert loss.item() == pytest.approx(-1.2) and clipped.item()
    # negative advantage: clipped at 1 - 0.2
    loss, clipped = grpo.clipped_surrogate(lp(0.5), neg, 0.2, 0.28)
    assert loss.item() == pytest.approx(0.8) and clipped.item()
    loss, clipped = grpo.clipped_surrogate(lp(1.5), neg, 0.2, 0.28)
    assert loss.item() == pytest.approx(1.5) and not clipped.item()  # the pessimistic term: never clipped above
    loss, clipped = grpo.clipped_surrogate(lp(0.5), pos, 0.2, 0.28)
    assert loss.item() == pytest.approx(-0.5) and not clipped.item()
    # the gradient vanishes exactly where the clip is active
    for ratio, adv, eps_high, has_grad in [
        (1.25, pos, 0.28, True),
        (1.25, pos, 0.2, False),
        (1.3, pos, 0.28, False),
        (0.75, neg, 0.28, False),
    ]:
        x = lp(ratio).requires_grad_(True)
        grpo.clipped_surrogate(x, adv, 0.2, eps_high)[0].sum().backward()
        assert (x.grad.abs().item() > 0) == has_grad, (ratio, adv, eps_high)


def test_gspo_clips_the_length_normalised_sequence_ratio():
    """GSPO eq. 5-7: s_i = exp(mean_t log(pi / pi_old)) over the completion's tokens, clipped per sequence. Token
    log-ratios (0.2, -0.1) and a padded third token: s = exp(0.05) = 1.05127 for both tokens."""
    logp = torch.tensor([[0.2, -0.1, 9.0]], requires_grad=True)  # old logprobs 0: the log-ratios themselves
    old, mask, adv = torch.zeros(1, 3), torch.tensor([[1, 1, 0]]), torch.tensor([1.0])
    lr = grpo.importance_log_ratio(logp, old, mask, "sequence")
    torch.testing.assert_close(lr[0, :2], torch.tensor([0.05, 0.05]))  # a sum instead of the mean would give 0.1
    torch.testing.assert_close(grpo.importance_log_ratio(logp, old, mask, "token"), logp - old)
    loss, clipped = grpo.clipped_surrogate(lr, adv, 0.2, 0.2)  # inside PPO's bounds: -s A on each token
    torch.testing.assert_close(loss[0, :2], torch.full((2,), -math.exp(0.05)))
    # aggregated as GRPO (mean over the tokens, then over sequences) the gradient of each token is -A s / |o|
    grpo.aggregate_loss(loss, mask, "sequence", 8).backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-math.exp(0.05) / 2, -math.exp(0.05) / 2, 0.0]]))
    # GSPO's own bounds (3e-4, 4e-4): s = 1.051 is clipped at 1.0004 for the whole sequence, no gradient at all
    loss, clipped = grpo.clipped_surrogate(grpo.importance_log_ratio(logp, old, mask, "sequence"), adv, 3e-4, 4e-4)
    assert loss[0, 0].item() == pytest.approx(-1.0004) and clipped[0, :2].all()
    args = grpo.Args(importance_sampling_level="sequence")
    grpo.resolve_variant(args)
    assert (args.epsilon_low, args.epsilon_high, args.beta) == (3e-4, 4e-4, 0.0)


def test_cispo_truncates_the_weight_and_keeps_every_token_gradient():
    """MiniMax-M1 eq. 4: loss -sg(min(r, cap)) A log pi, so d loss / d log pi = -min(r, cap) A for every token, also
    where PPO's clip would have zeroed it (r = 1.5 > 1.2 with A > 0)."""
    ratios = torch.tensor([[1.5, 7.0, 0.1]])
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = logp.detach() - ratios.log()
    adv = torch.tensor([2.0])
    loss, truncated = grpo.cispo_surrogate(
        logp, grpo.importance_log_ratio(logp, old, torch.ones(1, 3), "token"), adv, 5.0
    )
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.5 * 2 * -1.0, -5.0 * 2 * -2.0, -0.1 * 2 * -3.0]]))
    assert truncated.tolist() == [[False, True, False]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-3.0, -10.0, -0.2]]))  # a weight with gradient would add more
    ppo = logp.detach().clone().requires_grad_(True)
    grpo.clipped_surrogate(ppo - old, adv, 0.2, 0.2)[0].sum().backward()
    assert ppo.grad[0, 0].item() == 0.0  # PPO's clip drops the 1.5 token CISPO keeps
    args = grpo.Args(loss_type="cispo", max_completion_length=20480)
    grpo.resolve_variant(args)
    # weights capped at 1 + 4 = 5, no KL term, 1 / sum_i |o_i|: the token mean of DAPO
    assert (args.epsilon_high, args.beta, args.loss_aggregation) == (4.0, 0.0, "token")
    # MiniMax-M1 section 3.1: DAPO's dynamic sampling and length penalty (DAPO's 4096 of 20480)
    assert (args.dynamic_sampling, args.overlong_buffer) == (True, 4096)
    per_token, mask = torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([[1, 1], [1, 0]])
    assert grpo.aggregate_loss(per_token, mask, "token", 8).item() == pytest.approx(2.0)
    with pytest.raises(SystemExit, match="^error: --loss-type cispo"):
        grpo.resolve_variant(grpo.Args(loss_type="cispo", importance_sampling_level="sequence"))


def test_k2_kl_is_half_the_squared_log_ratio():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert grpo.k2_kl(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)  # 0.2402
    args = grpo.Args(advantage_estimator="reinforce_pp_baseline")
    grpo.resolve_variant(args)
    assert args.kl_estimator == "k2"


def test_reinforce_pp_baseline_normalises_over_the_global_batch_not_per_group():
    """Hu 2025 eq. 10 with the group-mean baseline. Rewards (1, 0 | 1, 1), G = 2, completions of 2, 1, 3 and 2 tokens:
    r - group mean = (0.5, -0.5, 0, 0); over the 8 tokens (0.5, 0.5, -0.5, 0, 0, 0, 0, 0) the mean is 0.0625 and the
    population variance 0.09375 - 0.0625^2 = 0.08984375, so completion 1 gets (0.5 - 0.0625) / 0.29974 = 1.45960."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv = grpo.reinforce_pp_advantages(rewards, mask, 2, baseline=True)
    std = math.sqrt(0.08984375 + 1e-8)
    expected = torch.tensor([[0.4375, 0.4375, 0], [-0.5625, 0, 0], [-0.0625] * 3, [-0.0625, -0.0625, 0]]) / std
    torch.testing.assert_close(adv, expected)
    assert adv[0, 0].item() == pytest.approx(1.45960, abs=1e-4)
    # GRPO's per-group normalisation would give the all-right group 0 and the first group +-0.707: not this
    assert adv[2, 0].item() != 0.0

    # two processes: each whitens with the statistics of both (reduce sums them), equal to one process's result
    def stats(a, m):
        m = m.float()
        return torch.stack([(a * m).sum(), (a**2 * m).sum(), m.sum()])

    raw = (rewards.view(-1, 2) - rewards.view(-1, 2).mean(1, keepdim=True)).reshape(-1, 1).expand(4, 3)
    top = grpo.reinforce_pp_advantages(rewards[:2], mask[:2], 2, True, reduce=lambda t: t + stats(raw[2:], mask[2:]))
    torch.testing.assert_close(top, expected[:2])


def test_reinforce_pp_puts_the_k1_kl_of_the_later_tokens_in_the_return():
    """Hu 2025 eq. 8-9: A_t = r - beta * sum_{s >= t} KL_s. r = 1, KL = (0.1, 0.2, 0.3), beta 0.5:
    returns (1 - 0.3, 1 - 0.25, 1 - 0.15) = (0.7, 0.75, 0.85), then whitened over the 3 tokens."""
    kl = torch.tensor([[0.1, 0.2, 0.3]])
    adv = grpo.reinforce_pp_advantages(
        torch.tensor([1.0, 0.0]),
        torch.tensor([[1, 1, 1], [0, 0, 0]]),
        2,
        baseline=False,
        kl=torch.cat([kl, torch.zeros(1, 3)]),
        beta=0.5,
    )
    returns = torch.tensor([0.7, 0.75, 0.85])
    expected = (returns - returns.mean()) / (returns.var(unbiased=False) + 1e-8).sqrt()
    torch.testing.assert_close(adv[0], expected)
    assert adv[1].abs().sum().item() == 0.0  # masked out


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate", "token_mask", "sequence_mask"])
def test_sampler_correction_removes_the_bias_of_a_mismatched_sampler(mode):
    """A bandit whose answer is known: one-token completions, trainer policy softmax(theta), rewards r. The exact
    policy gradient is sum_a pi(a) r(a) grad log pi(a). The tokens come from a sampler whose logits are perturbed by a
    known delta (as a bf16 engine's are, only larger). Averaged exactly over the sampler's distribution, the
    uncorrected update is biased; weighted by pi / pi_sampler (cap above every ratio) it is the exact gradient."""
    theta = torch.tensor([0.5, -0.3, 0.2, 0.0, -1.0])
    delta = torch.tensor([0.4, -0.2, 0.0, 0.3, -0.5])
    r = torch.tensor([1.0, 0.0, 0.5, -0.5, 2.0])
    pi_s = (theta + delta).softmax(0)
    exact = torch.autograd.functional.jacobian(lambda t: (t.softmax(0) * r).sum(), theta)

    def update(correct: bool) -> torch.Tensor:
        t = theta.clone().requires_grad_(True)
        logp = t.log_softmax(0)[:, None]  # (K actions, 1 token)
        loss, _ = grpo.clipped_surrogate(
            logp - logp.detach(), r, 0.2, 0.2
        )  # on-policy: -A with gradient -A grad log pi
        if correct:
            w, capped = grpo.sampler_weights(logp.detach(), pi_s.log()[:, None], torch.ones(5, 1), mode, cap=10.0)
            assert not capped.any()
            loss = loss * w
        (pi_s[:, None] * loss).sum().backward()  # the expectation over the sampler's tokens
        return -t.grad

    assert (update(False) - exact).abs().max().item() > 0.05  # biased
    torch.testing.assert_close(update(True), exact)
    # the cap: ratios above C are cut to C (truncate) or dropped (mask); weights carry no gradient
    lw = torch.tensor([[math.log(3.0), math.log(0.5)]])
    w, capped = grpo.sampler_weights(lw, torch.zeros(1, 2), torch.ones(1, 2), mode, cap=2.0)
    if mode == "token_truncate":
        torch.testing.assert_close(w, torch.tensor([[2.0, 0.5]]))
    elif mode == "token_mask":
        torch.testing.assert_close(w, torch.tensor([[0.0, 0.5]]))
    elif mode == "sequence_truncate":  # the sequence ratio 3 x 0.5 = 1.5 < 2 on both tokens
        torch.testing.assert_close(w, torch.tensor([[1.5, 1.5]]))
    assert capped.tolist() == [[mode.startswith("token"), False]]


def test_sampler_correction_defaults_follow_trl_1_16_and_weight_the_surrogate_only(monkeypatch):
    """TRL 1.16 `GRPOConfig`: vllm_importance_sampling_mode "sequence_mask", vllm_importance_sampling_clip_max 3 (the
    deprecated vllm_importance_sampling_cap fills it); `GRPOTrainer._compute_loss` multiplies the surrogate by the
    weight, then adds beta * KL unweighted. One completion of 2 tokens, on-policy (ratio 1), A = 1, the sampler's
    logprobs 0.3 below the trainer's: token weights exp(0.3) (token_truncate, under the cap 3); KL k3 to a reference at
    log 0.25 for policy logprobs (log 0.5, log 0.25): (log 2 - 0.5, 0); beta 1; token mean over the 2 tokens:
    (-2 exp(0.3) + (log 2 - 0.5)) / 2 = -1.25329. Weighting the KL term too gave (-2 exp(0.3) + exp(0.3) (log 2 - 0.5))
    / 2 = -1.21950."""
    args = grpo.Args(sampler_logprobs=False)
    assert (args.sampler_correction, args.sampler_correction_cap) == ("auto", 3.0)
    grpo.resolve_variant(args)
    assert args.sampler_correction == "sequence_mask"  # the old logprobs are not the sampler's: TRL's default mode
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    monkeypatch.setattr(
        grpo, "completion_logprobs", lambda model, packed, temperature, entropy_grad: (logp, torch.zeros(1, 2))
    )
    args = grpo.Args(beta=1.0, sampler_logprobs=False, sampler_correction="token_truncate", loss_aggregation="token")
    grpo.resolve_variant(args)
    ref, mask = torch.full((1, 2), math.log(0.25)), torch.ones(1, 2)
    out = grpo.micro_batch_loss(None, {}, torch.tensor([1.0]), mask, None, ref, args, 1, 2.0, logp.detach() - 0.3)
    expected = (-2 * math.exp(0.3) + (math.log(2) - 0.5)) / 2
    assert expected == pytest.approx(-1.25329, abs=1e-5)
    assert out["loss"].item() == pytest.approx(expected, abs=1e-6)
    assert out["surrogate"].item() == pytest.approx(-math.exp(0.3), abs=1e-6)  # loss/policy: the KL term left out
    torch.testing.assert_close(out["is_weight"], torch.full((1, 2), math.exp(0.3)))
    # the gradient: -w A on each token from the surrogate (w without gradient), plus beta * d k3 / d logp unweighted
    out["loss"].backward()
    dk3 = torch.tensor([1 - 0.5, 0.0])  # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad[0], (-math.exp(0.3) + dk3) / 2)


def test_reinforce_pp_and_distillation_default_to_the_token_mean():
    """OpenRLHF 0.11.2 (`--actor.loss_agg_mode token-mean`, `aggregate_loss` in openrlhf/models/loss.py) trains
    REINFORCE++ on the token mean of the batch, and TRL 1.16's DistillationTrainer divides by the batch's token count;
    under --loss-type grpo both took GRPO's mean of per-completion means. Per-token losses 1 (one token) and 2, 2, 2
    (three tokens): the token mean is 7 / 4 = 1.75, GRPO's (1 + 2) / 2 = 1.5."""
    per_token, mask = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]]), torch.tensor([[1, 0, 0], [1, 1, 1]])
    for estimator, loss_type, own in [
        ("reinforce_pp", "grpo", 1.75),
        ("reinforce_pp_baseline", "grpo", 1.75),
        ("distill", "grpo", 1.75),
        ("group", "grpo", 1.5),
        ("reinforce_pp_baseline", "dr_grpo", 7 / (2 * 8)),  # an explicit loss type keeps its own: sum / (B L_max)
    ]:
        teacher = "teacher" if estimator == "distill" else None  # distillation needs a teacher
        args = grpo.Args(
            advantage_estimator=estimator, loss_type=loss_type, teacher_model_path=teacher, max_completion_length=8
        )
        grpo.resolve_variant(args)
        loss = grpo.aggregate_loss(per_token, mask, args.loss_aggregation, args.max_completion_length)
        assert loss.item() == pytest.approx(own), (estimator, loss_type)
    args = grpo.Args(advantage_estimator="reinforce_pp_baseline", loss_aggregation="sequence")
    grpo.resolve_variant(args)
    assert args.loss_aggregation == "sequence"  # an explicit --loss-aggregation wins


def test_cispo_clip_metric_counts_truncated_tokens_with_positive_advantage_only():
    """TRL 1.16 `GRPOTrainer._compute_loss`, cispo branch: cispo_clip_ratio = mean of (coef_1 > epsilon_high) &
    (advantages > 0). Ratios (7, 1.5) with A = 2 and (7, 0.1) with A = -2, cap 5: one token of the four counts, 0.25;
    the truncated token with A < 0 (counted before) is still truncated in the loss: -5 * -2 * log pi."""
    ratios = torch.tensor([[7.0, 1.5], [7.0, 0.1]])
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    log_ratio = grpo.importance_log_ratio(logp, logp - ratios.log(), torch.ones(2, 2), "token")
    loss, clipped = grpo.cispo_surrogate(logp, log_ratio, torch.tensor([2.0, -2.0]), 5.0)
    assert clipped.tolist() == [[True, False], [False, False]]
    torch.testing.assert_close(loss[1], torch.tensor([-5.0 * -2.0 * -3.0, -0.1 * -2.0 * -4.0]))
    out = {"clipped": clipped, "ratio": ratios, "mismatch": None}
    stats = grpo.micro_batch_stats(out, torch.ones(2, 2), torch.ones(2, 2), first_pass=False)
    assert (stats["clipped"] / stats["tokens"]).item() == pytest.approx(0.25)  # policy/clipfrac


def test_dapo_defaults_and_explicit_overrides():
    args = grpo.Args(loss_type="dapo", max_completion_length=20480)
    grpo.resolve_variant(args)
    assert (args.epsilon_low, args.epsilon_high, args.dynamic_sampling, args.overlong_buffer) == (0.2, 0.28, True, 4096)
    args = grpo.Args(loss_type="grpo")
    grpo.resolve_variant(args)
    assert (args.epsilon_high, args.dynamic_sampling, args.overlong_buffer, args.scale_rewards) == (0.2, False, 0, True)
    args = grpo.Args(loss_type="dapo", epsilon_high=0.3, dynamic_sampling=False, overlong_buffer=0)
    grpo.resolve_variant(args)
    assert (args.epsilon_high, args.dynamic_sampling, args.overlong_buffer) == (0.3, False, 0)
    with pytest.raises(SystemExit, match="num-generations"):
        grpo.resolve_variant(grpo.Args(num_generations=1))


def test_beta_defaults_to_0_for_dapo_and_0_04_otherwise():
    # DAPO (Yu et al. 2025, arXiv:2503.14476) removes the KL term; DeepSeekMath's beta is 0.04
    for loss_type, beta in [("dapo", 0.0), ("grpo", 0.04), ("dr_grpo", 0.04)]:
        args = grpo.Args(loss_type=loss_type)
        grpo.resolve_variant(args)
        assert args.beta == beta, loss_type
    for loss_type, beta in [("dapo", 0.01), ("grpo", 0.0)]:  # an explicit --beta is kept
        args = grpo.Args(loss_type=loss_type, beta=beta)
        grpo.resolve_variant(args)
        assert args.beta == beta, loss_type
    # the presets, with `--loss-type dapo` as benchmark/suites.py passes it: only the MATH preset pins beta
    # (Oat-Zero's 0)
    import tyro

    dapo = ["--loss-type", "dapo"]
    for preset, cli, beta in [
        ("tiny", [], 0.04),
        ("tiny", dapo, 0.0),
        ("gsm8k-qwen2.5-0.5b", [], 0.04),
        ("gsm8k-qwen2.5-0.5b", dapo, 0.0),
        ("math-qwen2.5-math-1.5b", [], 0.0),
        ("tiny", [*dapo, "--beta", "0.02"], 0.02),
    ]:
        args = tyro.extras.overridable_config_cli(grpo.PRESETS, args=[preset, *cli])
        grpo.resolve_variant(args)
        assert args.beta == beta, (preset, cli)


def test_k3_kl_matches_formula_and_is_non_negative():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(0.25) - math.log(0.5)
    assert grpo.k3_kl(logp, ref).item() == pytest.approx(math.exp(d) - d - 1)  # 0.5 + log 2 - 1 = 0.1931
    assert grpo.k3_kl(logp, ref).item() == pytest.approx(math.log(2) - 0.5)
    assert grpo.k3_kl(logp, logp).item() == 0.0
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert (grpo.k3_kl(a, b) >= 0).all()
    # unbiased: the mean over samples of the policy is KL(p || q) (here two categorical distributions)
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    exact = (p * (p / q).log()).sum()
    torch.testing.assert_close((p * grpo.k3_kl(p.log(), q.log())).sum(), exact)


def test_loss_aggregation_grpo_dr_grpo_dapo_by_hand():
    # two completions of 2 and 4 tokens; the padding holds 100 to show it is ignored
    per_token = torch.tensor([[1.0, 3.0, 100.0, 100.0], [2.0, 2.0, 2.0, 6.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    # grpo: per-sequence means 2 and 3, averaged: 2.5
    assert grpo.aggregate_loss(per_token, mask, "sequence", 8).item() == pytest.approx(2.5)
    # dr_grpo: token sums 4 and 12, each over the constant 8, averaged over the 2 sequences: (4 + 12) / 16
    assert grpo.aggregate_loss(per_token, mask, "fixed", 8).item() == pytest.approx(1.0)
    # dapo: every token counts once: 16 / 6
    assert grpo.aggregate_loss(per_token, mask, "token", 8).item() == pytest.approx(16 / 6)
    # the long sequence weighs 4/6 of the dapo loss but 1/2 of the grpo loss
    with pytest.raises(ValueError):
        grpo.aggregate_loss(per_token, mask, "nope", 8)
    weights = grpo.prompt_weights(mask, 2)
    for aggregation in ("sequence", "fixed", "token", "prompt"):
        # micro-batches: summing the pieces with the whole batch's normalisers gives the whole-batch loss
        whole = grpo.aggregate_loss(per_token, mask, aggregation, 8, seq_weights=weights)
        pieces = sum(
            grpo.aggregate_loss(
                per_token[i : i + 1], mask[i : i + 1], aggregation, 8, 2, 6.0, seq_weights=weights[i : i + 1]
            )
            for i in range(2)
        )
        assert pieces.item() == pytest.approx(whole.item())
    for loss_type, aggregation in [("grpo", "sequence"), ("dr_grpo", "fixed"), ("dapo", "token"), ("cispo", "token")]:
        args = grpo.Args(loss_type=loss_type)
        grpo.resolve_variant(args)
        assert args.loss_aggregation == aggregation  # each variant's own, unless --loss-aggregation says otherwise
    args = grpo.Args(loss_type="cispo", loss_aggregation="prompt")
    grpo.resolve_variant(args)
    assert args.loss_aggregation == "prompt"


def test_prompt_aggregation_is_the_mean_over_prompts_of_each_group_token_mean():
    """ScaleRL (Khatri et al. 2025, arXiv:2510.13786): L = 1/P sum_p (1 / sum_{i in p} |o_i|) sum_{i in p} sum_t l_it.
    Two prompts, G = 2: group 1 holds 1 + 3 tokens with losses (4), (1, 2, 3), its token mean 10 / 4 = 2.5; group 2
    holds 2 + 2 tokens (1, 1), (2, 4), its token mean 8 / 4 = 2; the prompt mean is (2.5 + 2) / 2 = 2.25. The token
    mean over all 8 tokens is 18 / 8 = 2.25 only because the groups are equally long, so group 2 is made longer."""
    per_token = torch.tensor([[4.0, 0, 0], [1, 2, 3], [1, 1, 0], [2, 4, 0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    weights = grpo.prompt_weights(mask, 2)
    torch.testing.assert_close(weights, torch.tensor([2 / 4, 2 / 4, 2 / 4, 2 / 4]))
    assert grpo.aggregate_loss(per_token, mask, "prompt", 8, seq_weights=weights).item() == pytest.approx(2.25)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]])  # group 2 now (1, 1, 0), (2, 4, 0): 6 tokens
    weights = grpo.prompt_weights(mask, 2)
    torch.testing.assert_close(weights, torch.tensor([2 / 4, 2 / 4, 2 / 6, 2 / 6]))
    # (10 / 4 + 8 / 6) / 2 = 1.9167; the token mean would be 18 / 10 = 1.8, the sequence mean (4 + 2 + 2/3 + 2) / 4
    assert grpo.aggregate_loss(per_token, mask, "prompt", 8, seq_weights=weights).item() == pytest.approx(
        (10 / 4 + 8 / 6) / 2
    )
    assert grpo.aggregate_loss(per_token, mask, "token", 8).item() == pytest.approx(1.8)


def test_dual_clip_bounds_the_loss_of_a_runaway_negative_advantage_token():
    """Dual-clip PPO (verl's clip_ratio_c, OpenRLHF's --dual_clip; issue 52): one token, ratio 5, A = -1, eps 0.2.
    PPO: max(-A r, -A clip(r, 0.8, 1.2)) = max(5, 1.2) = 5, d loss / d log r = r |A| = 5. With c = 3: min(5, 3 |A|) = 3,
    flat: gradient 0, and the token counts as clipped."""
    x = torch.tensor([[math.log(5.0)]], requires_grad=True)
    neg, pos = torch.tensor([-1.0]), torch.tensor([1.0])
    loss, clipped = grpo.clipped_surrogate(x, neg, 0.2, 0.2)
    loss.sum().backward()
    assert (loss.item(), x.grad.item(), clipped.item()) == (pytest.approx(5.0), pytest.approx(5.0), False)
    x.grad = None
    loss, clipped = grpo.clipped_surrogate(x, neg, 0.2, 0.2, dual_clip=3.0)
    loss.sum().backward()
    assert (loss.item(), x.grad.item(), clipped.item()) == (pytest.approx(3.0), 0.0, True)
    # below c, and with A > 0, it changes nothing (ratio 2, A = -1: loss 2; ratio 5, A = 1: PPO's clip, -1.2)
    for ratio, adv, expected in [(2.0, neg, 2.0), (5.0, pos, -1.2)]:
        lr = torch.tensor([[math.log(ratio)]])
        loss, clipped = grpo.clipped_surrogate(lr, adv, 0.2, 0.2, 3.0)
        assert loss.item() == pytest.approx(expected) and clipped.item() == (adv.item() > 0)
    assert grpo.Args().dual_clip is None  # off by default: no paper of a preset uses it
    with pytest.raises(SystemExit, match="--dual-clip is 1.0; it must be above 1"):
        check_ranges(grpo.Args(dual_clip=1.0))
    with pytest.raises(SystemExit, match="--dual-clip bounds PPO's clipped surrogate"):
        grpo.resolve_variant(grpo.Args(loss_type="cispo", dual_clip=3.0))


class OneTokenPolicy(torch.nn.Module):
    """A policy whose logits over a two-word vocabulary are its parameter z, for a `pack`ed batch of one completion
    of one token (word 1), so that `micro_batch_loss` runs its real code on numbers small enough to check by hand."""

    def __init__(self, z: list[float]):
        super().__init__()
        self.z = torch.nn.Parameter(torch.tensor([[z]]))

    def forward(self, **kwargs):
        return type("Out", (), {"logits": self.z})()


ONE_TOKEN = {k: torch.tensor([[v]]) for k, v in dict(input_ids=0, position_ids=0, rows=0, cols=0, targets=1).items()}


def one_token_loss(z: list[float], ref: float | None = None, **flags) -> tuple[dict, torch.Tensor]:
    """micro_batch_loss of the one-token policy at advantage 0 (so the surrogate adds no gradient): the output and the
    gradient of the loss with respect to the logits z."""
    args = grpo.Args(**flags)
    grpo.resolve_variant(args)
    model = OneTokenPolicy(z)
    ref_logprobs = None if ref is None else torch.tensor([[ref]])
    out = grpo.micro_batch_loss(model, ONE_TOKEN, torch.zeros(1), torch.ones(1, 1), None, ref_logprobs, args, 1, 1.0)
    out["loss"].backward()
    return out, model.z.grad.flatten()


def test_kl_clamp_bounds_the_kl_term_and_zeroes_its_gradient_past_the_bound():
    """verl clamps k3 to [-10, 10] (OpenRLHF every estimator): logits (log 3, 0), word 1 sampled, log p = log 1/4;
    ref - log p = 3 gives k3 = e^3 - 3 - 1 = 16.0855. beta 1: unclamped, d k3 / d log p = 1 - e^3 and d log p / dz =
    onehot - p = (-3/4, 3/4), so dz = (1 - e^3)(-3/4, 3/4); clamped at 10, the loss is 10 and the gradient 0."""
    z, logp = [math.log(3.0), 0.0], math.log(0.25)
    out, grad = one_token_loss(z, logp + 3, beta=1.0)
    assert out["loss"].item() == pytest.approx(math.exp(3) - 4, rel=1e-5)
    torch.testing.assert_close(grad, torch.tensor([-0.75, 0.75]) * (1 - math.exp(3)))
    out, grad = one_token_loss(z, logp + 3, beta=1.0, kl_clamp=10.0)
    assert out["loss"].item() == pytest.approx(10.0) and grad.abs().max().item() == 0.0
    assert out["kl"].item() == pytest.approx(math.exp(3) - 4, rel=1e-5)  # objective/kl logs the estimate unclamped
    _, grad = one_token_loss(z, logp + 0.5, beta=1.0, kl_clamp=10.0)  # k3 = 0.1487 inside the bound: untouched
    torch.testing.assert_close(grad, torch.tensor([-0.75, 0.75]) * (1 - math.exp(0.5)))
    with pytest.raises(SystemExit, match="--kl-clamp is 0.0; it must be above 0"):
        check_ranges(grpo.Args(kl_clamp=0.0))


def test_entropy_bonus_gradient_is_minus_coef_times_the_entropy_gradient():
    """verl's entropy_coeff: loss - coef * H. Logits (0, log 3): p = (1/4, 3/4), H = 0.56234, and
    dH/dz_i = -p_i (log p_i + H) = (0.20599, -0.20599); coef 0.1 at advantage 0: loss -0.056234, dz = -0.1 dH/dz.
    Without the flag the entropy is a statistic: no gradient, the same logged value."""
    p = torch.tensor([0.25, 0.75])
    h = -(p * p.log()).sum().item()
    out, grad = one_token_loss([0.0, math.log(3.0)], entropy_coef=0.1)
    assert h == pytest.approx(0.56234, abs=1e-5) and out["loss"].item() == pytest.approx(-0.1 * h)
    torch.testing.assert_close(grad, -0.1 * -p * (p.log() + h))
    assert grad[0].item() == pytest.approx(-0.020599, abs=1e-6)
    assert out["surrogate"].item() == 0.0 and out["entropy"].item() == pytest.approx(h)  # logged without the bonus
    out, grad = one_token_loss([0.0, math.log(3.0)])
    assert out["entropy"].item() == pytest.approx(h) and grad.abs().max().item() == 0.0
    with pytest.raises(SystemExit, match="--entropy-coef is -0.1; it must be at least 0"):
        check_ranges(grpo.Args(entropy_coef=-0.1))


def test_sequence_mean_leaves_out_a_completion_that_overlong_filtering_emptied():
    """Issue 52: per-token losses ones(2, 1), mask ((1), (0)) (the second completion truncated and filtered). The
    `sequence` mean is over the completions in the loss: 1.0 (verl's seq-mean-token-mean); TRL 1.16 divides by both
    rows, 0.5. `fixed` and `prompt` keep constant normalisers (Dr. GRPO: completions x L) and count every row."""
    per_token, mask = torch.ones(2, 1), torch.tensor([[1], [0]])
    assert grpo.aggregate_loss(per_token, mask, "sequence", 4).item() == 1.0
    # micro-batched as `main` runs it, each piece over the mini-batch's kept count: the pieces sum to the whole
    pieces = [grpo.aggregate_loss(per_token[i : i + 1], mask[i : i + 1], "sequence", 4, 1) for i in range(2)]
    assert sum(pieces).item() == 1.0
    assert grpo.aggregate_loss(per_token, torch.zeros(2, 1), "sequence", 4).item() == 0.0  # all filtered: no NaN
    assert grpo.aggregate_loss(per_token, mask, "fixed", 1).item() == 0.5
    assert grpo.aggregate_loss(per_token, mask, "token", 1).item() == 1.0
    weights = grpo.prompt_weights(torch.tensor([[1], [0], [0], [0]]), 2)  # group 2 all filtered: still a prompt
    assert (
        grpo.aggregate_loss(torch.ones(4, 1), torch.tensor([[1], [0], [0], [0]]), "prompt", 1, seq_weights=weights)
        == 0.5
    )


def test_reinforce_pp_advantages_keep_the_rewards_dtype():
    """Issue 52: REINFORCE++ returned float32 whatever its input. Rewards (1, 0, 0, 0) in float64, G = 2, one token
    each: mean 0.25, population variance 0.25 - 0.0625 = 0.1875, so (1 - 0.25) / sqrt(0.1875) = sqrt(3) and
    -0.25 / sqrt(0.1875) = -1 / sqrt(3), in float64; half-precision rewards are whitened in float32."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = grpo.reinforce_pp_advantages(rewards, torch.ones(4, 1, dtype=torch.long), 2, baseline=False)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(
        adv[:, 0], torch.tensor([3**0.5, -(3**-0.5), -(3**-0.5), -(3**-0.5)], dtype=torch.float64)
    )
    assert grpo.reinforce_pp_advantages(rewards.half(), torch.ones(4, 1), 2, baseline=False).dtype == torch.float32


def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal():
    rewards = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [0.5, 0.5, 0.5, 0.5], [0, 0, 0, -0.1]])
    assert grpo.groups_with_signal(rewards).tolist() == [False, False, True, False, True]
    # the groups it drops are exactly those with zero advantage everywhere
    adv = grpo.group_advantages(rewards.float(), True)
    assert ((adv.abs().sum(1) > 0) == grpo.groups_with_signal(rewards)).all()


def test_dynamic_sampling_filters_groups_on_accuracy_not_on_the_total_reward():
    # DAPO eq. 11: a group is kept when 0 < |{o_i : is_equivalent(a, o_i)}| < G, i.e. its accuracy is neither all 0
    # nor all 1; the overlong penalty (and the format reward) do not count. G = 4, three groups:
    success = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # all wrong, different lengths: total rewards differ, dropped
            [1.0, 0.0, 1.0, 0.0],  # mixed: kept
            [1.0, 1.0, 1.0, 1.0],
        ]
    )  # all right, one overlong: dropped
    overlong = torch.tensor([[0.0, -0.5, -1.0, 0.0], [0.0, 0.0, -0.25, 0.0], [0.0, 0.0, 0.0, -0.5]])
    fmt = torch.tensor([[0.1, 0.0, 0.0, 0.1], [0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.0]])
    parts = {"success": success.view(-1), "format": fmt.view(-1), "overlong": overlong.view(-1)}
    batch = {**parts, "reward": sum(parts.values())}  # as sample_and_score builds it
    assert grpo.groups_to_keep(batch, 4, dynamic_sampling=True) == [False, True, False]
    assert grpo.groups_to_keep(batch, 4, dynamic_sampling=False) == [True, True, True]
    # the dropped all-wrong group would otherwise train on a length-only advantage
    assert grpo.group_advantages(batch["reward"].view(-1, 4), True)[0].abs().sum() > 0


def test_soft_overlong_penalty_values():
    lengths = torch.tensor([10, 15, 16, 18, 20])
    # DAPO eq. 13 with L_max = 20 and a 5-token buffer: 0 up to 15 tokens, then linear to -1 at 20
    torch.testing.assert_close(
        grpo.soft_overlong_penalty(lengths, 20, 5, 1.0), torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0])
    )
    torch.testing.assert_close(
        grpo.soft_overlong_penalty(lengths, 20, 5, 0.5), torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5])
    )
    torch.testing.assert_close(grpo.soft_overlong_penalty(lengths, 20, 0, 1.0), torch.zeros(5))
    # the paper's numbers: 16384 tokens are free, 20480 get -1
    assert grpo.soft_overlong_penalty(torch.tensor([16384, 18432, 20480]), 20480, 4096, 1.0).tolist() == [
        0.0,
        -0.5,
        -1.0,
    ]


def test_clip_and_delta_on_a_three_step_example():
    # Gao et al. 2024 (arXiv:2410.15115) on K = 3 steps, (r_1, r_2, r_3) = (0.9, 0.3, 0.2), alpha 1, eta 0.5.
    # Clip: r'_k = alpha * min(r_k - eta, 0).
    # Delta drops the last step's process reward (the success reward judges the final answer):
    #   r'_k = r_k - r_{k+1} for k < K-1, r'_{K-1} = r_{K-1}, r'_K = 0, so sum_{t >= k} r'_t = r_k for k <= K-1.
    r = [0.9, 0.3, 0.2]
    assert grpo.refine_step_rewards(r, "none", 1.0, 0.5) == pytest.approx([0.9, 0.3, 0.2])
    assert grpo.refine_step_rewards(r, "none", 2.0, 0.5) == pytest.approx([1.8, 0.6, 0.4])
    assert grpo.refine_step_rewards(r, "clip", 1.0, 0.5) == pytest.approx([0.0, -0.2, -0.3])  # min(r - 0.5, 0)
    assert grpo.refine_step_rewards(r, "clip", 2.0, 0.5) == pytest.approx([0.0, -0.4, -0.6])
    delta = grpo.refine_step_rewards(r, "delta", 1.0, 0.5)
    assert delta == pytest.approx([0.6, 0.3, 0.0])  # r_1 - r_2, r_2, 0
    assert [sum(delta[k:]) for k in range(3)] == pytest.approx([0.9, 0.3, 0.0])  # the return from step k is r_k
    assert sum(grpo.refine_step_rewards(r, "delta", 2.0, 0.5)) == pytest.approx(1.8)  # GRPO's sum: alpha * r_1
    # clip_delta: clipped (0, -0.2, -0.3), then delta: (0 - (-0.2), -0.2, 0)
    assert grpo.refine_step_rewards(r, "clip_delta", 1.0, 0.5) == pytest.approx([0.2, -0.2, 0.0])
    # more steps cannot earn more: the sum is r_1 whatever follows
    assert sum(grpo.refine_step_rewards(r + [0.95, 0.95], "delta", 1.0, 0.5)) == pytest.approx(0.9)
    # K = 1: the only step is the final answer, judged by the success reward alone: 0; K = 2: (r_1, 0)
    for mode in ("delta", "clip_delta"):
        assert grpo.refine_step_rewards([0.3], mode, 1.0, 0.5) == [0.0]
    assert grpo.refine_step_rewards([0.8, 0.4], "delta", 1.0, 0.5) == pytest.approx([0.8, 0.0])
    assert grpo.refine_step_rewards([], "delta", 1.0, 0.5) == []
    # Clip never rewards a step, so padding a solution with plausible steps only costs
    assert sum(grpo.refine_step_rewards(r + [0.99] * 5, "clip", 1.0, 0.5)) <= sum(
        grpo.refine_step_rewards(r, "clip", 1.0, 0.5)
    )


# ---------------------------------------------------------------------------------------------------------------
# Models: padding invariance, the learned reward, bad input
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(assets):
    path = assets / "models" / "tiny-llama"
    torch.manual_seed(0)
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval(), path


def plain_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The completion's logprobs from one unpadded forward pass of prompt + completion alone."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def test_packed_logprobs_equal_each_sequence_alone(tiny):
    tokenizer, model, _ = tiny
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = [
        enc("Question: Tom has 3 apples.\nAnswer:\n"),
        enc("Question: x\nAnswer:\n"),
        enc("Question: 2 + 2?\nAnswer:\n"),
    ]
    completions = [enc("3 + 1 = 4 apples.\n#### 4") + [eos], [5, 6, eos], [7]]
    packed = packing.pack_completions(prompts, completions, pad, capacity=80)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    assert sum(lengths) <= 80 and packed["input_ids"].shape == (1, sum(lengths))  # all three share one row, no padding
    # position ids restart at every sequence: 0..n-1 for each, in the packed order (longest first)
    assert sorted(packed["position_ids"][0].tolist()) == sorted(x for n in lengths for x in range(n))
    for temperature in (1.0, 2.0):
        with torch.no_grad():
            together, _ = grpo.completion_logprobs(model, packed, temperature)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            torch.testing.assert_close(
                together[i, : len(c)], plain_logprobs(model, p, c, temperature), atol=1e-5, rtol=1e-5
            )
            assert packed["mask"][i].sum() == len(c) and packed["targets"][i, : len(c)].tolist() == c
    # a capacity below the longest sequence is raised to it; one sequence per row then, still exact
    narrow = packing.pack_completions(prompts, completions, pad, capacity=1)
    assert len(narrow["input_ids"]) == 3 and narrow["input_ids"].shape[1] == max(lengths)
    with torch.no_grad():
        torch.testing.assert_close(
            grpo.completion_logprobs(model, narrow, 1.0)[0] * narrow["mask"],
            grpo.completion_logprobs(model, packed, 1.0)[0] * packed["mask"],
            atol=1e-5,
            rtol=1e-5,
        )


def test_sampler_greedy_matches_generate_and_returns_the_sampled_tokens_logprobs(tiny):
    tokenizer, model, _ = tiny
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [enc("Question: Tom has 3 apples.\nAnswer:\n"), enc("Question: x\nAnswer:\n")] * 3
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    greedy, _ = grpo.generation.sample_with_kv_cache(model, prompts, pad, eos, 12, 0.0, batch_size=4)
    ids, mask = data.left_pad(prompts, pad)
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=pad, eos_token_id=eos
        )
    for row, out in zip(ref[:, ids.shape[1] :].tolist(), greedy):
        assert out == (row[: row.index(eos) + 1] if eos in row else row)
    torch.manual_seed(0)
    sampled, logprobs = grpo.generation.sample_with_kv_cache(model, prompts, pad, eos, 12, 1.3, batch_size=4)
    assert all(
        1 <= len(c) <= 12 and (eos not in c or c.index(eos) == len(c) - 1) for c in sampled
    )  # stops at its first EOS
    for p, c, lp in zip(prompts, sampled, logprobs):
        torch.testing.assert_close(
            lp, plain_logprobs(model, p, c, 1.3), atol=1e-4, rtol=1e-4
        )  # the old policy's logprobs


def test_process_reward_is_the_sum_of_refined_step_probabilities(tiny):
    tokenizer, _, _ = tiny
    torch.manual_seed(0)
    prm = AutoModelForSequenceClassification.from_pretrained(tiny[2], num_labels=1).eval()
    prm.config.reward_type, prm.config.step_separator = "process", "\n"
    prompt = tokenizer("Question: Tom has 3 apples.\nAnswer:\n", add_special_tokens=False)["input_ids"]
    text = "3 + 1 = 4 apples.\n\n4 * 2 = 8 apples.\n#### 8"  # an empty line is not a step
    completion = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    responses = torch.tensor([completion + [tokenizer.pad_token_id] * 3])
    # by hand: prompt, then each of the 3 steps followed by the separator token, scored at the separators
    sep = tokenizer("\n", add_special_tokens=False)["input_ids"]
    ids, positions = list(prompt), []
    for step in ["3 + 1 = 4 apples.", "4 * 2 = 8 apples.", "#### 8"]:
        ids += tokenizer(step, add_special_tokens=False)["input_ids"] + sep
        positions.append(len(ids) - 1)
    captured = {}
    handle = prm.score.register_forward_hook(lambda m, i, o: captured.update(s=o))
    with torch.no_grad():
        prm(input_ids=torch.tensor([ids]))
    handle.remove()
    probs = torch.sigmoid(captured["s"][0, positions, 0]).tolist()
    for refine, expected in [
        ("clip", [min(p - 0.5, 0.0) for p in probs]),
        ("none", probs),
        ("delta", [probs[0] - probs[1], probs[1], 0.0]),
    ]:  # Gao et al.: the last step's is dropped
        args = grpo.Args(prm_refine=refine, prm_coef=1.0, prm_clip_eta=0.5)
        per_token, n_steps = grpo.process_rewards(prm, tokenizer, [prompt], responses, args)
        assert n_steps == [3]
        assert per_token.sum(1).item() == pytest.approx(sum(expected), abs=1e-5), refine  # GRPO adds the sum
        # the last step (ending at EOS) carries the last refined reward: 0 under Delta
        assert per_token[0, len(completion) - 1].item() == pytest.approx(expected[-1], abs=1e-6)
        assert (per_token[0, len(completion) :] == 0).all()  # nothing on the padding
    assert (
        grpo.process_rewards(prm, tokenizer, [prompt], responses, grpo.Args(prm_refine="clip"))[0].sum().item() <= 0.0
    )
    # an outcome model: one score at the last token of prompt + completion, plus the normalisation bias
    prm.config.reward_bias = 0.25
    full = torch.tensor([prompt + completion])
    scores = grpo.token_scores(prm, full, torch.ones_like(full))
    ids_, mask_ = grpo.right_pad([prompt + completion, prompt], tokenizer.pad_token_id)
    got = grpo.outcome_reward(prm, ids_, mask_)
    assert got[0].item() == pytest.approx(scores[0, -1].item() + 0.25, abs=1e-5)


def test_reward_model_with_another_tokenizer_or_type_is_an_error(assets, tmp_path, tiny):
    tokenizer, _, path = tiny
    prm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    prm.config.reward_type = "process"
    prm.save_pretrained(tmp_path / "prm")
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp_path / "prm")
    args = grpo.Args()
    assert (
        loading.load_scorer(str(tmp_path / "prm"), args, "--prm-path", "process", tokenizer).config.reward_type
        == "process"
    )
    with pytest.raises(SystemExit, match="not an outcome reward model"):
        loading.load_scorer(str(tmp_path / "prm"), args, "--reward-model-path", "outcome", tokenizer)
    other = AutoTokenizer.from_pretrained(path)
    other.add_special_tokens({"additional_special_tokens": ["[NEW]"]})
    with pytest.raises(SystemExit, match="tokenizer of .* differs"):
        loading.load_scorer(str(tmp_path / "prm"), args, "--prm-path", "process", other)


def test_malformed_rows_are_errors_naming_row_and_field(tiny):
    tokenizer, _, _ = tiny
    args = grpo.Args(
        prompt_template="Question: {question}\nAnswer:\n", reference_template="{answer}", max_prompt_length=96
    )
    ok = {"question": "Tom has 3 apples.", "answer": "#### 3"}
    with pytest.raises(SystemExit, match=r"row 1 of split 'train' has no field 'answer'"):
        prompts.prepare_math_questions(
            Dataset.from_list([ok, {"question": "q", "solution": "#### 3"}]),
            tokenizer,
            args,
            "train",
            grpo.extract_answer,
        )
    with pytest.raises(SystemExit, match=r"row 1 of split 'train' has no field 'question'"):
        prompts.prepare_math_questions(
            Dataset.from_list([ok, {"problem": "q", "answer": "#### 3"}]), tokenizer, args, "train", grpo.extract_answer
        )
    with pytest.raises(SystemExit, match=r"row 1 of split 'test': field\(s\) \['answer'\].*no final answer"):
        prompts.prepare_math_questions(
            Dataset.from_list([ok, {"question": "q", "answer": "three"}]), tokenizer, args, "test", grpo.extract_answer
        )
    boxed = grpo.Args(prompt_template="{problem}", reference_template="{solution}", answer_format="boxed")
    with pytest.raises(SystemExit, match=r"row 0 .*\['solution'\].*boxed"):
        prompts.prepare_math_questions(
            Dataset.from_list([{"problem": "p", "solution": "it is 3"}]), tokenizer, boxed, "train", grpo.extract_answer
        )
    with pytest.raises(SystemExit, match="max-prompt-length"):
        prompts.prepare_math_questions(
            Dataset.from_list([{"question": "a " * 200, "answer": "#### 1"}]),
            tokenizer,
            args,
            "train",
            grpo.extract_answer,
        )
    rows = prompts.prepare_math_questions(Dataset.from_list([ok]), tokenizer, args, "train", grpo.extract_answer)
    assert rows[0]["gold"] == "3"
    too_long = r"row 0 of split 'train' has a \d+-token prompt, which with --max-completion-length 600 needs"
    with pytest.raises(SystemExit, match=too_long):
        prompts.prepare_math_questions(
            Dataset.from_list([ok]),
            tokenizer,
            dataclasses.replace(args, max_completion_length=600),
            "train",
            grpo.extract_answer,
            positions=512,
        )


def test_conversational_questions_are_rendered_with_the_chat_template(tiny):
    # TRL's conversational formats: a prompt-only conversation is the prompt, through the tokenizer's chat template
    # (as --use-chat-template renders a text question); a prompt-completion's completion is the reference
    tokenizer, _, _ = tiny
    args = grpo.Args(prompt_template="{prompt}", reference_template="{completion}", max_prompt_length=96)
    row = {
        "prompt": [{"role": "user", "content": "Tom has 3 apples."}],
        "completion": [{"role": "assistant", "content": "3 = 3\n#### 3"}],
    }
    got = prompts.prepare_math_questions(Dataset.from_list([row]), tokenizer, args, "train", grpo.extract_answer)[0]
    plain = Dataset.from_list([{"prompt": "Tom has 3 apples.", "completion": "#### 3"}])
    text = prompts.prepare_math_questions(
        plain, tokenizer, dataclasses.replace(args, use_chat_template=True), "train", grpo.extract_answer
    )[0]
    assert got["prompt_ids"] == text["prompt_ids"] and got["gold"] == "3"
    assert tokenizer.decode(got["prompt_ids"]).endswith("<|assistant|>\n")


# ---------------------------------------------------------------------------------------------------------------
# End to end (a few steps of an untrained tiny model: checks the plumbing, not learning)
# ---------------------------------------------------------------------------------------------------------------


def _args(assets, tmp_path, **kw) -> grpo.Args:
    base = dict(
        model_name_or_path=str(assets / "models" / "tiny-llama"),
        dataset_name_or_path=str(assets / "tiny-math" / "gsm8k"),
        dataset_config=None,
        prompt_template="Question: {question}\nAnswer:\n",
        reference_template="{answer}",
        max_prompt_length=96,
        questions_per_device=2,
        num_generations=4,
        total_steps=2,
        max_completion_length=12,
        micro_batch_size=4,
        num_mini_batches=2,
        learning_rate=1e-4,
        eval_every=1,
        num_eval_examples=4,
        pass_k=2,
        output_dir=str(tmp_path),
        num_threads=1,
        seed=3,
    )
    base.update(kw)
    return grpo.Args(**base)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_each_variant_runs_end_to_end(assets, tmp_path, monkeypatch, loss_type):
    # untrained completions are never right; random rewards give the groups some variance to learn from
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(
        grpo, "success_reward", lambda text, gold, fmt: float(torch.rand(1, generator=gen).item() < 0.3)
    )
    args = _args(
        assets,
        tmp_path,
        loss_type=loss_type,
        run_name=loss_type,
        beta=0.04 if loss_type == "grpo" else 0.0,
        format_reward_coef=0.1,
    )
    metrics = grpo.main(args)
    rows = _rows(tmp_path / loss_type / "metrics.jsonl")
    train = [r for r in rows if "loss/policy" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        for key in (
            "objective/reward",
            "objective/entropy",
            "loss/policy",
            "policy/clipfrac",
            "perf/episodes_per_sec",
            "perf/peak_mem_gb",
            "objective/num_steps",
            "objective/completion_length",
            "episode",
            "time",
        ):
            assert key in r and math.isfinite(r[key]), key
    assert ("objective/kl" in train[0]) == (loss_type == "grpo")
    for r in train:  # per token: the per-completion sum over the mean length of the completions trained on
        length = r["objective/completion_length"]
        if loss_type != "dapo":  # (dynamic sampling trains on fewer than it sampled)
            assert r["objective/token_entropy"] == pytest.approx(r["objective/entropy"] / length)
        # the lengths of the right and the wrong answers average to the mean length, weighted by the success rate
        right, wrong = (r.get(f"objective/{k}_length", 0.0) for k in ("correct", "incorrect"))
        assert r["objective/success"] * right + (1 - r["objective/success"]) * wrong == pytest.approx(length)
    if loss_type == "dapo":
        assert 0.0 <= train[0]["objective/groups_dropped"] <= 1.0 and "objective/overlong" in train[0]
        assert train[1]["episode"] >= train[0]["episode"] + 8  # dropped groups count as sampled episodes
    else:
        assert [r["episode"] for r in train] == [8, 16]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1, 2]
    assert {"eval/pass@k", "eval/maj@k"} <= set(metrics)
    assert (tmp_path / loss_type / "model" / "model.safetensors").exists()
    assert (tmp_path / loss_type / "config.json").exists() and (tmp_path / loss_type / "samples.jsonl").exists()


def test_issue_52_flags_run_end_to_end_and_the_sequence_mean_counts_the_kept_completions(assets, tmp_path, monkeypatch):
    """--dual-clip, --kl-clamp, --entropy-coef and --overlong-filtering (a 6-token budget truncates most completions)
    with two mini-batches a step: `main` gives the `sequence` mean the number of completions in each mini-batch's loss,
    not the mini-batch size."""
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(
        grpo, "success_reward", lambda text, gold, fmt: float(torch.rand(1, generator=gen).item() < 0.3)
    )
    calls, loss = [], grpo.micro_batch_loss

    def recorded(model, packed, adv, mask, old, ref, args, num_sequences, *rest):
        calls.append((num_sequences, int((mask.sum(1) > 0).sum()), mask.shape[0]))
        return loss(model, packed, adv, mask, old, ref, args, num_sequences, *rest)

    monkeypatch.setattr(grpo, "micro_batch_loss", recorded)
    flags = dict(dual_clip=3.0, kl_clamp=10.0, entropy_coef=0.01, overlong_filtering=True, max_completion_length=6)
    grpo.main(_args(assets, tmp_path, run_name="f", pass_k=0, eval_every=2, save_model=False, beta=0.04, **flags))
    train = [r for r in _rows(tmp_path / "f" / "metrics.jsonl") if "loss/policy" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss/policy"]) for r in train)
    assert len(calls) == 4 and all(n == kept for n, kept, _ in calls)  # one micro-batch per mini-batch of 4
    assert any(kept < size for _, kept, size in calls), calls  # some completions were filtered


@pytest.mark.parametrize(
    "variant",
    [
        dict(importance_sampling_level="sequence"),
        dict(loss_type="cispo"),
        dict(advantage_estimator="reinforce_pp", beta=0.04),
        dict(advantage_estimator="reinforce_pp_baseline", beta=0.04),
    ],
    ids=["gspo", "cispo", "reinforce_pp", "reinforce_pp_baseline"],
)
def test_gspo_cispo_and_reinforce_pp_run_end_to_end(assets, tmp_path, monkeypatch, variant):
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(
        grpo, "success_reward", lambda text, gold, fmt: float(torch.rand(1, generator=gen).item() < 0.3)
    )
    args = _args(assets, tmp_path, run_name="v", pass_k=0, eval_every=2, save_model=False, **variant)
    grpo.main(args)
    train = [r for r in _rows(tmp_path / "v" / "metrics.jsonl") if "loss/policy" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss/policy"]) for r in train)
    assert ("objective/kl" in train[0]) == ("beta" in variant)
    assert json.loads((tmp_path / "v" / "config.json").read_text())["kl_estimator"] == (
        "k2" if variant.get("advantage_estimator") == "reinforce_pp_baseline" else "k3"
    )


@pytest.mark.parametrize("unscored_last", [False, True], ids=["scored", "unscored-last-token"])
def test_a_mismatched_sampler_is_logged_and_corrected(assets, tmp_path, monkeypatch, unscored_last):
    """The sampling loop's logprobs shifted by a known 0.3 per token (a sampler that disagrees with the trainer): the
    run logs the mismatch (mean |log pi_trainer - log pi_sampler| = 0.3) and the importance weights exp(0.3). A token
    the sampler did not score (NaN: the EOS that VLLMSampler appends) gets weight 1 and stays out of the mismatch
    statistics, which are means over the scored tokens (issue 41: it counted as a mismatch of 0, 0.3 diluted)."""
    real = grpo.generation.sample_with_kv_cache

    def shifted(*a, **kw):
        completions, logprobs = real(*a, **kw)
        logprobs = [lp - 0.3 for lp in logprobs]
        if unscored_last:
            logprobs = [torch.cat([lp[:-1], torch.tensor([float("nan")])]) for lp in logprobs]
        return completions, logprobs

    monkeypatch.setattr(grpo.generation, "sample_with_kv_cache", shifted)
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(
        grpo, "success_reward", lambda text, gold, fmt: float(torch.rand(1, generator=gen).item() < 0.3)
    )
    args = _args(
        assets,
        tmp_path,
        run_name="tis",
        pass_k=0,
        eval_every=2,
        save_model=False,
        sampler_logprobs=False,
        sampler_correction="token_truncate",
        num_mini_batches=1,
        total_steps=1,
    )
    grpo.main(args)
    row = next(r for r in _rows(tmp_path / "tis" / "metrics.jsonl") if "loss/policy" in r)
    assert row["mismatch/abs_logprob_diff"] == pytest.approx(0.3, abs=1e-4)
    assert row["mismatch/ratio_error"] == pytest.approx(math.exp(0.3) - 1, abs=1e-4)
    if unscored_last:  # the unscored tokens weigh 1: the mean weight sits between 1 and exp(0.3)
        assert 1.0 < row["mismatch/is_weight"] < math.exp(0.3) - 1e-3
        return
    assert row["mismatch/is_weight"] == pytest.approx(math.exp(0.3), abs=1e-4) and row["mismatch/capped_frac"] == 0.0
    with pytest.raises(SystemExit, match="^error: --sampler-correction token_truncate weights"):
        grpo.main(_args(assets, tmp_path, run_name="x", sampler_logprobs=True, sampler_correction="token_truncate"))


def test_distill_advantages_are_the_teacher_minus_student_logprobs():
    """Per token log pi_teacher - log pi_student (the negative one-sample reverse KL): teacher (0.5, 0.25), student
    (0.25, 0.25) give (log 2, 0); padding 0; no gradient reaches the student through the advantage."""
    teacher = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    student = torch.tensor([[math.log(0.25), math.log(0.25), -1.0]], requires_grad=True)
    adv = grpo.distill_advantages(teacher, student, torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(adv, torch.tensor([[math.log(2), 0.0, 0.0]]))
    assert not adv.requires_grad
    with pytest.raises(SystemExit, match="^error: on-policy distillation takes both"):
        grpo.resolve_variant(grpo.Args(advantage_estimator="distill"))


@pytest.mark.parametrize("teacher", ["tiny-llama", "tiny-neox"])
def test_a_student_learns_only_what_its_teacher_disagrees_with(assets, tmp_path, teacher):
    """On-policy distillation end to end: a student that is its own teacher has every advantage 0 (to the 1e-6 at which
    the sampler's logprobs match a forward pass; Adam would still turn that into steps, so the loss is checked, not
    the weights); from another teacher (tiny-neox, same tokenizer) it has a positive reverse KL and moves."""
    from safetensors.torch import load_file

    args = _args(
        assets,
        tmp_path,
        run_name=teacher,
        pass_k=0,
        eval_every=2,
        advantage_estimator="distill",
        teacher_model_path=str(assets / "models" / teacher),
    )
    grpo.main(args)
    row = next(r for r in _rows(tmp_path / teacher / "metrics.jsonl") if "loss/policy" in r)
    before = load_file(assets / "models" / "tiny-llama" / "model.safetensors")
    after = load_file(tmp_path / teacher / "model" / "model.safetensors")
    moved = max((after[k] - before[k]).abs().max().item() for k in before if k in after)
    if teacher == "tiny-llama":
        assert row["objective/teacher_kl"] == pytest.approx(0.0, abs=1e-4) and abs(row["loss/policy"]) < 1e-5
    else:
        assert row["objective/teacher_kl"] > 0.1 and moved > 0.0


def test_async_grpo_trains_one_step_off_policy_and_repeats_exactly(assets, tmp_path, monkeypatch):
    """--async: the batch of step s comes from the weights step s - 1 started from (lag 0 on the first step, then 1),
    and only the generator thread draws from the global RNG, so two runs give the same numbers."""
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(
        grpo, "success_reward", lambda text, gold, fmt: float(torch.rand(1, generator=gen).item() < 0.3)
    )
    rows = {}
    for name in ("a", "b", "recomputed"):
        gen.manual_seed(0)
        grpo.main(
            _args(
                assets,
                tmp_path,
                run_name=name,
                total_steps=3,
                pass_k=0,
                eval_every=3,
                save_model=False,
                async_generation=True,
                num_threads=2,
                # the sampling copy's logprobs by a forward pass (as in half precision) instead of the sampler's
                sampler_logprobs=name != "recomputed",
                sampler_correction="none",
            )
        )
        rows[name] = [
            {k: v for k, v in r.items() if not k.startswith(("time", "perf/"))}
            for r in _rows(tmp_path / name / "metrics.jsonl")
        ]
    train = [r for r in rows["a"] if "loss/policy" in r]
    assert [r["async/policy_lag"] for r in train] == [0, 1, 1]
    assert all(math.isfinite(r["loss/policy"]) for r in train)
    assert rows["a"] == rows["b"]
    recomputed = [r for r in rows["recomputed"] if "loss/policy" in r]
    for x, y in zip(train, recomputed):  # the forward pass's old logprobs equal the sampler's (float32, to 1e-5)
        assert x["loss/policy"] == pytest.approx(y["loss/policy"], rel=1e-3, abs=1e-5)


def test_dynamic_sampling_tops_up_when_no_group_has_signal(assets, tmp_path):
    # an untrained model is never right: every group is dropped, and after max_sampling_rounds the batch is
    # topped up with dropped groups so that every process still runs the same optimizer steps
    args = _args(
        assets,
        tmp_path,
        loss_type="dapo",
        run_name="topup",
        total_steps=1,
        max_sampling_rounds=2,
        overlong_buffer=0,
        pass_k=0,
        save_model=False,
    )
    grpo.main(args)
    train = [r for r in _rows(tmp_path / "topup" / "metrics.jsonl") if "loss/policy" in r]
    assert train[0]["objective/groups_dropped"] == 1.0 and train[0]["perf/sampling_rounds"] == 2
    assert train[0]["episode"] == 2 * 2 * 4  # two rounds of 2 questions x 4 completions


def test_learned_process_reward_runs_end_to_end(assets, tmp_path):
    prm_dir = tmp_path / "prm_model"  # not tmp_path / "prm": the run directory of run_name "prm"
    prm = AutoModelForSequenceClassification.from_pretrained(assets / "models" / "tiny-llama", num_labels=1)
    prm.score.weight.data.zero_()  # every step 0.5, below eta 0.6 (a random head passed or failed by the RNG state)
    prm.config.reward_type, prm.config.step_separator, prm.config.reward_bias = "process", "\n", 0.0
    prm.save_pretrained(prm_dir)
    AutoTokenizer.from_pretrained(assets / "models" / "tiny-llama").save_pretrained(prm_dir)
    args = _args(
        assets,
        tmp_path,
        run_name="prm",
        prm_path=str(prm_dir),
        prm_refine="clip",
        prm_clip_eta=0.6,
        total_steps=1,
        pass_k=0,
        save_model=False,
    )
    grpo.main(args)
    train = [r for r in _rows(tmp_path / "prm" / "metrics.jsonl") if "loss/policy" in r]
    assert train[0]["objective/process_rm"] < 0.0  # Clip: 0.5 - 0.6 a step, never positive
    assert train[0]["objective/reward"] == pytest.approx(
        train[0]["objective/success"] + train[0]["objective/process_rm"], abs=1e-5
    )


def test_non_finite_loss_is_an_error(assets, tmp_path, monkeypatch):
    # a one-line error advising a new run; no checkpoint of weights a bad step may have moved (none was written before)
    monkeypatch.setattr(
        grpo,
        "clipped_surrogate",
        lambda lr, adv, lo, hi, dual_clip=None: (lr * float("nan"), torch.zeros_like(lr, dtype=torch.bool)),
    )
    with pytest.raises(SystemExit, match=r"^error: non-finite GRPO loss at step 1: lower --learning-rate.*--overwrite"):
        grpo.main(_args(assets, tmp_path, run_name="nan", total_steps=1, pass_k=0, save_model=False))
    assert not (tmp_path / "nan" / "checkpoint").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM installed: tests/test_vllm.py")
def test_vllm_without_the_package_is_a_clear_error(assets, tmp_path):
    with pytest.raises(SystemExit, match="--use-vllm needs the `vllm` package"):
        grpo.main(_args(assets, tmp_path, run_name="vllm", use_vllm=True, total_steps=1))


def test_two_processes(assets, tmp_path):
    # an untrained policy is never right, so an untrained PRM (refine `none`: raw step probabilities) gives the groups
    # reward variance, hence gradients; it also runs the PRM under DDP
    prm = AutoModelForSequenceClassification.from_pretrained(assets / "models" / "tiny-llama", num_labels=1)
    prm.config.reward_type, prm.config.step_separator = "process", "\n"
    prm.save_pretrained(tmp_path / "prm")
    AutoTokenizer.from_pretrained(assets / "models" / "tiny-llama").save_pretrained(tmp_path / "prm")
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
    }
    cmd = launch_cmd(
        str(REPO / "grpo_math.py"),
        "tiny",
        "--model-name-or-path",
        str(assets / "models" / "tiny-llama"),
        "--dataset-name-or-path",
        str(assets / "tiny-math" / "gsm8k"),
        "--output-dir",
        str(tmp_path / "runs"),
        "--run-name",
        "ddp",
        "--total-steps",
        "2",
        "--questions-per-device",
        "2",
        "--num-generations",
        "4",
        "--max-completion-length",
        "12",
        "--micro-batch-size",
        "4",
        "--num-eval-examples",
        "6",
        "--eval-every",
        "1",
        "--pass-k",
        "2",
        "--beta",
        "0.04",
        "--loss-type",
        "dapo",
        "--dynamic-sampling",
        "False",
        "--prm-path",
        str(tmp_path / "prm"),
        "--prm-refine",
        "none",
        "--learning-rate",
        "1e-3",
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "ddp" / "metrics.jsonl")
    train = [r for r in rows if "loss/policy" in r]
    assert [r["episode"] for r in train] == [
        16,
        32,
    ]  # both ranks count: 2 processes x 2 questions x 4 completions per step
    assert all("objective/kl" in r and "objective/overlong" in r and r["objective/process_rm"] > 0 for r in train)
    assert train[1]["objective/kl"] > 0  # the second step starts from moved weights
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1, 2] and "eval/maj@k" in rows[-1]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "ddp" / "model")
    initial = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-llama")
    moved = [not torch.equal(a, b) for a, b in zip(model.state_dict().values(), initial.state_dict().values())]
    assert any(moved), "the weights did not move"


def test_check_packing_fails_for_a_model_that_ignores_position_ids(tiny, ignores_positions):
    _, model, _ = tiny
    packing.check_packing(model)  # a transformers model reads the packing from the position ids
    with pytest.raises(SystemExit, match="does not read packed sequences"):
        packing.check_packing(ignores_positions(model))


# ---------------------------------------------------------------------------------------------------------------
# Engines: optimizer steps under gradient accumulation, the ZeRO-3 sampling loop, the real MATH preset
# ---------------------------------------------------------------------------------------------------------------


def _count_adamw_steps(monkeypatch) -> list:
    """Every real optimizer step (accelerate skips the wrapped torch optimizer's step while accumulating)."""
    calls, original = [], torch.optim.AdamW.step

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counting)
    return calls


def test_optimizer_steps_once_per_mini_batch_with_micro_batches(assets, tmp_path, monkeypatch):
    # 2 questions x 4 completions = 8 per step, 2 mini-batches of 4, micro-batches of 3 (3 + 1: two backward passes
    # per optimizer step), 2 iterations, 2 steps: exactly 2 x 2 x 2 = 8 optimizer steps
    calls = _count_adamw_steps(monkeypatch)
    args = _args(
        assets,
        tmp_path,
        run_name="count",
        micro_batch_size=3,
        num_mini_batches=2,
        num_iterations=2,
        total_steps=2,
        pass_k=0,
        eval_every=10,
        save_model=False,
    )
    grpo.main(args)
    assert len(calls) == args.total_steps * args.num_mini_batches * args.num_iterations


STEP_COUNTER = """
import os, sys, torch, tyro
calls, original = [0], torch.optim.AdamW.step
def counting(self, *a, **k):
    calls[0] += 1
    return original(self, *a, **k)
torch.optim.AdamW.step = counting
import grpo_math
grpo_math.main(tyro.extras.overridable_config_cli(grpo_math.PRESETS, args=sys.argv[1:]))
open(os.path.join(os.environ["COUNT_DIR"], "rank" + os.environ.get("RANK", "0")), "w").write(str(calls[0]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="DeepSpeed on CPU")
def test_optimizer_steps_once_per_mini_batch_under_deepspeed(assets, tmp_path):
    # DeepSpeed steps inside `backward` at its own accumulation boundary: without the accumulation set to the
    # micro-batches of a mini-batch it would step on every micro-batch (here 2 x 2 x 2 = 8 steps, not 16)
    pytest.importorskip("deepspeed")
    (tmp_path / "count_steps.py").write_text(STEP_COUNTER)
    (tmp_path / "counts").mkdir()
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "DS_ACCELERATOR": "cpu",
        "COUNT_DIR": str(tmp_path / "counts"),
    }
    config = REPO / "benchmark" / "accelerate_configs" / "deepspeed_zero2.yaml"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        "1",
        "--main_process_port",
        str(free_port()),
        str(tmp_path / "count_steps.py"),
        "tiny",
        "--model-name-or-path",
        str(assets / "models" / "tiny-llama"),
        "--dataset-name-or-path",
        str(assets / "tiny-math" / "gsm8k"),
        "--output-dir",
        str(tmp_path / "runs"),
        "--run-name",
        "ds",
        *"--total-steps 2 --questions-per-device 2 "
        "--num-generations 4 --max-completion-length 12 --micro-batch-size 2 --num-mini-batches 2 --num-iterations 2 "
        "--num-eval-examples 2 --eval-every 10 --pass-k 0 --no-save-model --num-threads 1".split(),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "counts" / "rank0").read_text() == "8"


SYNCED_SAMPLER = """
import json, os, sys, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer
import grpo_math as grpo

class StopsByPosition(torch.nn.Module):
    # the tiny model, made to emit EOS once a position passes 18, so rows with longer prompts finish earlier
    def __init__(self, inner, eos):
        super().__init__()
        self.inner, self.eos, self.calls = inner, eos, 0
    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep=0):
        self.calls += 1
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep)
        out.logits[..., self.eos] += 100.0 * (position_ids[:, -out.logits.shape[1]:] >= 18)
        return out

dist.init_process_group("gloo")
rank, path = dist.get_rank(), sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = StopsByPosition(AutoModelForCausalLM.from_pretrained(path).eval(), tok.eos_token_id)
enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]
# rank 0: one prompt (one chunk); rank 1: five prompts of different lengths (three chunks of 2)
prompts = [enc("Question: " + "x " * (i + 1) + "?\\nAnswer:\\n") for i in range(1 if rank == 0 else 5)]
pad, eos = tok.pad_token_id, tok.eos_token_id
synced, synced_lp = grpo.generation.sample_with_kv_cache(model, prompts, pad, eos, 30, 0.0, batch_size=2, synced=True)
calls, model.calls = model.calls, 0
alone, alone_lp = grpo.generation.sample_with_kv_cache(model, prompts, pad, eos, 30, 0.0, batch_size=2)
same = synced == alone and all(torch.equal(a, b) for a, b in zip(synced_lp, alone_lp))
result = {"calls": calls, "alone_calls": model.calls, "same": same, "lengths": [len(c) for c in alone]}
json.dump(result, open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w"))
"""


def test_synced_sampler_makes_the_same_forward_calls_on_every_process(assets, tmp_path):
    # ZeRO-3: every forward pass is a collective, so a process with fewer prompts, or whose rows all finished, must keep
    # stepping with the others; its completions must equal the unsynced sampler's
    (tmp_path / "sampler.py").write_text(SYNCED_SAMPLER)
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "OUT_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(tmp_path / "sampler.py"),
        str(assets / "models" / "tiny-llama"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["same"] and r1["same"]
    assert len(set(r1["lengths"])) > 1 and max(r1["lengths"]) < 30  # rows finish at different steps, all by EOS
    assert r0["calls"] == r1["calls"] and r0["alone_calls"] < r0["calls"]  # rank 0 alone stops long before rank 1


def _real_assets() -> Path | None:
    from benchmark.tools.real_check import default_assets

    path = default_assets()
    return path if path is not None and path.is_dir() else None  # a CLEAN_RLHF_REAL_ASSETS that is not there: skip


@pytest.mark.skipif(_real_assets() is None, reason="no real assets (CLEAN_RLHF_REAL_ASSETS or ../shared/real-assets)")
def test_math_preset_prompt_has_the_instruction_once_and_fits(tmp_path):
    # the Qwen2.5-Math chat template's default system prompt is the instruction (Oat-Zero's qwen_math template); the
    # preset's prompt must not repeat it, and prompt + completion budget must fit Qwen2.5-Math-1.5B's 4096 positions
    from datasets import load_dataset

    assets = _real_assets()
    args = grpo.PRESETS["math-qwen2.5-math-1.5b"][1]
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen2.5-math")
    tokenizer = loading.ensure_pad_token(tokenizer, args.add_pad_token, "qwen2.5-math")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert args.max_prompt_length + args.max_completion_length <= 4096
    instruction = "Please reason step by step, and put your final answer within \\boxed{}."
    for name in ("math500_test.jsonl", "math_test_1000.jsonl"):
        ds = load_dataset("json", data_files=str(assets / "math" / name), split="train")
        strict = grpo.Args(**{**dataclasses.asdict(args), "drop_overlong": False})  # every real row must fit
        rows = prompts.prepare_math_questions(ds, tokenizer, strict, "test", grpo.extract_answer)
        assert len(rows) == len(ds)
        for row in rows:
            text = tokenizer.decode(row["prompt_ids"])
            assert text.count(instruction) == 1 and text.startswith("<|im_start|>system\n" + instruction + "<|im_end|>")
            assert len(row["prompt_ids"]) <= args.max_prompt_length


# runs grpo_math.main from the command line; with "bare", the generator thread's copy of the policy loses the autocast
# wrapper accelerate puts on the prepared model's forward (a copy made any other way has none): only an autocast taken
# in the thread itself then keeps the old logprobs in the learner's precision
_BF16_DRIVER = """
import sys, tyro, grpo_math
from clean_rlhf_utils import generation
if sys.argv.pop(1) == "bare":
    init = generation.BackgroundSampler.__init__
    def bare(self, *a, **k):
        init(self, *a, **k)
        self.policy.__dict__.pop("forward", None)
    generation.BackgroundSampler.__init__ = bare
grpo_math.main(tyro.extras.overridable_config_cli(grpo_math.PRESETS))
"""


@pytest.mark.parametrize("how", ["sync", "async", "async-bare-copy"])
def test_ratio_is_exactly_one_at_unmoved_weights_under_bf16_mixed_precision(assets, tmp_path, how):
    """bf16 mixed precision (accelerate's autocast), the weights held still (learning rate 1e-30, below float32's
    resolution) and one completion per micro-batch (the same packed rows for the old and the new logprobs): every ratio
    is exactly 1, with --async too. Autocast is per thread: the generator thread computes the old logprobs under its
    own `accelerator.autocast()`; without it a copy of the policy outside accelerate's wrapper gave float32 old
    logprobs and a mean ratio of 1.00017 here (issue 41)."""
    flags = ["--total-steps", "1", "--questions-per-device", "2", "--num-generations", "4", "--max-completion-length"]
    flags += ["12", "--micro-batch-size", "1", "--num-iterations", "2", "--num-eval-examples", "2", "--pass-k", "0"]
    flags += ["--num-threads", "1", "--run-name", "bf16", "--output-dir", str(tmp_path), "--dataset-config", "None"]
    flags += ["--model-name-or-path", str(assets / "models" / "tiny-llama"), "--learning-rate", "1e-30"]
    flags += ["--dataset-name-or-path", str(assets / "tiny-math" / "gsm8k"), "--sampler-correction", "none"]
    flags += ["--sampler-logprobs", "False"] + (["--async"] if how != "sync" else [])
    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": "bf16", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    bare = "bare" if how == "async-bare-copy" else "wrapped"
    cmd = [sys.executable, "-c", _BF16_DRIVER, bare, "tiny", *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [r for r in _rows(tmp_path / "bf16" / "metrics.jsonl") if "policy/ratio" in r]
    assert train[0]["policy/ratio"] == 1.0 and train[0]["policy/clipfrac"] == 0.0


# docs/grpo_math.md's table: (beta, epsilon_low, epsilon_high, aggregation, scale_rewards, dynamic_sampling, overlong)
# for each --loss-type and --importance-sampling-level; L = --max-completion-length
VARIANT_TABLE = {
    ("grpo", "token"): (0.04, 0.2, 0.2, "sequence", True, False, 0),
    ("grpo", "sequence"): (0.0, 3e-4, 4e-4, "sequence", True, False, 0),
    ("dr_grpo", "token"): (0.04, 0.2, 0.2, "fixed", False, False, 0),
    ("dr_grpo", "sequence"): (0.0, 3e-4, 4e-4, "fixed", False, False, 0),
    ("dapo", "token"): (0.0, 0.2, 0.28, "token", True, True, "L//5"),
    ("dapo", "sequence"): (0.0, 3e-4, 4e-4, "token", True, True, "L//5"),
    ("cispo", "token"): (0.0, 0.2, 4.0, "token", True, True, "L//5"),
    ("cispo", "sequence"): None,  # refused
}


@pytest.mark.parametrize("aggregation", [None, "sequence", "fixed", "token", "prompt"])
@pytest.mark.parametrize("loss_type, level", sorted(VARIANT_TABLE))
def test_every_variant_combination_resolves_to_the_documented_row(loss_type, level, aggregation):
    """Issue 41: `--loss-type dapo --importance-sampling-level sequence` resolved to GSPO's lower bound and DAPO's upper
    (3e-4 / 0.28). Every combination resolves to its row of docs/grpo_math.md's table, or is refused in one line; an
    explicit aggregation replaces the loss type's and changes nothing else."""
    args = grpo.Args(loss_type=loss_type, importance_sampling_level=level, loss_aggregation=aggregation)
    row = VARIANT_TABLE[(loss_type, level)]
    if row is None:
        with pytest.raises(SystemExit, match="pick one"):
            grpo.resolve_variant(args)
        return
    grpo.resolve_variant(args)
    beta, low, high, own_aggregation, scale, dynamic, overlong = row
    overlong = args.max_completion_length // 5 if overlong == "L//5" else overlong
    got = (args.beta, args.epsilon_low, args.epsilon_high, args.loss_aggregation, args.scale_rewards)
    assert got == (beta, low, high, aggregation or own_aggregation, scale)
    assert (args.dynamic_sampling, args.overlong_buffer) == (dynamic, overlong)
    table = (REPO / "docs" / "grpo_math.md").read_text()
    shown = f"| {loss_type} | {'sequence (GSPO)' if (loss_type, level) == ('grpo', 'sequence') else level} | "
    assert shown in table, f"docs/grpo_math.md's variant table has no row {shown!r}"


def test_vllm_sampler_appends_the_stop_eos_unscored_and_refuses_missing_logprobs():
    """VLLMSampler (vLLM faked: no GPU here): a completion that stopped on EOS without returning it gets the EOS
    appended with a NaN logprob (weight 1, outside the mismatch statistics); a completion whose logprobs miss a sampled
    token is an error, where it was silently all NaN, weight 1 and mismatch 0 (issue 41)."""
    from types import SimpleNamespace as NS

    sampler = object.__new__(grpo.generation.VLLMSampler)
    sampler.eos_id, sampler.vllm = 2, NS(SamplingParams=lambda **kw: kw)

    def step(token, logprob):
        return {token: NS(logprob=logprob)}

    full = NS(outputs=[NS(token_ids=[5, 6], logprobs=[step(5, -0.1), step(6, -0.2)], finish_reason="length")])
    stopped = NS(outputs=[NS(token_ids=[7], logprobs=[step(7, -0.3)], finish_reason="stop")])
    sampler.llm = NS(generate=lambda prompts, params, use_tqdm: [full, stopped])
    completions, logprobs = sampler([[1], [1]], 4, 1.0)
    assert completions == [[5, 6], [7, 2]]
    torch.testing.assert_close(logprobs[0], torch.tensor([-0.1, -0.2]))
    assert logprobs[1][0].item() == pytest.approx(-0.3) and logprobs[1][1].isnan()
    missing = NS(outputs=[NS(token_ids=[5, 6], logprobs=[step(5, -0.1), {}], finish_reason="length")])
    sampler.llm = NS(generate=lambda prompts, params, use_tqdm: [missing])
    with pytest.raises(SystemExit, match="^error: vLLM returned the logprobs of 1 of the 2 tokens"):
        sampler([[1]], 4, 1.0)


def test_the_log_ratio_bound_keeps_a_runaway_tokens_gradient_finite():
    """Issue 60: past exp's float32 overflow (log-ratio 88.7) the dual-clipped loss is right but its gradient is NaN;
    verl and OpenRLHF clamp the log-ratio to [-20, 20] first (gradient 0 past it). Both edges, by hand."""
    adv, mask = torch.tensor([-1.0]), torch.ones(1, 1)
    for bound, finite in ((None, False), (20.0, True)):
        logp = torch.tensor([[800.0]], requires_grad=True)
        loss, clipped = grpo.clipped_surrogate(
            grpo.importance_log_ratio(logp, torch.zeros(1, 1), mask, "token", bound), adv, 0.2, 0.2, 3.0
        )
        loss.sum().backward()
        assert loss.item() == 3.0 and clipped.item()  # -c * A: flat past ratio c
        assert torch.isfinite(logp.grad).all() == finite and (not finite or logp.grad.item() == 0.0)
    logp = torch.tensor([[-800.0]], requires_grad=True)  # the lower edge: ratio exp(-20), no gradient past it
    loss, _ = grpo.clipped_surrogate(
        grpo.importance_log_ratio(logp, torch.zeros(1, 1), mask, "token", 20.0), torch.tensor([1.0]), 0.2, 0.2
    )
    loss.sum().backward()
    assert loss.item() == pytest.approx(-math.exp(-20)) and logp.grad.item() == 0.0
    inside = torch.tensor([[0.1]], requires_grad=True)  # inside the bound nothing changes, value or gradient
    grads = []
    for bound in (None, 20.0):
        inside.grad = None
        grpo.clipped_surrogate(
            grpo.importance_log_ratio(inside, torch.zeros(1, 1), mask, "sequence", bound), torch.tensor([1.0]), 0.2, 0.2
        )[0].sum().backward()
        grads.append(inside.grad.clone())
    assert torch.equal(grads[0], grads[1]) and grads[0].item() == pytest.approx(-math.exp(0.1))
    # k3's log(ref / pi) bounded the same way (verl's low_var_kl): a finite estimate, and with --kl-clamp no NaN
    logp = torch.tensor([-800.0], requires_grad=True)
    assert grpo.k3_kl(logp, torch.zeros(1), 20.0).item() == pytest.approx(math.exp(20) - 21)
    assert math.isinf(grpo.k3_kl(logp.detach(), torch.zeros(1)).item())
    grpo.k3_kl(logp, torch.zeros(1), 20.0).clamp(-10, 10).sum().backward()
    assert logp.grad.item() == 0.0
    assert grpo.Args().log_ratio_clamp == 20.0  # verl's and OpenRLHF's default; never reached on the tiny world


def test_gspo_bounds_its_sequence_log_ratio_from_above_at_10_as_verl():
    """Issue 69: verl's `compute_policy_loss_gspo` clamps the sequence log-ratio at max 10 and no lower bound; the
    token bound of 20 let a sequence log-ratio of 15 with A = -1 cost exp(15) = 3.27e6, with a gradient. By hand:
    verl's flat exp(10) = 22026.47, no gradient; a log-ratio of -25 stays -25 (no lower bound)."""
    mask, adv = torch.ones(1, 2), torch.tensor([-1.0])
    logp = torch.tensor([[14.0, 16.0]], requires_grad=True)  # mean 15
    log_ratio = grpo.importance_log_ratio(logp, torch.zeros(1, 2), mask, "sequence", 20.0)
    assert log_ratio.tolist() == [[10.0, 10.0]]
    loss, _ = grpo.clipped_surrogate(log_ratio, adv, 3e-4, 4e-4)
    loss.sum().backward()
    assert loss[0, 0].item() == pytest.approx(math.exp(10)) and logp.grad.abs().sum().item() == 0.0
    low = grpo.importance_log_ratio(torch.tensor([[-24.0, -26.0]]), torch.zeros(1, 2), mask, "sequence", 20.0)
    assert low.tolist() == [[-25.0, -25.0]]
    tighter = grpo.importance_log_ratio(torch.tensor([[6.0, 6.0]]), torch.zeros(1, 2), mask, "sequence", 5.0)
    assert tighter.tolist() == [[5.0, 5.0]]  # a bound under 10 binds GSPO's too
    token = grpo.importance_log_ratio(torch.tensor([[15.0, -25.0]]), torch.zeros(1, 2), mask, "token", 20.0)
    assert token.tolist() == [[15.0, -20.0]]  # token ratios keep [-20, 20]


def test_reinforce_pp_baseline_takes_integer_and_half_precision_rewards():
    """Issue 60: integer rewards with the baseline raised (`mean` of an int tensor); half-precision rewards were
    centred in half precision (2048 and 2050: the mean 2049 rounds to 2048) before the cast to float32."""
    mask = torch.ones(4, 2)
    reference = grpo.reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), mask, 2, baseline=True)
    torch.testing.assert_close(
        grpo.reinforce_pp_advantages(torch.tensor([1, 0, 1, 1]), mask, 2, baseline=True), reference
    )
    half = grpo.reinforce_pp_advantages(torch.tensor([2048.0, 2050.0, 0.0, 2.0], dtype=torch.half), mask, 2, True)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half[:, 0], torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-6, rtol=0)  # each group: -1, 1
