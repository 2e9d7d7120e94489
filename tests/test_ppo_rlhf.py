"""ppo_rlhf.py: every piece of the PPO math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

import ppo_rlhf as ppo
from clean_rlhf_utils import data, generation, packing
from clean_rlhf_utils.args import check_ranges


def test_truncate_response_after_first_eos():
    responses = torch.tensor([[5, 6, 0, 7, 0], [5, 6, 7, 8, 9], [0, 5, 5, 5, 5]])
    out = ppo.truncate_response(responses, stop_token_id=0, pad_id=1)
    assert out.tolist() == [[5, 6, 0, 1, 1], [5, 6, 7, 8, 9], [0, 1, 1, 1, 1]]
    # index of the last real token: the EOS, or the last position when there is no EOS
    assert (ppo.first_true_indices(out == 1) - 1).tolist() == [2, 4, 0]


def test_gae_on_a_four_token_example_by_hand():
    rewards = torch.tensor([[0.1, -0.2, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 0.2]])
    gamma, lam = 1.0, 0.95
    d3 = 1.0 + 0 - 0.2
    d2 = 0.0 + 0.2 - 0.3
    d1 = -0.2 + 0.3 - 0.4
    d0 = 0.1 + 0.4 - 0.5
    a3 = d3
    a2 = d2 + lam * a3
    a1 = d1 + lam * a2
    a0 = d0 + lam * a1
    adv, ret = ppo.compute_gae(rewards, values, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2, a3]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.4, a2 + 0.3, a3 + 0.2]]))
    # with gamma < 1 the next value is discounted too
    adv_g, _ = ppo.compute_gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.2]]), 0.9, 0.5)
    b1 = 1.0 - 0.2
    b0 = 0.0 + 0.9 * 0.2 - 0.5 + 0.9 * 0.5 * b1
    torch.testing.assert_close(adv_g, torch.tensor([[b0, b1]]))


def test_masked_whitening_ignores_padding():
    values = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, -50.0, -50.0, -50.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = (valid - valid.mean()) / valid.std(unbiased=True)
    out = ppo.masked_whiten(values, mask)
    torch.testing.assert_close(out[mask.bool()], expected, atol=1e-4, rtol=1e-4)
    assert ppo.masked_mean(values, mask).item() == pytest.approx(2.5)


def test_per_token_rewards_put_kl_everywhere_and_the_score_one_after_eos():
    """N+: rewards = -kl_coef * kl, plus the score at actual_end = EOS + 1 if it is inside the tensor, else at the last
    real token (a response without EOS fills every column)."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, ppo.INVALID_LOGPROB], [-1.0, -1.0, -1.0, -1.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5, ppo.INVALID_LOGPROB], [-2.0, -1.0, -1.0, -0.5]])
    sequence_lengths = torch.tensor([2, 3])  # row 0 ends with EOS at index 2; row 1 has no EOS
    kl = ppo.kl_penalty(logprobs, ref_logprobs, "k1")
    kl = kl.masked_fill(torch.tensor([[False, False, False, True], [False] * 4]), 0)
    rewards, non_score = ppo.per_token_rewards(kl, torch.tensor([2.0, -1.0]), sequence_lengths, kl_coef=0.1)
    expected = torch.tensor([[-0.1 * 0.5, -0.1 * -1.0, 0.0, 0.0 + 2.0], [-0.1 * 1.0, 0.0, 0.0, -0.1 * -0.5 - 1.0]])
    torch.testing.assert_close(rewards, expected)
    torch.testing.assert_close(non_score, torch.tensor([[-0.05, 0.1, 0.0, 0.0], [-0.1, 0.0, 0.0, 0.05]]))
    # EOS in the last column: no room after it, so the score stays on the EOS
    last, _ = ppo.per_token_rewards(torch.zeros(1, 3), torch.tensor([5.0]), torch.tensor([2]), kl_coef=0.1)
    assert last.tolist() == [[0.0, 0.0, 5.0]]


