"""rloo.py and remax.py: the leave-one-out baseline, the ReMax advantage, the sequence-level KL reward and the
REINFORCE losses against hand-computed values; a zero-gradient check; --help, short runs of both scripts, and a
two-process run of rloo.py through accelerate (gloo on CPU). With ppo_rlhf.py, whose copies they share: the sampling
loop synced across ranks for ZeRO-3, the math-verify grader of MATH answers, local datasets without a hub config."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ppo_rlhf
import remax
import rloo
from clean_rlhf_utils import data, generation, loading, packing
from clean_rlhf_utils.args import check_ranges
from tests.bad_inputs import make_reward_model
from tests.launch import launch_cmd

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------------------
# The math, by hand
# ---------------------------------------------------------------------------------------------------------------


def test_leave_one_out_baseline_on_a_hand_example_with_k4():
    # two prompts, four samples each, prompt-major
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 4.0])
    # prompt 1: sum 12; baselines (12-1)/3, (12-2)/3, (12-3)/3, (12-6)/3 = 11/3, 10/3, 3, 2
    # prompt 2: sum 4; baselines 4/3, 4/3, 4/3, 0
    expected = torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 3, 6 - 2, -4 / 3, -4 / 3, -4 / 3, 4 - 0])
    adv = rloo.rloo_advantages(rewards, k=4)
    torch.testing.assert_close(adv, expected)
    # the same thing written as k/(k-1) * (r - group mean); the advantages of a group sum to zero
    means = rewards.view(2, 4).mean(1, keepdim=True)
    torch.testing.assert_close(adv, (4 / 3 * (rewards.view(2, 4) - means)).flatten())
    assert adv.view(2, 4).sum(1).abs().max().item() < 1e-6
    # k = 2: each sample's baseline is the other sample's reward
    torch.testing.assert_close(
        rloo.rloo_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), k=2), torch.tensor([-2.0, 2.0, 0.0, 0.0])
    )
    # k = 1: no other sample, no baseline
    torch.testing.assert_close(rloo.rloo_advantages(torch.tensor([0.5, -1.0]), k=1), torch.tensor([0.5, -1.0]))
    with pytest.raises(ValueError, match="whole number of groups"):
        rloo.rloo_advantages(torch.ones(6), k=4)


def test_remax_advantage_is_the_clipped_reward_difference_minus_the_tokens_own_kl():
    """The official ReMax (remax_trainer.py `compute_returns`, gamma = 1, clip_reward_value = 5):
    A_t = clip(r(x, y) - r(x, y_bar), -5, 5) - beta * KL_t, KL_t of token t alone (not summed over the response)."""
    scores, greedy_scores = torch.tensor([2.0, 0.5]), torch.tensor([-4.0, 1.0])
    token_kl = torch.tensor([[0.2, -0.4, 1.0], [0.3, -1.0, 0.0]])  # response 1 has two tokens (0 at the padding)
    adv = remax.remax_advantages(scores, greedy_scores, token_kl, kl_coef=0.1, reward_clip=5.0)
    expected = torch.tensor(
        [
            [5.0 - 0.1 * 0.2, 5.0 - 0.1 * -0.4, 5.0 - 0.1 * 1.0],  # clip(2 - (-4) = 6, -5, 5) = 5: 4.98, 5.04, 4.90
            [
                -0.5 - 0.1 * 0.3,
                -0.5 - 0.1 * -1.0,
                -0.5,
            ],  # 0.5 - 1 = -0.5, inside the clip: -0.53, -0.40, (-0.50 padding)
        ]
    )
    torch.testing.assert_close(adv, expected)
    # reward_clip 0: no clip, 6 - 0.1 * KL_t
    unclipped = remax.remax_advantages(scores, greedy_scores, token_kl, 0.1, 0.0)
    torch.testing.assert_close(unclipped[0], torch.tensor([5.98, 6.04, 5.9]))
    # the sequence reward, logged as objective/rlhf_reward, keeps the summed KL: 2 - 0.1 * (0.2 - 0.4 + 1.0) = 1.92
    torch.testing.assert_close(remax.sequence_rewards(scores, token_kl.sum(1), 0.1), torch.tensor([1.92, 0.57]))


@pytest.mark.parametrize("mod", [rloo, remax], ids=["rloo", "remax"])
def test_sequence_kl_sums_valid_tokens_only(mod):
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, mod.INVALID_LOGPROB], [-1.0, -1.0, -1.0, -1.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.7, mod.INVALID_LOGPROB], [-2.0, -1.0, -1.0, -0.5]])
    padding_mask = torch.tensor([[False, False, False, True], [False] * 4])
    # k1: row 0 (0.5) + (-1.0) + (0.2) = -0.3; row 1 1.0 + 0 + 0 + (-0.5) = 0.5
    torch.testing.assert_close(mod.sequence_kl(logprobs, ref_logprobs, padding_mask, "k1"), torch.tensor([-0.3, 0.5]))
    k3 = lambda d: math.exp(-d) - 1 + d  # noqa: E731
    expected = torch.tensor([k3(0.5) + k3(-1.0) + k3(0.2), k3(1.0) + k3(-0.5)])
    torch.testing.assert_close(mod.sequence_kl(logprobs, ref_logprobs, padding_mask, "k3"), expected)
    # the sequence reward: score - beta * summed KL
    torch.testing.assert_close(
        mod.sequence_rewards(torch.tensor([1.0, 2.0]), torch.tensor([-0.3, 0.5]), 0.05),
        torch.tensor([1.0 + 0.015, 2.0 - 0.025]),
    )


def test_reinforce_loss_by_hand():
    adv = torch.tensor([1.0, -2.0, 3.0])
    same = torch.tensor([-5.0, -3.0, -4.0])
    loss, stats = rloo.reinforce_loss(same, same, adv, cliprange=0.2)
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 3.0) / 3)  # ratio 1: -mean(A)
    assert stats["ratio"].item() == pytest.approx(1.0) and stats["clipfrac"].item() == 0.0
    new = torch.log(torch.tensor([1.5, 0.5, 1.1]))  # sequence ratios 1.5, 0.5, 1.1
    loss, stats = rloo.reinforce_loss(new, torch.zeros(3), adv, cliprange=0.2)
    # response 0: max(-1.5, -1.2) = -1.2; response 1: max(1.0, 1.6) = 1.6; response 2: -3.3
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 3.3) / 3, rel=1e-5)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    # log pi(y|x): token logprobs summed up to the EOS
    lp = torch.tensor([[-1.0, -2.0, rloo.INVALID_LOGPROB], [-0.5, -0.5, -0.5]])
    pm = torch.tensor([[False, False, True], [False, False, False]])
    torch.testing.assert_close(rloo.sequence_logprobs(lp, pm), torch.tensor([-3.0, -1.5]))


def test_rloo_dual_clip_bounds_a_runaway_negative_advantage_response():
    """Dual clip on RLOO's sequence ratio (issue 52): ratio 5, A = -1, clip 0.2: PPO's loss 5 with gradient 5; with
    c = 3 the loss is 3 with gradient 0 (counted as clipped); ratio 2 keeps its loss 2."""
    new = torch.tensor([math.log(5.0), math.log(2.0)], requires_grad=True)
    adv = torch.tensor([-1.0, -1.0])
    loss, stats = rloo.reinforce_loss(new, torch.zeros(2), adv, cliprange=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(3.5) and stats["clipfrac"].item() == 0.0
    torch.testing.assert_close(new.grad, torch.tensor([2.5, 1.0]))  # the mean over 2 responses
    new.grad = None
    loss, stats = rloo.reinforce_loss(new, torch.zeros(2), adv, cliprange=0.2, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(2.5) and stats["clipfrac"].item() == 0.5
    torch.testing.assert_close(new.grad, torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("mod", [rloo, remax], ids=["rloo", "remax"])
def test_kl_clamp_bounds_the_per_token_kl_of_the_reward(mod):
    """The clamp (OpenRLHF: every estimator at 10): k3 of ref - logp = 3 is e^3 - 4 = 16.0855, 10 clamped; the
    sequence KL sums the clamped tokens: 10 + (e^0.5 - 1.5) (ref - logp = 0.5) over the two valid tokens."""
    logprobs, ref = torch.tensor([[-4.0, -2.0, mod.INVALID_LOGPROB]]), torch.tensor([[-1.0, -1.5, 0.0]])
    padding_mask = torch.tensor([[False, False, True]])
    k3 = math.exp(0.5) - 1.5
    assert mod.kl_penalty(logprobs, ref, "k3")[0, 0].item() == pytest.approx(math.exp(3) - 4)
    assert mod.sequence_kl(logprobs, ref, padding_mask, "k3", 10.0).item() == pytest.approx(10 + k3)
    assert mod.sequence_kl(logprobs, ref, padding_mask, "k3").item() == pytest.approx(math.exp(3) - 4 + k3)
    with pytest.raises(SystemExit, match="--kl-clamp is -1.0; it must be above 0"):
        check_ranges(mod.Args(kl_clamp=-1.0))


class TwoWordPolicy(torch.nn.Module):
    """A causal LM whose logits over a two-word vocabulary are the parameter z, for a packed batch of one response of
    one token: `packed_logprobs` and the micro-batch losses run their own code on numbers checked by hand."""

    def __init__(self):
        super().__init__()
        self.z = torch.nn.Parameter(torch.tensor([[[0.0, math.log(3.0)]]]))

    def forward(self, **kwargs):
        return type("Out", (), {"logits": self.z})()


@pytest.mark.parametrize("mod", [rloo, remax], ids=["rloo", "remax"])
def test_entropy_bonus_gradient_is_minus_coef_times_the_entropy_gradient(mod):
    """verl's entropy_coeff (issue 52): the one token (word 1) has logits (0, log 3), p = (1/4, 3/4), H = 0.56234 and
    dH/dz = -p (log p + H) = (0.20599, -0.20599). At advantage 0 the loss is -0.1 H with coef 0.1 and dz = -0.1 dH/dz;
    the logged policy loss leaves the bonus out; without the flag there is no gradient."""
    p = torch.tensor([0.25, 0.75])
    h = -(p * p.log()).sum()
    for coef in (None, 0.1):
        model = TwoWordPolicy()
        if mod is rloo:
            trained, stats = rloo.rloo_micro_batch_loss(
                model, [[0]], [[1]], torch.zeros(1), torch.zeros(1), 0, 8, 1.0, 0.2, None, coef
            )
            logged = stats["pg_loss"]
        else:
            trained, logged = remax.remax_micro_batch_loss(model, [[0]], [[1]], torch.zeros(1, 1), 0, 8, 1.0, coef)
        trained.backward()
        assert logged.item() == 0.0 and trained.item() == pytest.approx(0.0 if coef is None else -0.1 * h.item())
        expected = torch.zeros(2) if coef is None else -0.1 * -p * (p.log() + h)
        torch.testing.assert_close(model.z.grad.flatten(), expected, atol=1e-6, rtol=1e-5)
    assert model.z.grad[0, 0, 0].item() == pytest.approx(-0.020599, abs=1e-6)


def test_remax_loss_by_hand():
    lp = torch.tensor([[-1.0, -2.0, rloo.INVALID_LOGPROB], [-0.5, -0.5, -0.5]])
    pm = torch.tensor([[False, False, True], [False, False, False]])
    adv = torch.tensor([[2.0, 1.0, 7.0], [-1.0, -1.0, -2.0]])
    # -sum_t A_t log pi_t over the 5 valid tokens, summed (main divides by the batch's valid tokens, the loss scale):
    # -(2 * -1 + 1 * -2 + (-1) * -0.5 + (-1) * -0.5 + (-2) * -0.5) = -(-2 - 2 + 0.5 + 0.5 + 1) = 2
    assert remax.remax_loss(lp, adv, pm).item() == pytest.approx(2.0)


# ---------------------------------------------------------------------------------------------------------------
# Gradients: equal rewards carry no signal
# ---------------------------------------------------------------------------------------------------------------


def _policy_logprobs(assets, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-neox")
    seqs = torch.randint(3, 100, (8, 10))
    packed = packing.pack_sequences(
        [s[:4].tolist() for s in seqs], [s[4:].tolist() for s in seqs], pad_id=1, capacity=20
    )
    logprobs = rloo.packed_logprobs(model, packed, temperature=0.7)
    padding_mask = torch.zeros_like(logprobs, dtype=torch.bool)
    padding_mask[0, 3:] = True  # one response ended early
    return model, logprobs, padding_mask


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_gradient_is_zero_when_all_rewards_of_a_prompt_are_equal(assets, normalize):
    model, logprobs, padding_mask = _policy_logprobs(assets)
    seq_lp = rloo.sequence_logprobs(logprobs, padding_mask)
    rewards = torch.tensor([0.7] * 4 + [-1.0] * 4)  # two prompts, k = 4, equal within each prompt
    adv = rloo.rloo_advantages(rewards, k=4)
    if normalize:
        adv = rloo.masked_whiten(adv, torch.ones_like(adv))
    loss, _ = rloo.reinforce_loss(seq_lp, seq_lp.detach(), adv, cliprange=0.2)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.abs().max().item() == 0.0 for g in grads)
    # one different reward and the gradient is REINFORCE's: -mean(A * grad log pi(y|x)), non-zero
    model, logprobs, padding_mask = _policy_logprobs(assets)
    seq_lp = rloo.sequence_logprobs(logprobs, padding_mask)
    adv = rloo.rloo_advantages(torch.tensor([0.7, 0.7, 0.7, 1.7] + [-1.0] * 4), k=4)
    loss, _ = rloo.reinforce_loss(seq_lp, seq_lp.detach(), adv, cliprange=0.2)
    grad = torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True, retain_graph=True)
    manual = torch.autograd.grad(-(adv * seq_lp).mean(), [p for p in model.parameters()], allow_unused=True)
    assert any(g is not None and g.abs().max().item() > 0 for g in grad)
    for g, m in zip(grad, manual):
        if g is not None:
            torch.testing.assert_close(g, m)


def test_remax_gradient_is_zero_when_sample_and_greedy_rewards_agree(assets):
    model, logprobs, padding_mask = _policy_logprobs(assets)
    scores = torch.tensor([0.3, -1.0, 2.0, 0.0, 0.3, 0.3, 1.0, 1.0])
    adv = remax.remax_advantages(scores, scores, torch.zeros_like(logprobs), 0.05, 5.0)
    remax.remax_loss(logprobs, adv, padding_mask).backward()
    assert all(p.grad.abs().max().item() == 0.0 for p in model.parameters() if p.grad is not None)


# ---------------------------------------------------------------------------------------------------------------
# The scripts end to end (tiny models from the assets fixture, a few steps)
# ---------------------------------------------------------------------------------------------------------------


def _env() -> dict:
    return {
        **os.environ,
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
    }


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _math_args(assets, tmp_path, run_name):
    return [
        "tiny-math",
        "--sft-model-path",
        str(assets / "models" / "tiny-llama"),
        "--dataset-name-or-path",
        str(assets / "tiny-math" / "gsm8k"),
        "--output-dir",
        str(tmp_path / "runs"),
        "--run-name",
        run_name,
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
    ]


@pytest.mark.parametrize(
    "script, extra",
    [
        (
            "rloo.py",
            ["--per-device-batch-size", "8", "--rloo-k", "4", "--num-ppo-epochs", "2", "--num-mini-batches", "2"],
        ),
        ("remax.py", ["--per-device-batch-size", "4", "--gradient-accumulation-steps", "2"]),
        (  # issue 52's flags, all on
            "rloo.py",
            ["--per-device-batch-size", "8", "--rloo-k", "4", "--num-ppo-epochs", "2", "--dual-clip", "3"]
            + ["--kl-clamp", "10", "--entropy-coef", "0.01"],
        ),
        ("remax.py", ["--per-device-batch-size", "4", "--kl-clamp", "10", "--entropy-coef", "0.01"]),
    ],
    ids=["rloo", "remax", "rloo-issue-52-flags", "remax-issue-52-flags"],
)
def test_two_steps_on_tiny_math(assets, tmp_path, script, extra):
    cmd = [sys.executable, str(REPO / script), *_math_args(assets, tmp_path, "smoke"), "--total-episodes", "16", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "smoke" / "metrics.jsonl")
    train = [r for r in rows if "loss/policy_avg" in r]
    batch = 8 if script == "rloo.py" else 4
    assert [r["step"] for r in train] == list(range(1, 16 // batch + 1))
    assert [r["episode"] for r in train] == [batch * s for s in range(1, 16 // batch + 1)]
    for r in train:
        for k in (
            "objective/reward",
            "objective/kl",
            "objective/rlhf_reward",
            "objective/entropy",
            "perf/episodes_per_sec",
            "perf/peak_mem_gb",
            "train/grad_norm",  # before clipping, the mean over the update's optimizer steps (issue 68)
        ):
            assert k in r and math.isfinite(r[k]), k
        assert r["train/grad_norm"] >= 0  # 0 where every reward is 0 (an untrained policy): no advantage
        assert r["objective/rlhf_reward"] == pytest.approx(r["objective/reward"] - 0.01 * r["objective/kl"], abs=1e-5)
    evals = [r["step"] for r in rows if "eval/accuracy" in r]
    assert evals[0] == 0 and evals[-1] == 16 // batch  # before the first update and after the last
    assert (tmp_path / "runs" / "smoke" / "model" / "model.safetensors").exists()
    assert json.loads((tmp_path / "runs" / "smoke" / "config.json").read_text())["run_name"] == "smoke"


def test_remax_on_tiny_tldr_with_a_reward_model(assets, tmp_path):
    # the tiny-neox checkpoint with a fresh score head stands in for a reward model
    neox = str(assets / "models" / "tiny-neox")
    rm = str(make_reward_model(assets, tmp_path / "rm"))
    cmd = [
        sys.executable,
        str(REPO / "remax.py"),
        "tiny-tldr",
        "--sft-model-path",
        neox,
        "--reward-model-path",
        rm,
        "--dataset-name-or-path",
        str(assets / "tiny-tldr" / "sft"),
        "--output-dir",
        str(tmp_path / "runs"),
        "--run-name",
        "tldr",
        "--total-episodes",
        "8",
        "--per-device-batch-size",
        "4",
        "--response-length",
        "8",
        "--num-eval-examples",
        "4",
        "--eval-every",
        "1",
        "--num-threads",
        "1",
        "--no-save-model",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "tldr" / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/gold_reward" in r] == [0, 1, 2]
    assert all("eval/win_rate" in r and "eval/score" in r for r in rows if "eval/gold_reward" in r)
    train = [r for r in rows if "objective/greedy_reward" in r]
    assert len(train) == 2 and all(math.isfinite(r["objective/advantage"]) for r in train)


def _eos_first_model(assets, tmp_path) -> Path:
    """tiny-neox with its final layer norm's bias pushed along EOS's output embedding (EOS logit + 60, the others about
    +-5): EOS is by far the likeliest token at every position, so with --stop-token eos every response ends at once."""
    model = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-neox")
    w = model.get_output_embeddings().weight[model.config.eos_token_id].detach()
    with torch.no_grad():
        model.gpt_neox.final_layer_norm.bias += 60.0 * w / w.norm() ** 2
    out = tmp_path / "eos-first"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(assets / "models" / "tiny-neox").save_pretrained(out)
    return out


@pytest.mark.parametrize(
    "script, extra",
    [("rloo.py", ["--per-device-batch-size", "4", "--rloo-k", "2"]), ("remax.py", ["--per-device-batch-size", "4"])],
)
def test_stop_token_none_decodes_every_response_to_the_full_length(assets, tmp_path, script, extra):
    """--stop-token none: the sampler (and ReMax's greedy baseline) never stops at EOS and nothing is truncated, so
    every response holds response_length tokens although EOS is nearly every token."""
    model = str(_eos_first_model(assets, tmp_path))
    cmd = [
        sys.executable,
        str(REPO / script),
        *_math_args(assets, tmp_path, "none"),
        "--sft-model-path",
        model,
        "--total-episodes",
        "4",
        "--stop-token",
        "none",
        "--num-eval-examples",
        "3",
        "--no-save-model",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [r for r in _rows(tmp_path / "runs" / "none" / "metrics.jsonl") if "loss/policy_avg" in r]
    assert len(train) == 1
    assert train[0]["objective/completion_length"] == 12.0  # --response-length 12
    assert train[0]["objective/eos_rate"] == 1.0 and train[0]["val/num_eos_tokens"] > 6  # EOS inside, not an end


def test_rloo_rejects_a_batch_that_is_not_whole_groups(assets, tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "rloo.py"),
        *_math_args(assets, tmp_path, "bad"),
        "--per-device-batch-size",
        "6",
        "--rloo-k",
        "4",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "multiple of rloo_k" in proc.stderr


def test_rloo_on_two_processes(assets, tmp_path):
    cmd = launch_cmd(
        str(REPO / "rloo.py"),
        *_math_args(assets, tmp_path, "ddp"),
        "--total-episodes",
        "32",
        "--per-device-batch-size",
        "8",
        "--rloo-k",
        "4",
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "ddp" / "metrics.jsonl")
    train = [r for r in rows if "loss/policy_avg" in r]
    assert [r["episode"] for r in train] == [16, 32]  # 2 processes x 8 responses (2 prompts x k = 4) per update
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1, 2]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "ddp" / "model")
    initial = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-llama")
    moved = [not torch.equal(a, b) for a, b in zip(model.state_dict().values(), initial.state_dict().values())]
    assert any(moved), "the weights did not move"


# ---------------------------------------------------------------------------------------------------------------
# Sampling loop and packed forward passes: the same numbers as one unpadded forward pass per sequence
# ---------------------------------------------------------------------------------------------------------------


def _alone(model, query: list[int], response: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([query + response])).logits[0, len(query) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", ["tiny-neox", "tiny-llama"])
def test_packed_logprobs_and_sampler_logprobs_equal_each_sequence_alone(assets, arch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(assets / "models" / arch).eval()
    eos, pad = model.config.eos_token_id, 1
    queries = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    queries_t, qmask = data.left_pad(queries, pad)
    responses, logprobs, entropy = generation.sample_responses(model, queries_t, qmask, eos, pad, 12, temperature=0.9)
    assert responses.shape[1] <= 12 and (entropy >= 0).all()
    lists = []
    for row in responses.tolist():
        n = row.index(eos) + 1 if eos in row else len(row)
        assert all(t == pad for t in row[n:])  # PAD after the first EOS
        lists.append(row[:n])
    packed = packing.pack_sequences(queries, lists, pad, capacity=64)
    assert len(packed["input_ids"]) == 1  # all three share one row
    with torch.no_grad():
        together = rloo.packed_logprobs(model, packed, temperature=0.9)
    for i, (q, r) in enumerate(zip(queries, lists)):
        alone = _alone(model, q, r, 0.9)
        torch.testing.assert_close(together[i, : len(r)], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logprobs[i, : len(r)], alone, atol=1e-4, rtol=1e-4)  # the sampler's own logprobs


def test_remax_greedy_baseline_sampler_matches_generate(assets):
    """ReMax's baseline: temperature 0 in the sampling loop is greedy decoding (argmax), token for token
    `model.generate`'s, and draws no random number (issue 41: not sampling at temperature 1e-7)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-llama").eval()
    eos, pad = model.config.eos_token_id, 1
    queries, qmask = data.left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], pad)
    rng = torch.get_rng_state()
    greedy, logprobs, _ = generation.sample_responses(model, queries, qmask, eos, pad, 12, 0.0)
    assert torch.equal(rng, torch.get_rng_state())
    with torch.no_grad():
        ref = model.generate(
            input_ids=queries,
            attention_mask=qmask,
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
        )
    ref = remax.truncate_response(ref[:, queries.shape[1] :], eos, pad)
    assert greedy.tolist() == ref[:, : greedy.shape[1]].tolist() and (ref[:, greedy.shape[1] :] == pad).all()
    assert (logprobs <= 0).all()


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-3: the sampling loop synced across ranks (every forward pass is a collective), without a process group
# ---------------------------------------------------------------------------------------------------------------


