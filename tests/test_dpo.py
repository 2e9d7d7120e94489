"""dpo.py: the loss variants against hand-computed values, the state at initialisation, padding invariance of
the sequence logprobs, online pair labelling, and short offline / online / async / two-process runs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import dpo
from tests.launch import launch_cmd

REPO = Path(__file__).resolve().parent.parent
LOG2 = math.log(2.0)

# two pairs: (policy chosen, policy rejected, reference chosen, reference rejected) sequence logprobs
PC, PR = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.5])
RC, RR = torch.tensor([-1.5, -1.0]), torch.tensor([-2.0, -2.0])
# h = (PC - PR) - (RC - RR): pair 0: 2.0 - 0.5 = 1.5; pair 1: -0.5 - 1.0 = -1.5
BETA = 0.5


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_sigmoid_loss_by_hand():
    losses, r_c, r_r = dpo.dpo_loss(PC, PR, RC, RR, BETA, "sigmoid")
    # -log sigmoid(beta h) = softplus(-beta h); beta h = +0.75, -0.75
    assert losses.tolist() == pytest.approx([softplus(-0.75), softplus(0.75)], rel=1e-6)
    assert r_c.tolist() == pytest.approx([0.5 * 0.5, 0.5 * -1.0])  # beta * (PC - RC)
    assert r_r.tolist() == pytest.approx([0.5 * -1.0, 0.5 * 0.5])  # beta * (PR - RR)
    assert dpo.implicit_accuracy(r_c, r_r).tolist() == [1.0, 0.0]


def test_ipo_and_hinge_losses_by_hand():
    ipo, _, _ = dpo.dpo_loss(PC, PR, RC, RR, BETA, "ipo")
    # (h - 1/(2 beta))^2 with 1/(2 beta) = 1: (1.5 - 1)^2, (-1.5 - 1)^2
    assert ipo.tolist() == pytest.approx([0.25, 6.25])
    hinge, _, _ = dpo.dpo_loss(PC, PR, RC, RR, BETA, "hinge")
    # max(0, 1 - beta h): 1 - 0.75, 1 + 0.75; and 0 once the margin passes 1/beta
    assert hinge.tolist() == pytest.approx([0.25, 1.75])
    far, _, _ = dpo.dpo_loss(
        torch.tensor([0.0]), torch.tensor([-5.0]), torch.tensor([0.0]), torch.tensor([0.0]), BETA, "hinge"
    )
    assert far.item() == 0.0
    with pytest.raises(ValueError):
        dpo.dpo_loss(PC, PR, RC, RR, BETA, "nope")


def test_ipo_on_averaged_and_on_summed_logprobs_by_hand():
    """IPO (Azar et al. 2023): loss = (h - 1/(2 beta))^2 with h = (log pi(y_c|x) - log pi(y_r|x)) - (log ref(y_c|x) -
    log ref(y_r|x)). `ipo_average` (TRL; what the IPO results used) takes each log pi as the mean of its response's
    token logprobs, policy and reference alike; False takes their sum. One pair, beta = 0.5, so 1/(2 beta) = 1:
      policy chosen    [-1.0, -3.0]             sum -4, mean -2
      policy rejected  [-0.5, -0.5, -1.0, -2.0] sum -4, mean -1
      ref chosen       [-1.5, -1.5]             sum -3, mean -1.5
      ref rejected     [-1.0, -1.0, -1.0, -1.0] sum -4, mean -1
    averaged: h = (-2 + 1) - (-1.5 + 1) = -0.5, loss = (-0.5 - 1)^2 = 2.25
    summed:   h = (-4 + 4) - (-3 + 4)   = -1,   loss = (-1 - 1)^2   = 4"""
    tokens = {"pc": [-1.0, -3.0], "pr": [-0.5, -0.5, -1.0, -2.0], "rc": [-1.5, -1.5], "rr": [-1.0, -1.0, -1.0, -1.0]}
    # a padded batch of one pair: 2 prompt tokens, then the response (loss_mask marks it), chosen row first
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    batch = {"loss_mask": loss_mask}
    pc, pr, rc, rr = (torch.tensor([sum(tokens[k])]) for k in ("pc", "pr", "rc", "rr"))
    assert [t.tolist() for t in dpo.response_lengths(batch)] == [[2.0], [4.0]]
    averaged, r_c, r_r = dpo.pair_losses(batch, pc, pr, rc, rr, dpo.Args(loss_type="ipo", beta=BETA))
    assert averaged.tolist() == pytest.approx([2.25])
    # the logged implicit rewards are on the summed logprobs, as TRL 1.16's DPOTrainer logs them for IPO:
    # beta * (-4 + 3) = -0.5 and beta * (-4 + 4) = 0 (on the averaged ones they were -0.25 and 0)
    assert (r_c.tolist(), r_r.tolist()) == (pytest.approx([-0.5]), pytest.approx([0.0]))
    summed, r_c_summed, _ = dpo.pair_losses(
        batch, pc, pr, rc, rr, dpo.Args(loss_type="ipo", beta=BETA, ipo_average=False)
    )
    assert summed.tolist() == pytest.approx([4.0])
    assert r_c_summed.tolist() == pytest.approx([-0.5])  # whatever the average: one scale for every loss
    # the average is IPO's alone: sigmoid DPO keeps the summed logprobs
    sigmoid, _, _ = dpo.pair_losses(batch, pc, pr, rc, rr, dpo.Args(loss_type="sigmoid", beta=BETA))
    assert sigmoid.tolist() == pytest.approx([softplus(-BETA * -1.0)])


def test_ipo_average_divides_live_and_cached_reference_logprobs_alike(assets):
    """Offline (cached reference logprobs, `--precompute-ref-logprobs`), online (`sample_pairs` caches them too) and
    live reference forward passes all give IPO's per-token h, padded or packed."""
    path = assets / "models" / "tiny-neox"
    tok = AutoTokenizer.from_pretrained(path)
    policy, ref = AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    items, args = _pair_items(tok), dpo.Args(loss_type="ipo", beta=0.1)
    len_c = torch.tensor([float(len(it["chosen"])) for it in items])
    len_r = torch.tensor([float(len(it["rejected"])) for it in items])
    for pack in (False, True):
        batch = dpo.collate_preference_pairs(items, tok.pad_token_id, pack)
        with torch.no_grad():
            pc, pr = dpo.forward_logprobs(policy, batch)
            rc, rr = dpo.forward_logprobs(ref, batch)
            h = (pc / len_c - pr / len_r) - (rc / len_c - rr / len_r)
            expected = ((h - 1 / (2 * 0.1)) ** 2).sum()
            live, _ = dpo.micro_batch_loss(policy, ref, batch, args)
            cached_items = [
                {**it, "ref_chosen": c, "ref_rejected": r} for it, c, r in zip(items, rc.tolist(), rr.tolist())
            ]
            cached, _ = dpo.micro_batch_loss(
                policy, None, dpo.collate_preference_pairs(cached_items, tok.pad_token_id, pack), args
            )
        assert live.item() == pytest.approx(expected.item(), rel=1e-5)
        assert cached.item() == pytest.approx(expected.item(), rel=1e-5)