def terminal_example(whiten_rewards: bool):
    """Main's steps 2-3 on a 2-row rollout, width 5 (= response_length): masks, per-token rewards, optional reward
    whitening, GAE. Row 0 ends with EOS at index 2; row 1 has no EOS (truncated, penalty score -1)."""
    sequence_lengths = torch.tensor([2, 4])
    response_idxs = torch.arange(5).repeat(2, 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    padding_mask_p1 = response_idxs > (sequence_lengths + 1).unsqueeze(1)
    kl = torch.tensor([[0.2, -0.1, 0.3, 7.0, 7.0], [0.1, 0.0, -0.2, 0.4, 0.1]]).masked_fill(padding_mask, 0)
    # row 0: V(EOS+1) = 1.9 is the value read at the EOS token's hidden state; 9.0 past it is masked out
    values = torch.tensor([[0.5, 0.4, 0.3, 1.9, 9.0], [0.2, 0.1, 0.0, -0.3, -0.5]]).masked_fill(padding_mask_p1, 0)
    rewards, _ = ppo.per_token_rewards(kl, torch.tensor([2.0, -1.0]), sequence_lengths, kl_coef=0.1)
    if whiten_rewards:
        rewards = ppo.masked_whiten(rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0)
    advantages, returns = ppo.compute_gae(rewards, values, gamma=1.0, lam=0.95)
    return rewards, values, advantages, returns, padding_mask_p1


def test_rewards_values_and_advantages_at_and_after_eos_by_hand():
    """N+ terminal handling, gamma 1, lambda 0.95. r_t = -0.1 kl_t, plus the score at EOS+1 (row 0: index 3) or at
    the last token when there is no room (row 1, no EOS: index 4). Values are kept up to EOS+1 and 0 after.
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}, returns R_t = A_t + V_t; so at EOS+1
    delta = score - V(EOS+1) and the value there is trained towards the score; past EOS+1 everything is 0."""
    rewards, values, adv, ret, _ = terminal_example(whiten_rewards=False)
    lam = 0.95
    expected_rewards = [[-0.02, 0.01, -0.03, 2.0, 0.0], [-0.01, 0.0, 0.02, -0.04, -0.01 - 1.0]]
    torch.testing.assert_close(rewards, torch.tensor(expected_rewards))
    torch.testing.assert_close(values, torch.tensor([[0.5, 0.4, 0.3, 1.9, 0.0], [0.2, 0.1, 0.0, -0.3, -0.5]]))
    # row 0 (EOS at 2, score 2.0 at 3)
    a4 = 0.0  # past EOS+1: r = 0, V = 0
    a3 = (2.0 + 0.0 - 1.9) + lam * a4  # EOS+1: score - V(EOS+1)
    a2 = (-0.03 + 1.9 - 0.3) + lam * a3  # EOS: its next value is V(EOS+1)
    a1 = (0.01 + 0.3 - 0.4) + lam * a2
    a0 = (-0.02 + 0.4 - 0.5) + lam * a1
    # row 1 (no EOS: penalty -1 at the last token, 4, where the next value is 0)
    b4 = -1.01 + 0.0 - (-0.5)
    b3 = (-0.04 + -0.5 - (-0.3)) + lam * b4
    b2 = (0.02 + -0.3 - 0.0) + lam * b3
    b1 = (0.0 + 0.0 - 0.1) + lam * b2
    b0 = (-0.01 + 0.1 - 0.2) + lam * b1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2, a3, a4], [b0, b1, b2, b3, b4]]))
    assert [a3, a2] == pytest.approx([0.1, 1.665]) and b0 == pytest.approx(-1.0788681875)
    torch.testing.assert_close(ret, adv + values)
    assert ret[0, 3].item() == pytest.approx(2.0) and ret[0, 4].item() == 0.0  # the value target at EOS+1 is the score


def test_whitened_rewards_include_the_score_position_and_stay_zero_past_eos_plus_one():
    """--whiten-rewards (N+): (r - mean) / std + mean over the positions up to EOS+1 (the score's included), 0 after."""
    rewards, _, _, _, padding_mask_p1 = terminal_example(whiten_rewards=True)
    valid = torch.tensor([-0.02, 0.01, -0.03, 2.0, -0.01, 0.0, 0.02, -0.04, -1.01])  # row 0 up to EOS+1, then row 1
    expected = (valid - valid.mean()) / valid.std(unbiased=True) + valid.mean()
    torch.testing.assert_close(rewards[~padding_mask_p1], expected, atol=1e-5, rtol=1e-5)
    assert rewards[0, 4].item() == 0.0 and padding_mask_p1.tolist() == [[False] * 4 + [True], [False] * 5]


def test_k3_estimator_matches_formula_and_is_non_negative():
    lp, ref = torch.tensor([-1.0, -2.0, -0.3]), torch.tensor([-1.5, -1.0, -0.3])
    d = lp - ref
    torch.testing.assert_close(ppo.kl_penalty(lp, ref, "k3"), torch.exp(-d) - 1 + d)
    assert (ppo.kl_penalty(lp, ref, "k3") >= 0).all()
    assert ppo.kl_penalty(lp, ref, "k3")[0].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.tensor([[True, True, True]])
    loss, stats = ppo.policy_loss(new, old, adv, mask, cliprange=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(1.0, 1.6) = 1.6 (clipped); token 2: max(-3.3, -3.3) = -3.3
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 3.3) / 3, rel=1e-5)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    masked, _ = ppo.policy_loss(new, old, adv, torch.tensor([[True, False, True]]), cliprange=0.2)
    assert masked.item() == pytest.approx((-1.2 - 3.3) / 2, rel=1e-5)
    # with `count`: the sum over the valid tokens / count (the minibatch's valid tokens, see ppo_micro_batch)
    summed, _ = ppo.policy_loss(new, old, adv, torch.tensor([[True, False, True]]), cliprange=0.2, count=10.0)
    assert summed.item() == pytest.approx((-1.2 - 3.3) / 10, rel=1e-5)