class _Counting(torch.nn.Module):
    """A causal LM that records the rows of every forward call; from position `eos_from` on (when given), EOS gets a
    large logit bonus, so each row ends at a step set by its prompt length."""

    def __init__(self, inner, eos: int, eos_from: int | None):
        super().__init__()
        self.inner, self.eos, self.eos_from, self.rows = inner, eos, eos_from, []

    def forward(self, input_ids, position_ids, **kwargs):
        self.rows.append(input_ids.shape[0])
        out = self.inner(input_ids=input_ids, position_ids=position_ids, **kwargs)
        if self.eos_from is not None:
            out.logits[:, -1, self.eos] += 100.0 * (position_ids[:, -1] >= self.eos_from)
        return out


def _sample(model, queries, qmask, temperature, seed, synced, other_rank_flags=()):
    """One rank's sample_responses, the all-reduce replaced by the max with the other rank's flag at the same step.
    Returns the outputs and the flags this rank sent."""
    sent = []

    def all_reduce(flag, op):
        assert op == torch.distributed.ReduceOp.MAX and synced
        other = other_rank_flags[len(sent)] if len(sent) < len(other_rank_flags) else 0.0
        sent.append(flag.item())
        flag.fill_(max(flag.item(), other))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.distributed, "all_reduce", all_reduce)
        model.rows.clear()
        torch.manual_seed(seed)
        out = generation.sample_responses(model, queries, qmask, model.eos, 1, 12, temperature, synced=synced)
    return out, sent