def test_label_smoothing_is_the_cdpo_formula():
    eps = 0.1
    smoothed, _, _ = dpo.dpo_loss(PC, PR, RC, RR, BETA, "sigmoid", label_smoothing=eps)
    expected = [(1 - eps) * softplus(-0.75) + eps * softplus(0.75), (1 - eps) * softplus(0.75) + eps * softplus(-0.75)]
    assert smoothed.tolist() == pytest.approx(expected, rel=1e-6)
    # eps = 0.5: the labels carry no information, the loss is the same for a pair and its swap
    half, _, _ = dpo.dpo_loss(PC, PR, RC, RR, BETA, "sigmoid", label_smoothing=0.5)
    assert half[0].item() == pytest.approx(half[1].item())
    # and the smoothed loss is minimised at a finite margin (plain DPO keeps pushing): d/dh = 0 at sigmoid(beta h) = 1 -
    # eps
    h = torch.tensor([0.0], requires_grad=True)
    opt = torch.optim.SGD([h], lr=5.0)
    for _ in range(2000):
        opt.zero_grad()
        loss, _, _ = dpo.dpo_loss(
            h, torch.zeros(1), torch.zeros(1), torch.zeros(1), BETA, "sigmoid", label_smoothing=eps
        )
        loss.sum().backward()
        opt.step()
    assert torch.sigmoid(BETA * h).item() == pytest.approx(1 - eps, abs=1e-3)


