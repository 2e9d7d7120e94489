"""reward_model.py: Bradley-Terry and PRM losses against formulas, padding invariance, normalisation."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import reward_model as rm


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_bradley_terry_loss_matches_formula():
    rc, rr = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.5])
    expected = -sum(math.log(_sigmoid(c - r)) for c, r in [(1.0, 0.0), (-0.5, 0.5), (2.0, 2.5)]) / 3
    assert rm.bradley_terry_loss(rc, rr).item() == pytest.approx(expected, rel=1e-6)
    margin = torch.tensor([0.5, 0.0, 1.0])
    expected_m = -sum(math.log(_sigmoid(c - r - m)) for c, r, m in [(1.0, 0.0, 0.5), (-0.5, 0.5, 0.0), (2.0, 2.5, 1.0)]) / 3
    assert rm.bradley_terry_loss(rc, rr, margin).item() == pytest.approx(expected_m, rel=1e-6)
    centred = expected + 0.01 * ((1.0 + 0.0) ** 2 + (-0.5 + 0.5) ** 2 + (2.0 + 2.5) ** 2) / 3
    assert rm.bradley_terry_loss(rc, rr, center_coef=0.01).item() == pytest.approx(centred, rel=1e-6)


def test_process_loss_is_bce_on_step_positions_only():
    logits = torch.tensor([[9.0, 0.0, 9.0, math.log(3)]])
    labels = torch.tensor([[-100, 1, -100, 0]])
    expected = (-math.log(0.5) - math.log(1 - 0.75)) / 2
    assert rm.process_loss(logits, labels).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("model_name", ["tiny-neox", "tiny-llama"])
def test_reward_is_identical_under_left_and_right_padding(assets, model_name):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(assets / "models" / model_name, num_labels=1, local_files_only=True)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.eval()
    seqs, pad = [[5, 9, 23, 40, 0], [7, 8, 0]], 1
    right = torch.tensor([[5, 9, 23, 40, 0], [7, 8, 0, pad, pad]])
    left = torch.tensor([[5, 9, 23, 40, 0], [pad, pad, 7, 8, 0]])
    mask_right, mask_left = (right != pad).long(), (left != pad).long()
    with torch.no_grad():
        r_right = rm.outcome_reward(model, right, mask_right)
        r_left = rm.outcome_reward(model, left, mask_left)
        alone = torch.stack([rm.outcome_reward(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in seqs])
    torch.testing.assert_close(r_right, r_left, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_right, alone, atol=1e-5, rtol=1e-5)
    model.config.reward_bias = 0.25  # the stored normalisation is added to every reward
    with torch.no_grad():
        torch.testing.assert_close(rm.outcome_reward(model, right, mask_right), r_right + 0.25)


@pytest.mark.parametrize("model_name", ["tiny-neox", "tiny-llama"])
def test_packed_pairs_give_the_padded_rewards_loss_and_gradients(assets, model_name):
    model = AutoModelForSequenceClassification.from_pretrained(assets / "models" / model_name, num_labels=1, local_files_only=True)
    torch.nn.init.normal_(model.score.weight, generator=torch.Generator().manual_seed(0), std=0.5)
    model.config.reward_bias = 0.25
    # pairs of different lengths: a shared prompt, responses sharing their first tokens, chosen a prefix of rejected,
    # no common prefix at all, and identical sequences (the reward is still read at each one's last token)
    pairs = [([5, 9, 23, 40, 7, 0], [5, 9, 23, 41, 0]), ([7, 8, 0], [7, 8, 12, 13, 14, 15, 0]), ([3, 4, 5, 6, 0], [9, 9, 0]),
             ([11, 12, 13, 0], [11, 12, 13, 0])]
    batch = [{"chosen": c, "rejected": r, "margin": m} for (c, r), m in zip(pairs, [0.0, 0.5, 0.0, 1.0])]
    args = rm.Args(center_rewards_coef=0.01)
    padded, packed = rm.collate(batch, 1, "outcome"), rm.collate(batch, 1, "outcome", pack=True)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()  # no padding, and each common prefix once
    results = []
    for b in (padded, packed):
        model.zero_grad()
        loss, out = rm.compute_loss(model, b, args)
        loss.backward()
        results.append((loss.detach(), out["r_chosen"], out["r_rejected"], torch.cat([p.grad.flatten() for p in model.parameters()])))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    # and the rewards are those of each sequence scored alone, as a consumer scores them
    with torch.no_grad():
        alone = [rm.outcome_reward(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in [c for c, _ in pairs] + [r for _, r in pairs]]
    torch.testing.assert_close(torch.cat([results[1][1], results[1][2]]), torch.stack(alone), atol=1e-5, rtol=1e-5)


def test_step_tokenization_puts_labels_on_separators(assets):
    tok = AutoTokenizer.from_pretrained(assets / "tokenizer")
    args = rm.Args(objective="process", prompt_template="{prompt}")
    rows = Dataset.from_list([{"prompt": "Q", "completions": ["1 + 1 = 2 pens.", "#### 2"], "labels": [True, False]}])
    (ex,) = rm.tokenize_steps(rows, tok, args, "train")
    sep = tok("\n", add_special_tokens=False)["input_ids"][0]
    step_positions = [i for i, label in enumerate(ex["labels"]) if label != -100]
    assert [ex["input_ids"][i] for i in step_positions] == [sep, sep]
    assert [ex["labels"][i] for i in step_positions] == [1, 0]
    assert step_positions[-1] == len(ex["input_ids"]) - 1
    bad = Dataset.from_list([{"prompt": "Q", "completions": ["a", "b"], "labels": [True]}])
    with pytest.raises(SystemExit, match="2 steps but 1 labels"):
        rm.tokenize_steps(bad, tok, args, "train")


def test_malformed_preference_rows_give_clear_errors(assets):
    tok = AutoTokenizer.from_pretrained(assets / "tokenizer")
    args = rm.Args(max_length=160)
    with pytest.raises(SystemExit, match="no field 'rejected'"):
        rm.tokenize_pairs(Dataset.from_list([{"query": "q", "chosen": " a"}]), tok, args, "train")
    with pytest.raises(SystemExit, match="non-empty str"):
        rm.tokenize_pairs(Dataset.from_list([{"query": "q", "chosen": "", "rejected": " b"}]), tok, args, "train")


def test_normalisation_makes_mean_reference_reward_zero(assets, tmp_path):
    args = rm.Args(
        sft_model_path=str(assets / "models" / "tiny-neox"), dataset_name_or_path=str(assets / "tiny-tldr" / "preference"),
        norm_dataset_name_or_path=str(assets / "tiny-tldr" / "sft"), num_norm_examples=40, max_train_samples=32,
        per_device_train_batch_size=8, learning_rate=1e-3, num_eval_examples=16, max_length=160, output_dir=str(tmp_path),
        run_name="rm", num_threads=1, confidence_field="confidence")
    metrics = rm.main(args)
    assert metrics["eval/reward_bias"] != 0.0
    # reload as a consumer would, and score the same reference responses independently
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm" / "model", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "rm" / "model")
    assert model.config.reward_type == "outcome"
    assert model.config.reward_bias == pytest.approx(metrics["eval/reward_bias"])
    rows = rm.load_split(str(assets / "tiny-tldr" / "sft"), "train").select(range(40))
    seqs = [tok(r["query"], add_special_tokens=False)["input_ids"] + tok(r["reference_response"], add_special_tokens=False)["input_ids"]
            + [tok.eos_token_id] for r in rows]
    ids, mask, _ = rm.right_pad(seqs, tok.pad_token_id)
    with torch.no_grad():
        rewards = rm.outcome_reward(model.eval(), ids, mask)
    assert abs(rewards.mean().item()) < 1e-4