def test_dual_clip_bounds_a_runaway_negative_advantage_token():
    """Dual-clip PPO (verl's clip_ratio_c, OpenRLHF's --dual_clip; issue 52): ratio 5, A = -1, clip 0.2. PPO:
    max(-A r, -A clip(r)) = max(5, 1.2) = 5 with d loss / d log r = 5; dual clip c = 3: min(5, 3 |A|) = 3, gradient 0,
    counted in clipfrac. A token below c keeps PPO's loss (ratio 2, A = -1: 2)."""
    new = torch.tensor([[math.log(5.0), math.log(2.0)]], requires_grad=True)
    adv, mask = torch.tensor([[-1.0, -1.0]]), torch.tensor([[True, True]])
    loss, stats = ppo.policy_loss(new, torch.zeros(1, 2), adv, mask, cliprange=0.2, count=1.0)
    loss.backward()
    assert loss.item() == pytest.approx(7.0) and stats["clipfrac"].item() == 0.0
    torch.testing.assert_close(new.grad, torch.tensor([[5.0, 2.0]]))
    new.grad = None
    loss, stats = ppo.policy_loss(new, torch.zeros(1, 2), adv, mask, cliprange=0.2, count=1.0, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.0 + 2.0) and stats["clipfrac"].item() == 0.5
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 2.0]]))
    assert ppo.Args().dual_clip is None  # off: the N+ recipe has no dual clip
    with pytest.raises(SystemExit, match="--dual-clip is 0.5; it must be above 1"):
        check_ranges(ppo.Args(dual_clip=0.5))


def test_kl_clamp_bounds_the_estimate_with_no_gradient_past_it():
    """verl clamps k3 to [-10, 10], OpenRLHF every estimator: ref - logp = 3 gives k3 = e^3 - 3 - 1 = 16.0855, 10 when
    clamped; k1 = logp - ref = -12 gives -10; inside the bound (k3 of 0.5: 0.1487) nothing changes."""
    lp = torch.tensor([-4.0, -1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.0, 11.0, -2.5])
    assert ppo.kl_penalty(lp, ref, "k3")[0].item() == pytest.approx(math.exp(3) - 4)
    clamped = ppo.kl_penalty(lp, ref, "k3", clamp=10.0)
    torch.testing.assert_close(clamped.detach(), torch.tensor([10.0, 10.0, math.exp(-0.5) - 1 + 0.5]))
    torch.testing.assert_close(ppo.kl_penalty(lp, ref, "k1", clamp=10.0).detach(), torch.tensor([-3.0, -10.0, 0.5]))
    clamped.sum().backward()
    assert lp.grad[:2].tolist() == [0.0, 0.0] and lp.grad[2].item() == pytest.approx(1 - math.exp(-0.5))
    with pytest.raises(SystemExit, match="--kl-clamp is 0.0; it must be above 0"):
        check_ranges(ppo.Args(kl_clamp=0.0))


class TwoWordPolicyAndValue(torch.nn.Module):
    """`PolicyAndValue`'s interface with logits that are the parameter z (one response, two columns, a two-word
    vocabulary) and values 0, so `ppo_micro_batch` runs its own code on numbers small enough to check by hand."""

    def __init__(self, z: torch.Tensor):
        super().__init__()
        self.z = torch.nn.Parameter(z)

    def forward(self, input_ids, position_ids, index, with_policy=True, with_value=True):
        return self.z, torch.zeros(1, 2)


def test_entropy_bonus_gradient_is_minus_coef_times_the_entropy_gradient():
    """verl's entropy_coeff in PPO's policy loss: the response's one token (word 1) has logits (0, log 3), p = (1/4,
    3/4), H = 0.56234, dH/dz = -p (log p + H) = (0.20599, -0.20599). At advantage 0 the surrogate adds no gradient, so
    with coef 0.1 over one valid token dz = -0.1 dH/dz; the second column is padding and gets none. pg_loss logs the
    surrogate alone."""
    from accelerate import Accelerator

    p = torch.tensor([0.25, 0.75])
    h = -(p * p.log()).sum()
    grads = {}
    for coef in (None, 0.1):
        model = TwoWordPolicyAndValue(torch.tensor([[[0.0, math.log(3.0)], [5.0, 0.0]]]))
        rollout = {k: torch.zeros(1, 2) for k in ("logprobs", "values", "returns", "advantages")}
        rollout.update(padding_mask=torch.tensor([[False, True]]), padding_mask_p1=torch.tensor([[False, False]]))
        args = ppo.Args(entropy_coef=coef, temperature=1.0)
        out = ppo.ppo_micro_batch(model, Accelerator(cpu=True), [[0]], [[1]], rollout, (1.0, 2.0), args, False, 0)
        assert out["pg_loss"].item() == 0.0
        grads[coef] = model.z.grad[0]
    assert grads[None].abs().max().item() == 0.0
    torch.testing.assert_close(grads[0.1][0], -0.1 * -p * (p.log() + h), atol=1e-6, rtol=1e-5)
    assert grads[0.1][0, 0].item() == pytest.approx(-0.020599, abs=1e-6) and grads[0.1][1].abs().max().item() == 0.0


def test_clipped_value_loss_by_hand():
    vpred, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[2.0, 1.0]])
    loss, clipfrac = ppo.value_loss(vpred, old, ret, torch.tensor([[True, True]]), cliprange_value=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped (0.7-2)^2 = 1.69 -> 1.69; token 1: both (0-1)^2 = 1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2, rel=1e-5)
    assert clipfrac.item() == pytest.approx(0.5)
    summed, _ = ppo.value_loss(vpred, old, ret, torch.tensor([[True, True]]), cliprange_value=0.2, count=1.0)
    assert summed.item() == pytest.approx(0.5 * (1.69 + 1.0), rel=1e-5)