def _pair_items(tok, n: int = 3) -> list[dict]:
    prompts = [
        "SUBREDDIT: r/pets\n\nPOST: my dog ate my phone\n\nTL;DR:",
        "POST: hi\n\nTL;DR:",
        "POST: my boss is angry at me again\n\nTL;DR:",
    ]
    chosen = [" my dog ate my phone", " hi", " my boss is angry"]
    rejected = [" so basically my dog ate it and honestly", " hello there friend", " boss"]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [
        {"prompt_ids": enc(p), "chosen": enc(c) + [tok.eos_token_id], "rejected": enc(r) + [tok.eos_token_id]}
        for p, c, r in list(zip(prompts, chosen, rejected))[:n]
    ]


def test_at_initialisation_loss_is_log2_and_accuracy_is_one_half(assets):
    path = assets / "models" / "tiny-neox"
    tok = AutoTokenizer.from_pretrained(path)
    policy, ref = AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    batch = dpo.collate_preference_pairs(_pair_items(tok), tok.pad_token_id)
    chosen, rejected = dpo.forward_logprobs(policy, batch)
    with torch.no_grad():
        ref_c, ref_r = dpo.forward_logprobs(ref, batch)
    losses, r_c, r_r = dpo.dpo_loss(chosen, rejected, ref_c, ref_r, 0.05, "sigmoid")
    assert losses.tolist() == pytest.approx([LOG2] * 3, abs=1e-6)
    # every pair is a tie: reported as 1/2 each (ties are not counted as correct)
    assert dpo.implicit_accuracy(r_c, r_r).tolist() == [0.5, 0.5, 0.5]
    # the gradient of the loss w.r.t. h at h = 0 is -beta/2: it moves the log-ratios, not the reference
    losses.mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