@pytest.mark.parametrize("temperature", [0.9, 0.0], ids=["sampled", "greedy"])  # greedy: ReMax's baseline
def test_synced_sampling_steps_until_every_rank_is_done(assets, temperature):
    """Two ranks: A's rows all end by step 7, B decodes all 12 steps. Synced, A keeps calling forward (one finished row
    as a dummy) as often as B, and both return exactly what they return alone; unsynced, A stops early."""
    inner = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-llama").eval()
    eos = inner.config.eos_token_id
    a, b = _Counting(inner, eos, eos_from=7), _Counting(inner, eos, eos_from=None)
    qa, ma = data.left_pad([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], 1)  # rows end at steps 3, 6, 5
    qb, mb = data.left_pad([[20, 21, 22], [23, 24, 25, 26]], 1)
    alone_a, _ = _sample(a, qa, ma, temperature, 0, synced=False)
    calls_a = len(a.rows)
    alone_b, _ = _sample(b, qb, mb, temperature, 1, synced=False)
    calls_b = len(b.rows)
    assert alone_a[0].shape[1] == 7 and calls_a == 7 and a.rows[-1] == 1  # finished rows left the batch
    assert alone_b[0].shape[1] == 12 and calls_b == 12 and not (alone_b[0] == eos).any()

    _, flags_b = _sample(b, qb, mb, temperature, 1, synced=True)  # B's flags: 1 at every step it decodes
    synced_a, flags_a = _sample(a, qa, ma, temperature, 0, synced=True, other_rank_flags=flags_b)
    assert len(a.rows) == calls_b  # as many forward passes as the longest rank
    assert a.rows[calls_a:] == [1] * (calls_b - calls_a)  # one dummy row after its own rows ended
    assert flags_a == [1.0] * 6 + [0.0] * 6 and len(flags_b) == 12
    synced_b, _ = _sample(b, qb, mb, temperature, 1, synced=True, other_rank_flags=flags_a)
    assert len(b.rows) == calls_b
    for alone, synced in ((alone_a, synced_a), (alone_b, synced_b)):  # tokens, logprobs, entropy: bit for bit
        assert all(torch.equal(x, y) for x, y in zip(alone, synced))