def test_clip_and_delta_on_a_three_step_example():
    """Gao et al. 2024 (arXiv:2410.15115), K steps, alpha scaling every mode:
    clip: r'_k = alpha * min(r_k - eta, 0);
    delta: r'_k = r_k - r_{k+1} for k < K-1, r'_{K-1} = r_{K-1}, r'_K = 0 (the last step's process reward is dropped,
    the answer is judged by the success reward alone), so sum_{t >= k} r'_t = r_k for k <= K-1;
    clip_delta: clip, then delta."""
    r = [0.9, 0.6, 0.8]
    assert ppo.refine_step_rewards(r, "none", 2.0, 0.5) == pytest.approx([1.8, 1.2, 1.6])
    assert ppo.refine_step_rewards(r, "clip", 2.0, 0.7) == pytest.approx([0.0, 2.0 * -0.1, 0.0])
    # delta, K = 3: r'_1 = r_1 - r_2 = 0.3, r'_2 = r_2 = 0.6, r'_3 = 0
    delta = ppo.refine_step_rewards(r, "delta", 1.0, 0.5)
    assert delta == pytest.approx([0.3, 0.6, 0.0])
    assert [sum(delta[k:]) for k in range(2)] == pytest.approx([0.9, 0.6])  # the return from step k is r_k
    assert ppo.refine_step_rewards(r, "delta", 2.0, 0.5) == pytest.approx([0.6, 1.2, 0.0])
    # clip_delta, eta 0.7: clipped c = [min(0.2, 0), min(-0.1, 0), min(0.1, 0)] = [0, -0.1, 0]; then c_1 - c_2 = 0.1,
    # c_2 = -0.1, 0
    assert ppo.refine_step_rewards(r, "clip_delta", 1.0, 0.7) == pytest.approx([0.1, -0.1, 0.0])
    # K = 1: the only step is the answer, judged by the success reward alone; K = 2: [r_1, 0]; K = 0: nothing
    assert ppo.refine_step_rewards([0.9], "delta", 1.0, 0.5) == [0.0]
    assert ppo.refine_step_rewards([0.3], "clip_delta", 1.0, 0.5) == [0.0]
    assert ppo.refine_step_rewards([0.9, 0.6], "delta", 1.0, 0.5) == pytest.approx([0.9, 0.0])
    assert ppo.refine_step_rewards([], "delta", 1.0, 0.5) == []
    # more steps cannot earn more under delta: the return from the first step is r_1 whatever follows
    assert sum(ppo.refine_step_rewards(r + [0.95, 0.95], "delta", 1.0, 0.5)) == pytest.approx(0.9)


def test_adaptive_kl_controller_moves_towards_target():
    ctl = ppo.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=1000)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 1000 / 10000))
    ctl.update(current_kl=3.0, n_steps=1000)  # error -0.5 clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.98)