def test_sequence_logprobs_do_not_depend_on_padding_side(assets):
    path = assets / "models" / "tiny-neox"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    items = _pair_items(tok)
    right = dpo.collate_preference_pairs(items, tok.pad_token_id)
    # the same sequences left-padded, with the loss mask moved along
    ids, mask, loss_mask = right["input_ids"], right["attention_mask"], right["loss_mask"]
    left = {k: torch.zeros_like(v) for k, v in right.items()}
    left["input_ids"].fill_(tok.pad_token_id)
    for i in range(ids.shape[0]):
        n = int(mask[i].sum())
        for k, v in (("input_ids", ids), ("attention_mask", mask), ("loss_mask", loss_mask)):
            left[k][i, ids.shape[1] - n :] = v[i, :n]
    with torch.no_grad():
        right_c, right_r = dpo.forward_logprobs(model, right)
        left_c, left_r = dpo.forward_logprobs(model, left)
        # and each sequence alone, without any padding
        alone = [dpo.forward_logprobs(model, dpo.collate_preference_pairs([it], tok.pad_token_id)) for it in items]
    torch.testing.assert_close(left_c, right_c, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(left_r, right_r, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(right_c, torch.cat([a[0] for a in alone]), atol=1e-4, rtol=1e-5)
    # the loss mask covers exactly the response tokens and EOS
    assert right["loss_mask"][0].sum().item() == len(items[0]["chosen"])
    assert right["loss_mask"][len(items)].sum().item() == len(items[0]["rejected"])


@pytest.mark.parametrize("model_name", ["tiny-neox", "tiny-llama"])
def test_packed_pairs_give_the_padded_logprobs_loss_and_gradients(assets, model_name):
    path = assets / "models" / model_name
    tok = AutoTokenizer.from_pretrained(path)
    policy, ref = AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    with (
        torch.no_grad()
    ):  # a policy different from the reference, so the loss and rewards are not at their initial values
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    items = _pair_items(tok)
    eos = tok.eos_token_id
    # a fourth pair whose responses share their first tokens, and one where chosen is a prefix of rejected
    items += [
        {
            "prompt_ids": items[1]["prompt_ids"],
            "chosen": items[0]["chosen"],
            "rejected": items[0]["chosen"][:2] + [eos],
        },
        {"prompt_ids": items[2]["prompt_ids"], "chosen": [eos], "rejected": items[2]["rejected"]},
    ]
    padded, packed = (
        dpo.collate_preference_pairs(items, tok.pad_token_id),
        dpo.collate_preference_pairs(items, tok.pad_token_id, pack=True),
    )
    assert packed["input_ids"].numel() < padded["input_ids"].numel()  # no padding, and each prompt once
    for lengths in (
        dpo.response_lengths(padded),
        dpo.response_lengths(packed),
    ):  # what IPO's per-token average divides by
        assert [t.tolist() for t in lengths] == [[len(it[k]) for it in items] for k in ("chosen", "rejected")]
    results = []
    for batch in (padded, packed):
        policy.zero_grad()
        chosen, rejected = dpo.forward_logprobs(policy, batch)
        with torch.no_grad():
            ref_c, ref_r = dpo.forward_logprobs(ref, batch)
        losses, r_c, r_r = dpo.dpo_loss(chosen, rejected, ref_c, ref_r, 0.1, "sigmoid")
        losses.mean().backward()
        results.append(
            (
                chosen.detach(),
                rejected.detach(),
                ref_c,
                ref_r,
                losses.detach(),
                r_c,
                r_r,
                torch.cat([p.grad.flatten() for p in policy.parameters()]),
            )
        )
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_sequence_logprobs_by_hand():
    # vocabulary of 2; logits at position t predict token t+1; only positions with loss_mask = 1 count
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.2, 0.8], [0.9, 0.1], [0.5, 0.5]]]))
    ids = torch.tensor([[0, 1, 1, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 0]])  # tokens 1 and 2 are the response
    expected = math.log(0.5) + math.log(0.8)
    assert dpo.sequence_logprobs(logits, ids, loss_mask).item() == pytest.approx(expected, rel=1e-6)


def test_truncation_after_eos():
    out = dpo.truncate_response(torch.tensor([[5, 6, 0, 7, 0], [5, 6, 7, 8, 9]]), stop_token_id=0, pad_id=1)
    assert out.tolist() == [[5, 6, 0, 1, 1], [5, 6, 7, 8, 9]]


def test_online_pairs_put_the_higher_gold_score_first(assets):
    path = assets / "models" / "tiny-neox"
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    policy, ref = AutoModelForCausalLM.from_pretrained(path).eval(), AutoModelForCausalLM.from_pretrained(path).eval()
    rows = [{"prompt_ids": it["prompt_ids"], "facts": ["dog", "phone", "angry"]} for it in _pair_items(tok)] * 4
    args = dpo.Args(mode="online", judge="gold", response_length=12, temperature=1.0, non_eos_penalty=False)
    data = dpo.sample_pairs(policy, ref, None, tok, rows, args, torch.device("cpu"), version=3)
    pairs = data["pairs"]
    assert data["version"] == 3 and len(pairs) == len(rows)
    for i, pair in enumerate(pairs):
        assert pair["prompt_ids"] == rows[i]["prompt_ids"]
        gold_c, gold_r = (
            dpo.gold_judge(tok.decode(pair[k], skip_special_tokens=True), ["dog", "phone", "angry"])
            for k in ("chosen", "rejected")
        )
        assert gold_c >= gold_r
        assert bool(data["valid"][i]) == (gold_c != gold_r)
    # the reference logprobs that come with the pairs are the reference model's on the padded batch
    with torch.no_grad():
        ref_c, ref_r = dpo.forward_logprobs(ref, dpo.collate_preference_pairs(pairs, tok.pad_token_id, pack=False))
    torch.testing.assert_close(torch.tensor([p["ref_chosen"] for p in pairs]), ref_c, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.tensor([p["ref_rejected"] for p in pairs]), ref_r, atol=1e-4, rtol=1e-5)