# ---------------------------------------------------------------------------------------------------------------
# One MATH grader in every script (math-verify, as grpo_math.py); local datasets never use the hub config
# ---------------------------------------------------------------------------------------------------------------


def _definitions(path: Path) -> dict[str, str]:
    import ast

    source = path.read_text()
    return {n.name: ast.get_source_segment(source, n) for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("mod", [rloo, remax, ppo_rlhf], ids=["rloo", "remax", "ppo_rlhf"])
def test_math_answers_are_graded_by_math_verify_as_in_grpo(mod):
    equivalent = [
        ("\\frac{1}{2}", "0.5"),
        ("\\frac{1}{2}", "\\dfrac12"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\frac{14}{3}", "4\\frac{2}{3}"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})"),
        ("7", "7"),
    ]
    for gold, said in equivalent:
        assert mod.success_reward(f"So the answer is $\\boxed{{{said}}}$.", gold, "boxed") == 1.0, (gold, said)
    assert mod.success_reward("$\\boxed{0.6}$", "\\frac{1}{2}", "boxed") == 0.0
    assert mod.success_reward("$\\boxed{3}$", "2\\sqrt{2}", "boxed") == 0.0
    assert mod.success_reward("one half, no box", "\\frac{1}{2}", "boxed") == 0.0
    assert mod.success_reward("#### 1,000.", "1000", "gsm8k") == 1.0
    assert mod.success_reward("#### 7", "8", "gsm8k") == 0.0
    mine, grpo = _definitions(Path(mod.__file__)), _definitions(REPO / "grpo_math.py")
    for name in ("math_verify_equal", "extract_answer", "success_reward"):  # verbatim copies: all four grade alike
        assert mine[name] == grpo[name], name


@pytest.mark.parametrize("mod", [rloo, remax, ppo_rlhf], ids=["rloo", "remax", "ppo_rlhf"])
def test_a_local_dataset_ignores_the_hub_config(assets, mod, monkeypatch):
    """The GSM8K presets keep dataset_config="main" (openai/gsm8k on the hub); a local folder or file has no configs."""

    def no_hub(*args, **kwargs):
        raise AssertionError("a local path went to the hub")

    monkeypatch.setattr(loading, "require_hub", no_hub)  # load_split is the package's
    folder = assets / "tiny-math" / "gsm8k"
    for path in (folder, folder / "test.jsonl"):
        ds = loading.load_split(str(path), "test", "main")
        assert len(ds) > 0 and {"question", "answer"} <= set(ds.column_names)


def test_rloo_clip_higher_and_log_ratio_bound():
    """Issue 60: the sequence-level surrogate with an asymmetric clip and the log-ratio bound, by hand; k2 in ReMax's
    and RLOO's summed KL."""
    new, old, adv = torch.tensor([0.5, -0.5]), torch.zeros(2), torch.tensor([1.0, -1.0])
    loss, stats = rloo.reinforce_loss(new, old, adv, (0.2, 0.28))
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2) and stats["clipfrac"].item() == 1.0
    assert rloo.reinforce_loss(new, old, adv, 0.2)[0].item() == pytest.approx((-1.2 + 0.8) / 2)
    for bound, finite in ((None, False), (20.0, True)):
        runaway = torch.tensor([800.0], requires_grad=True)
        loss, _ = rloo.reinforce_loss(runaway, torch.zeros(1), torch.tensor([-1.0]), 0.2, 3.0, bound)
        loss.backward()
        assert loss.item() == 3.0 and bool(torch.isfinite(runaway.grad).all()) == finite
    lp, ref, pad = torch.tensor([[-0.5, 1.0, 2.0]]), torch.zeros(1, 3), torch.tensor([[False, False, True]])
    for module in (rloo, remax):
        assert module.sequence_kl(lp, ref, pad, "k2").item() == pytest.approx(0.125 + 0.5)
    assert rloo.Args().cliprange_high is None and rloo.Args().log_ratio_clamp is None