def test_success_reward_and_position_ids_of_padded_inputs():
    assert ppo.success_reward("3 + 4 = 7 pens.\n#### 7", "7", "gsm8k") == 1.0
    assert ppo.success_reward("#### 8", "7", "gsm8k") == 0.0
    assert ppo.success_reward("no answer", "7", "gsm8k") == 0.0
    assert ppo.success_reward("so $\\boxed{7}$", "7", "boxed") == 1.0
    assert ppo.success_reward("so $\\boxed{0.5}$", "\\frac{1}{2}", "boxed") == 1.0  # math-verify, as grpo_math.py
    inputs = ppo.padded_inputs(torch.tensor([[1, 1, 5, 6, 0, 1], [5, 6, 7, 8, 9, 0]]), pad_id=1)
    assert inputs["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert inputs["position_ids"][0, 2:5].tolist() == [0, 1, 2] and inputs["position_ids"][1].tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]


def test_ppo_runs_on_two_processes(assets, tmp_path):
    """PPO under `accelerate launch --multi_gpu --num_processes 2` (gloo on CPU): both ranks' episodes are counted,
    every log row has episode/time, and the saved policy moved away from its start."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from tests.launch import launch_cmd

    repo = Path(__file__).resolve().parent.parent
    cmd = launch_cmd(
        str(repo / "ppo_rlhf.py"),
        "tiny-math",
        "--sft-model-path",
        str(assets / "models" / "tiny-llama"),
        "--dataset-name-or-path",
        str(assets / "tiny-math" / "gsm8k"),
        "--output-dir",
        str(tmp_path / "runs"),
        "--run-name",
        "ddp",
        "--response-length",
        "12",
        "--num-eval-examples",
        "6",
        "--per-device-eval-batch-size",
        "3",
        "--eval-every",
        "1",
        "--num-threads",
        "1",
        "--total-episodes",
        "32",
        "--per-device-batch-size",
        "8",
        "--num-mini-batches",
        "2",
    )
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert all("episode" in r and "time" in r for r in rows)
    assert [r["episode"] for r in rows if "loss/policy_avg" in r] == [16, 32]  # 2 processes x 8 responses per update
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "ddp" / "model")
    initial = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-llama")
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), initial.state_dict().values()))


@pytest.mark.parametrize("arch", ["tiny-neox", "tiny-llama"])
def test_packed_logprobs_values_rewards_and_gradients_equal_each_sequence_alone(assets, arch):
    """The packed row (all sequences end to end, no padding, packed_sdpa attention) gives each response token's logprob
    and value, the value at the last token (trained by N+) and the reward, as one unpadded forward pass of that
    query + response alone under SDPA; and the same gradients for the PPO losses."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(assets / "models" / arch).eval()
    value_model = AutoModelForSequenceClassification.from_pretrained(assets / "models" / arch, num_labels=1).eval()
    reward_model = AutoModelForSequenceClassification.from_pretrained(assets / "models" / arch, num_labels=1).eval()
    reward_model.config.reward_bias = 0.25
    for m in (policy, value_model, reward_model):
        assert packing.use_packed_attention(m).config._attn_implementation == "packed_sdpa"
    model = ppo.PolicyAndValue(policy, value_model)
    packing.check_one_row_packing(policy)
    eos, pad = policy.config.eos_token_id, 1
    queries = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18]]
    queries_t, qmask = data.left_pad(queries, pad)
    with packing.padded_attention(policy):
        responses, sampled_logprobs, _ = generation.sample_responses(
            policy, queries_t, qmask, eos, pad, 10, temperature=0.7
        )
    assert policy.config._attn_implementation == "packed_sdpa"  # switched back after sampling
    lists = [row[: row.index(eos) + 1] if eos in row else row for row in responses.tolist()]
    lists[-1] = lists[-1][:1]  # a one-token response
    packed = packing.pack_one_row(queries, lists, pad)
    lengths = [len(q) + len(r) for q, r in zip(queries, lists)]
    assert (
        packed["input_ids"].shape == (1, sum(lengths)) and packed["targets"].shape[1] == max(len(r) for r in lists) + 1
    )
    assert packed["position_ids"][0].tolist() == [t for n in lengths for t in range(n)]
    assert packed["last"].tolist() == [sum(lengths[: i + 1]) - 1 for i in range(len(lengths))]

    last_mlp_tokens = []  # how many tokens the last layer's MLP of each model ran on (last_mlp_only_at)
    for m in (policy, value_model, reward_model):
        getattr(m, m.base_model_prefix).layers[-1].mlp.register_forward_hook(
            lambda mod, args, out: last_mlp_tokens.append(args[0].shape[1])
        )
    logits, values = model(**{k: packed[k] for k in ("input_ids", "position_ids", "index")})
    logprobs = ppo.response_logprobs(logits, packed["targets"], temperature=0.7)
    with torch.no_grad():
        rewards = reward_model.score(packing.packed_hidden(reward_model, packed, packed["last"])).squeeze(-1) + 0.25
    response_positions = sum(len(r) + 1 for r in lists)  # the logits of each response token, and its last token's value
    assert last_mlp_tokens == [response_positions, response_positions, len(lists)]
    mask, mask_p1 = torch.zeros_like(logprobs, dtype=torch.bool), torch.zeros_like(values, dtype=torch.bool)
    for i, r in enumerate(lists):
        mask[i, : len(r)], mask_p1[i, : len(r) + 1] = True, True
    (logprobs * mask).sum().backward(retain_graph=True)
    (values * mask_p1 * torch.arange(values.shape[1])).sum().backward()  # a different weight per position
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    with packing.padded_attention(policy, value_model, reward_model):
        assert policy.config._attn_implementation == "sdpa"
        for i, (q, r) in enumerate(zip(queries, lists)):
            ids = torch.tensor([q + r])
            alone_logits = policy(input_ids=ids).logits[0, len(q) - 1 : -1] / (0.7 + 1e-7)
            alone_lp = alone_logits.log_softmax(-1).gather(1, torch.tensor(r)[:, None]).squeeze(1)
            body = getattr(value_model, value_model.base_model_prefix)
            alone_values = value_model.score(body(input_ids=ids).last_hidden_state)[
                0, len(q) - 1 :, 0
            ]  # up to the last token
            torch.testing.assert_close(logprobs[i, : len(r)], alone_lp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                sampled_logprobs[i, : len(r)].detach(), alone_lp.detach(), atol=1e-4, rtol=1e-4
            )  # --sampler-logprobs
            torch.testing.assert_close(values[i, : len(r) + 1], alone_values, atol=1e-5, rtol=1e-5)
            with torch.no_grad():
                torch.testing.assert_close(
                    rewards[i], ppo.outcome_reward(reward_model, ids, torch.ones_like(ids))[0], atol=1e-5, rtol=1e-5
                )
            alone_lp.sum().backward()
            (alone_values * torch.arange(len(r) + 1)).sum().backward()
    for got, want in zip(packed_grads, (p.grad for p in model.parameters())):
        # a float32 sum over every token rounds in proportion to the gradient's own scale (by how much depends on the
        # CPU's kernels: AVX-512 differs from AVX2); a packing error would be of the order of the gradient itself
        torch.testing.assert_close(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-4)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_per_sequence_equals_gathered_and_causal_attention_alone(kv_heads):
    """packed_sdpa's CPU path (one SDPA call per sequence) and its GPU path (`attend_gathered`: one padded batch) give
    each sequence's causal attention alone, outputs and gradients, with grouped key / value heads too."""
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    T = sum(lengths)
    q = torch.randn(1, 4, T, 8, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, T, 8, requires_grad=True) for _ in range(2))
    position_ids = torch.tensor([[t for n in lengths for t in range(n)]])
    module = torch.nn.Module().eval()
    out, _ = packing.packed_sdpa_attention(module, q, k, v, None, scaling=0.3, position_ids=position_ids)
    assert out.shape == (1, T, 4, 8)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    starts = torch.tensor([0, 5, 6, 15])
    gathered = packing.attend_gathered(q, k, v, starts, torch.tensor(lengths), scale=0.3, enable_gqa=kv_heads != 4)
    torch.testing.assert_close(gathered, out)
    for got, want in zip(torch.autograd.grad((gathered * weights).sum(), (q, k, v)), grads):
        torch.testing.assert_close(got, want)
    for s, n in zip(starts.tolist(), lengths):  # by hand: softmax(q k^T * scale + causal mask) v, one sequence alone
        qs, ks, vs = (
            q[0, :, s : s + n],
            k[0, :, s : s + n].repeat_interleave(4 // kv_heads, 0),
            v[0, :, s : s + n].repeat_interleave(4 // kv_heads, 0),
        )
        scores = (qs @ ks.transpose(1, 2) * 0.3).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(out[0, s : s + n], (scores.softmax(-1) @ vs).transpose(0, 1))


@pytest.mark.parametrize("arch", ["tiny-neox", "tiny-llama"])
def test_packed_attention_keeps_no_fused_qkv_output_for_backward(assets, arch):
    """What a packed training pass saves for its backward pass: with GPT-NeoX's fused QKV projection, no tensor kept
    by autograd lives in a (tokens x 3 x hidden) storage (packed_sdpa copies the value out of it), and the tensors
    saved in all are fewer bytes than with that copy undone (Llama's separate projections have nothing to copy)."""
    from transformers import AutoModelForCausalLM

    policy = packing.use_packed_attention(AutoModelForCausalLM.from_pretrained(assets / "models" / arch)).train()
    hidden = policy.config.hidden_size
    queries, responses = [[5 + i for i in range(n)] for n in (7, 4, 9)], [[40, 41, 42], [43], [44, 45]]
    packed = packing.pack_one_row(queries, responses, 1)
    T = packed["input_ids"].shape[1]

    def saved_storages():
        storages = {}

        def keep(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            policy(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
        return storages

    with_copy = saved_storages()
    fused = 3 * hidden * T * 4  # float32
    assert fused not in with_copy.values()
    contiguous = torch.Tensor.contiguous
    with pytest.MonkeyPatch.context() as mp:  # undo the copy: the value stays a view of whatever produced it
        mp.setattr(torch.Tensor, "contiguous", lambda t, *a, **kw: t if t.dim() == 4 else contiguous(t, *a, **kw))
        without_copy = saved_storages()
    if arch == "tiny-neox":
        assert fused in without_copy.values()
        assert sum(without_copy.values()) - sum(with_copy.values()) == pytest.approx(
            2 * hidden * T * 4 * policy.config.num_hidden_layers, rel=0.01
        )
    else:
        assert sum(without_copy.values()) == sum(with_copy.values())


def test_packed_attention_refuses_what_it_cannot_compute(assets, ignores_positions):
    """A model whose attention ignores the position ids fails check_one_row_packing; packed_sdpa called on a padded
    batch or without position ids fails loudly instead of attending across sequences."""
    from transformers import AutoModelForCausalLM

    policy = packing.use_packed_attention(AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-neox").eval())
    packing.check_one_row_packing(policy)
    with pytest.raises(SystemExit, match="does not read packed sequences"):
        packing.check_one_row_packing(ignores_positions(policy))
    with pytest.raises(RuntimeError, match="one packed row"):
        policy(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), use_cache=False)


def test_separate_backward_trains_exactly_as_one_backward(assets, tmp_path, monkeypatch):
    """--separate-backward (the policy's forward and backward, then the value model's) against one backward pass of the
    summed loss: the same losses at every update and the same final policy, on tiny-neox, whose fused QKV projection
    also takes packed_sdpa's copy of the value."""
    import json

    from transformers import AutoModelForCausalLM

    calls = []
    forward = ppo.PolicyAndValue.forward

    def recording(self, *a, with_policy=True, with_value=True, **kw):
        if torch.is_grad_enabled():  # the training passes, not the rollout's
            calls.append((with_policy, with_value))
        return forward(self, *a, with_policy=with_policy, with_value=with_value, **kw)

    monkeypatch.setattr(ppo.PolicyAndValue, "forward", recording)
    runs = {}
    for separate in (True, False):
        calls.clear()
        args = ppo.Args(
            exp_name="sep",
            run_name=f"sep_{separate}",
            output_dir=str(tmp_path),
            seed=5,
            num_threads=1,
            sft_model_path=str(assets / "models" / "tiny-neox"),
            reward_model_path=None,
            reward_source="math",
            dataset_name_or_path=str(assets / "tiny-math" / "gsm8k"),
            eval_split="test",
            prompt_template="Question: {question}\nAnswer:\n",
            reference_template="{answer}",
            max_prompt_length=96,
            response_length=10,
            temperature=1.0,
            total_episodes=16,
            per_device_batch_size=8,
            num_mini_batches=2,
            gradient_accumulation_steps=2,
            num_ppo_epochs=2,
            learning_rate=1e-3,
            eval_every=100,
            num_eval_examples=2,
            separate_backward=separate,
        )
        ppo.main(args)
        # 2 updates x 2 epochs x 2 minibatches x 2 micro-batches
        assert calls == ([(True, False), (False, True)] * 16 if separate else [(True, True)] * 16)
        rows = [json.loads(line) for line in (tmp_path / f"sep_{separate}" / "metrics.jsonl").read_text().splitlines()]
        runs[separate] = (
            [
                {k: v for k, v in r.items() if "/" in k and not k.startswith("perf/")}
                for r in rows
                if "loss/policy_avg" in r
            ],
            AutoModelForCausalLM.from_pretrained(tmp_path / f"sep_{separate}" / "model").state_dict(),
        )
    (rows_sep, weights_sep), (rows_one, weights_one) = runs[True], runs[False]
    assert len(rows_sep) == 2 and rows_sep[1]["loss/value_avg"] != rows_sep[0]["loss/value_avg"]
    for a, b in zip(rows_sep, rows_one):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    initial = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-neox").state_dict()
    assert any(not torch.equal(weights_sep[k], initial[k]) for k in initial)
    for k in weights_one:
        torch.testing.assert_close(weights_sep[k], weights_one[k], rtol=1e-5, atol=1e-6)


def test_value_at_eos_plus_one_starts_at_the_reward_models_score(assets):
    """N+'s critic is the normalised reward model: a value is the value head plus config.reward_bias, so at
    initialisation (value model = reward model) the value one past EOS, read at the EOS token's hidden state, equals
    the reward model's score (head + bias) of the same query + response."""
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    path = assets / "models" / "tiny-llama"
    reward_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    reward_model.config.reward_bias = 3.0
    value_model = packing.use_packed_attention(copy.deepcopy(reward_model))
    policy = packing.use_packed_attention(AutoModelForCausalLM.from_pretrained(path).eval())
    model, eos = ppo.PolicyAndValue(policy, value_model), policy.config.eos_token_id
    queries, responses = [[5, 6, 7, 8], [10, 11]], [[20, 21, eos], [30, 31, 32, 33, eos]]
    packed = packing.pack_one_row(queries, responses, pad_id=1)
    with torch.no_grad():
        _, values = model(**{k: packed[k] for k in ("input_ids", "position_ids", "index")}, with_policy=False)
        for i, (q, r) in enumerate(zip(queries, responses)):
            ids = torch.tensor([q + r])
            score = ppo.outcome_reward(reward_model, ids, torch.ones_like(ids))[0]
            assert values[i, len(r)].item() == pytest.approx(score.item(), abs=1e-5)  # index len(r) = EOS + 1
            assert abs(score.item() - 3.0) < 1.0  # the bias is most of it: without it the two would differ by 3


@pytest.fixture
def eager_to_stop(assets, tmp_path):
    """tiny-neox whose output embedding favours EOS (about 2 in 3 tokens at temperature 1): responses end early."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-neox")
    with torch.no_grad():  # final hidden state + 10 e_0, EOS logit + 7
        model.gpt_neox.final_layer_norm.bias[0] = 10.0
        model.get_output_embeddings().weight[model.config.eos_token_id, 0] = 0.7
    model.save_pretrained(tmp_path / "eager")
    AutoTokenizer.from_pretrained(assets / "models" / "tiny-neox").save_pretrained(tmp_path / "eager")
    return tmp_path / "eager"


@pytest.mark.parametrize("stop_token", ["none", "eos"])
def test_stop_token_and_the_column_for_the_score_after_eos(eager_to_stop, assets, tmp_path, monkeypatch, stop_token):
    """`--stop-token none` samples and keeps response_length tokens in every row (EOS included, as N+ with
    min_new_tokens): the logged completion length is response_length. `eos`: responses end at EOS, the longest after
    R < response_length tokens, and rewards / values get R + 1 columns, so the longest response's value at EOS+1 (read
    at its EOS) is filled in and the score lands there; everything past EOS+1 is 0."""
    import json

    seen = {}
    gae = ppo.compute_gae

    def recording(rewards, values, gamma, lam):
        seen["rewards"], seen["values"] = rewards.clone(), values.clone()
        return gae(rewards, values, gamma, lam)

    rewards_of = ppo.per_token_rewards

    def recording_lengths(kl, scores, sequence_lengths, kl_coef):
        seen["sequence_lengths"] = sequence_lengths.clone()
        return rewards_of(kl, scores, sequence_lengths, kl_coef)

    monkeypatch.setattr(ppo, "compute_gae", recording)
    monkeypatch.setattr(ppo, "per_token_rewards", recording_lengths)
    monkeypatch.setattr(ppo, "success_reward", lambda *a: 1.0)  # every score 1, to see where it lands
    args = ppo.Args(
        exp_name="stop",
        run_name=f"stop_{stop_token}",
        output_dir=str(tmp_path),
        seed=3,
        num_threads=1,
        sft_model_path=str(eager_to_stop),
        reward_model_path=None,
        reward_source="math",
        dataset_name_or_path=str(assets / "tiny-math" / "gsm8k"),
        eval_split="test",
        prompt_template="Question: {question}\nAnswer:\n",
        reference_template="{answer}",
        max_prompt_length=96,
        response_length=10,
        temperature=1.0,
        total_episodes=8,
        per_device_batch_size=8,
        num_mini_batches=1,
        num_ppo_epochs=1,
        eval_every=100,
        num_eval_examples=2,
        save_model=False,
        stop_token=stop_token,
        non_eos_penalty=False,
    )
    ppo.main(args)
    row = next(
        json.loads(line)
        for line in (tmp_path / f"stop_{stop_token}" / "metrics.jsonl").read_text().splitlines()
        if "objective/completion_length" in json.loads(line)
    )
    rewards, values = seen["rewards"], seen["values"]
    if stop_token == "none":
        assert row["objective/completion_length"] == 10 and rewards.shape[1] == 10
        assert row["val/num_eos_tokens"] > 1  # EOS were sampled and kept inside the responses
        torch.testing.assert_close(rewards[:, 9], torch.ones(8), atol=1e-5, rtol=0)  # the score on the last token
        return
    last = seen["sequence_lengths"]  # the index of each row's EOS
    R = int(last.max()) + 1  # the longest response
    assert R < 10 and rewards.shape[1] == values.shape[1] == R + 1 and row["objective/completion_length"] < 10
    assert (values[last == R - 1, R] != 0).all()  # the longest responses' value at EOS+1
    for i, s in enumerate(last.tolist()):
        assert rewards[i, s + 1].item() == pytest.approx(1.0, abs=1e-5)  # the score one past EOS (KL there is 0)
        assert (rewards[i, s + 2 :] == 0).all() and (values[i, s + 2 :] == 0).all()


@pytest.mark.parametrize("separate", [True, False], ids=["separate-backward", "one-backward"])
def test_issue_52_flags_train_end_to_end(assets, tmp_path, separate):
    """--dual-clip, --kl-clamp and --entropy-coef together through `main` (two updates of two PPO epochs, both backward
    paths): finite losses, and a training different from the same run without them."""
    import json

    losses = {}
    for flags in ({}, dict(dual_clip=3.0, kl_clamp=10.0, entropy_coef=0.1)):
        name = f"f{len(flags)}"
        args = ppo.Args(
            exp_name="flags",
            run_name=name,
            output_dir=str(tmp_path),
            seed=5,
            num_threads=1,
            sft_model_path=str(assets / "models" / "tiny-neox"),
            reward_model_path=None,
            reward_source="math",
            dataset_name_or_path=str(assets / "tiny-math" / "gsm8k"),
            eval_split="test",
            prompt_template="Question: {question}\nAnswer:\n",
            reference_template="{answer}",
            max_prompt_length=96,
            response_length=10,
            temperature=1.0,
            total_episodes=16,
            per_device_batch_size=8,
            num_mini_batches=2,
            num_ppo_epochs=2,
            learning_rate=1e-3,
            eval_every=100,
            num_eval_examples=2,
            save_model=False,
            separate_backward=separate,
            **flags,
        )
        ppo.main(args)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss/policy_avg"] for r in rows if "loss/policy_avg" in r]
    assert len(losses["f3"]) == 2 and all(math.isfinite(x) for x in losses["f3"])
    assert losses["f3"] != losses["f0"]  # the flags changed what was trained (the bonus from the first step on)


def test_clip_higher_log_ratio_bound_and_k2():
    """Issue 60, by hand: an asymmetric clip (DAPO's clip-higher, verl's clip_ratio_high) caps a positive-advantage
    token's ratio at 1 + eps_high; the log-ratio bound (verl, OpenRLHF: 20) keeps a runaway token's gradient finite;
    OpenRLHF's k2 = d^2 / 2; k3's log ratio bounded like the policy's."""
    new, old, adv, mask = torch.tensor([[0.5]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool)
    assert ppo.policy_loss(new, old, adv, mask, 0.2)[0].item() == pytest.approx(-1.2)
    assert ppo.policy_loss(new, old, adv, mask, (0.2, 0.28))[0].item() == pytest.approx(-1.28)
    assert ppo.policy_loss(new, old, adv, mask, (0.2, 0.28))[1]["clipfrac"].item() == 1.0  # e^0.5 = 1.65 > 1.28
    assert ppo.policy_loss(-new, old, -adv, mask, (0.1, 0.28))[0].item() == pytest.approx(0.9)  # low bound alone
    for bound, finite in ((None, False), (20.0, True)):
        runaway = torch.tensor([[800.0]], requires_grad=True)
        loss, _ = ppo.policy_loss(runaway, old, -adv, mask, 0.2, dual_clip=3.0, bound=bound)
        loss.backward()
        assert loss.item() == 3.0 and bool(torch.isfinite(runaway.grad).all()) == finite
    assert ppo.policy_loss(runaway.detach() * -1, old, adv, mask, 0.2, bound=20.0)[0].item() == pytest.approx(
        -math.exp(-20)
    )
    lp, ref = torch.tensor([-0.5, 0.25, 3.0]), torch.zeros(3)
    torch.testing.assert_close(ppo.kl_penalty(lp, ref, "k2"), torch.tensor([0.125, 0.03125, 4.5]))
    assert math.isinf(ppo.kl_penalty(torch.tensor([-800.0]), torch.zeros(1), "k3").item())
    bounded = ppo.kl_penalty(torch.tensor([-800.0]), torch.zeros(1), "k3", bound=20.0)
    assert bounded.item() == pytest.approx(math.exp(20) - 21)
    assert ppo.kl_penalty(lp, ref, "k1", bound=20.0) is not None  # k1 and k2 need no exp: unbounded
    torch.testing.assert_close(ppo.kl_penalty(lp * 100, ref, "k2", bound=1.0), 0.5 * (lp * 100) ** 2)
    defaults = ppo.Args()
    assert defaults.cliprange_high is None and defaults.log_ratio_clamp is None  # N+ has neither