# ---- end to end: a few steps on the tiny world ----


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


@pytest.fixture(scope="module")
def tiny_rm(assets, tmp_path_factory) -> Path:
    """A reward model in reward_model.py's format (random head), enough to label pairs in smoke runs."""
    out = tmp_path_factory.mktemp("rm")
    rm = AutoModelForSequenceClassification.from_pretrained(assets / "models" / "tiny-neox", num_labels=1)
    rm.config.reward_type, rm.config.reward_bias = "outcome", 0.0
    rm.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(assets / "models" / "tiny-neox").save_pretrained(out)
    return out


def _common(assets: Path, tmp_path: Path) -> list[str]:
    return [
        "--sft-model-path",
        str(assets / "models" / "tiny-neox"),
        "--dataset-name-or-path",
        str(assets / "tiny-tldr" / "preference"),
        "--prompt-dataset-name-or-path",
        str(assets / "tiny-tldr" / "sft"),
        "--output-dir",
        str(tmp_path / "runs"),
        "--num-eval-examples",
        "8",
        "--num-eval-pairs",
        "8",
        "--per-device-eval-batch-size",
        "8",
        "--num-threads",
        "1",
        "--response-length",
        "16",
        "--log-every",
        "1",
    ]


def test_offline_dpo_runs_and_fits_its_pairs(assets, tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "dpo.py"),
        "tiny-tldr",
        "--run-name",
        "off",
        *_common(assets, tmp_path),
        "--max-train-samples",
        "16",
        "--per-device-train-batch-size",
        "8",
        "--num-train-epochs",
        "4",
        "--learning-rate",
        "1e-3",
        "--eval-every",
        "100",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "off" / "metrics.jsonl")
    assert all({"step", "episode", "time"} <= set(r) for r in rows)
    train = [r for r in rows if "train/loss" in r]
    assert [r["episode"] for r in train] == [8 * (i + 1) for i in range(8)]  # 16 pairs, batch 8, 4 epochs
    assert train[0]["train/loss"] == pytest.approx(LOG2, abs=1e-4)  # policy = reference (cached logprobs)
    assert train[-1]["train/loss"] < 0.6 and train[-1]["rewards/margins"] > 0  # it learns the 16 pairs it sees
    assert rows[0]["eval/accuracy"] == 0.5 and "eval/gold_reward" in rows[-1] and "eval/win_rate" in rows[-1]
    assert (tmp_path / "runs" / "off" / "model" / "model.safetensors").exists()


# the reward model's continuous scores rarely tie (an untrained policy's samples under the gold judge nearly always
# do, which would leave no pair in the loss); the gold labelling is checked in the unit test above
@pytest.mark.parametrize(
    "extra", [["--judge", "rm"], ["--judge", "rm", "--async", "--num-threads", "2"]], ids=["sync", "async"]
)
def test_online_dpo_runs(assets, tiny_rm, tmp_path, extra):
    cmd = [
        sys.executable,
        str(REPO / "dpo.py"),
        "tiny-tldr-online",
        "--run-name",
        "on",
        *_common(assets, tmp_path),
        "--reward-model-path",
        str(tiny_rm),
        "--total-episodes",
        "32",
        "--per-device-train-batch-size",
        "4",
        "--gradient-accumulation-steps",
        "2",
        "--eval-every",
        "2",
        "--no-non-eos-penalty",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "on" / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    assert [r["episode"] for r in train] == [8, 16, 24, 32]
    assert train[0]["train/loss"] == pytest.approx(LOG2, abs=1e-4)  # policy = reference on the first batch
    lags = [r["async/policy_lag"] for r in train]
    assert lags == ([0, 1, 1, 1] if "--async" in extra else [0, 0, 0, 0])
    assert all(0.0 <= r["objective/tie_rate"] <= 1.0 for r in train)
    assert sum("eval/gold_reward" in r for r in rows) == 3  # steps 0, 2, 4
    assert sum("eval/score" in r for r in rows) == 3  # --reward-model-path: its score at every evaluation


def test_online_dpo_judged_by_gold_logs_the_reward_models_score(assets, tiny_rm, tmp_path):
    """--judge gold labels the pairs; a --reward-model-path given too (as the tiny-tldr-online preset does) is still
    the evaluation's `eval/score` (issue 41: it was not loaded under --judge gold, and no score was logged)."""
    cmd = [sys.executable, str(REPO / "dpo.py"), "tiny-tldr-online", "--run-name", "gold", *_common(assets, tmp_path)]
    cmd += ["--reward-model-path", str(tiny_rm), "--judge", "gold", "--total-episodes", "8"]
    cmd += ["--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2", "--eval-every", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    evaluations = [r for r in _rows(tmp_path / "runs" / "gold" / "metrics.jsonl") if "eval/gold_reward" in r]
    assert len(evaluations) == 2 and all("eval/score" in r for r in evaluations)


def test_offline_dpo_on_two_processes(assets, tmp_path):
    # a script path, not `-m module`: accelerate's module mode does not set up the process group here
    cmd = launch_cmd(
        str(REPO / "dpo.py"),
        "tiny-tldr",
        "--run-name",
        "ddp",
        *_common(assets, tmp_path),
        "--max-train-samples",
        "32",
        "--per-device-train-batch-size",
        "4",
        "--eval-every",
        "100",
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "ddp" / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    assert [r["episode"] for r in train] == [8 * (i + 1) for i in range(4)]  # 32 pairs = 4 steps of 2 processes x 4
    assert train[0]["train/loss"] == pytest.approx(LOG2, abs=1e-4)
    assert rows[-1]["eval/accuracy"] >= 0.0 and "eval/gold_reward" in rows[-1]


def test_optimizer_steps_exactly_as_configured_when_the_loader_wraps(assets, tmp_path, monkeypatch):
    # 10 pairs in micro-batches of 2: 5 per pass over the loader, an odd number, so with gradient accumulation 2 an
    # update spans the loader's end; 3 epochs = 5 // 2 * 3 = 6 optimizer steps, drawn from `while True: yield from
    # loader`. accelerate's sync_with_dataloader would also step at every end of the loader (7 steps here)
    calls, original = [], torch.optim.AdamW.step

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counting)
    args = dataclasses.replace(
        dpo.PRESETS["tiny-tldr"][1],
        sft_model_path=str(assets / "models" / "tiny-neox"),
        dataset_name_or_path=str(assets / "tiny-tldr" / "preference"),
        prompt_dataset_name_or_path=str(assets / "tiny-tldr" / "sft"),
        output_dir=str(tmp_path),
        run_name="count",
        max_train_samples=10,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=3,
        num_eval_examples=0,
        num_eval_pairs=0,
        eval_every=100,
        log_every=1,
        save_model=False,
        num_threads=1,
    )
    dpo.main(args)
    assert len(calls) == 6
    train = [r for r in _rows(tmp_path / "count" / "metrics.jsonl") if "train/loss" in r]
    assert [r["episode"] for r in train] == [4 * (i + 1) for i in range(6)]
