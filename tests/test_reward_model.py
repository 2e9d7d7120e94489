"""reward_model.py: Bradley-Terry and PRM losses against formulas, padding invariance, normalisation."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

import reward_model as rm
from benchmark.tools.real_check import default_assets
from clean_rlhf_utils import engines

REAL = default_assets() or Path("no-real-assets")  # $CLEAN_RLHF_REAL_ASSETS, else ../shared/real-assets
needs_real = pytest.mark.skipif(not (REAL / "tldr" / "preference").is_dir(), reason=f"no real assets at {REAL}")


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_bradley_terry_loss_matches_formula():
    rc, rr = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.5])
    expected = -sum(math.log(_sigmoid(c - r)) for c, r in [(1.0, 0.0), (-0.5, 0.5), (2.0, 2.5)]) / 3
    assert rm.bradley_terry_loss(rc, rr).item() == pytest.approx(expected, rel=1e-6)
    margin = torch.tensor([0.5, 0.0, 1.0])
    expected_m = (
        -sum(math.log(_sigmoid(c - r - m)) for c, r, m in [(1.0, 0.0, 0.5), (-0.5, 0.5, 0.0), (2.0, 2.5, 1.0)]) / 3
    )
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
    model = AutoModelForSequenceClassification.from_pretrained(
        assets / "models" / model_name, num_labels=1, local_files_only=True
    )
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.eval()
    seqs, pad = [[5, 9, 23, 40, 0], [7, 8, 0]], 1
    right = torch.tensor([[5, 9, 23, 40, 0], [7, 8, 0, pad, pad]])
    left = torch.tensor([[5, 9, 23, 40, 0], [pad, pad, 7, 8, 0]])
    mask_right, mask_left = (right != pad).long(), (left != pad).long()
    with torch.no_grad():
        r_right = rm.outcome_reward(model, right, mask_right)
        r_left = rm.outcome_reward(model, left, mask_left)
        alone = torch.stack(
            [rm.outcome_reward(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in seqs]
        )
    torch.testing.assert_close(r_right, r_left, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_right, alone, atol=1e-5, rtol=1e-5)
    model.config.reward_bias = 0.25  # the stored normalisation is added to every reward
    with torch.no_grad():
        torch.testing.assert_close(rm.outcome_reward(model, right, mask_right), r_right + 0.25)


@pytest.mark.parametrize("model_name", ["tiny-neox", "tiny-llama"])
def test_packed_pairs_give_the_padded_rewards_loss_and_gradients(assets, model_name):
    model = AutoModelForSequenceClassification.from_pretrained(
        assets / "models" / model_name, num_labels=1, local_files_only=True
    )
    torch.nn.init.normal_(model.score.weight, generator=torch.Generator().manual_seed(0), std=0.5)
    model.config.reward_bias = 0.25
    # pairs of different lengths: a shared prompt, responses sharing their first tokens, chosen a prefix of rejected,
    # no common prefix at all, and identical sequences (the reward is still read at each one's last token)
    pairs = [
        ([5, 9, 23, 40, 7, 0], [5, 9, 23, 41, 0]),
        ([7, 8, 0], [7, 8, 12, 13, 14, 15, 0]),
        ([3, 4, 5, 6, 0], [9, 9, 0]),
        ([11, 12, 13, 0], [11, 12, 13, 0]),
    ]
    batch = [{"chosen": c, "rejected": r, "margin": m} for (c, r), m in zip(pairs, [0.0, 0.5, 0.0, 1.0])]
    args = rm.Args(center_rewards_coef=0.01)
    padded, packed = rm.collate(batch, 1, "outcome"), rm.collate(batch, 1, "outcome", pack=True)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()  # no padding, and each common prefix once
    results = []
    for b in (padded, packed):
        model.zero_grad()
        loss, out = rm.micro_batch_loss(model, b, args)
        loss = loss / rm.loss_units(b, "outcome")  # the mean over the pairs
        loss.backward()
        results.append(
            (
                loss.detach(),
                out["r_chosen"],
                out["r_rejected"],
                torch.cat([p.grad.flatten() for p in model.parameters()]),
            )
        )
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    # and the rewards are those of each sequence scored alone, as a consumer scores them
    with torch.no_grad():
        alone = [
            rm.outcome_reward(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0]
            for s in [c for c, _ in pairs] + [r for _, r in pairs]
        ]
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


def test_conversational_pairs_are_rendered_with_the_chat_template(assets):
    """TRL's conversational prompt / chosen / rejected rows: the prompt's messages in the tokenizer's chat template,
    ready for the assistant's turn, then the assistant's text and one EOS, as the same pair in plain text would be."""
    tok = AutoTokenizer.from_pretrained(assets / "models" / "tiny-neox")
    args = rm.Args(max_length=160, prompt_template="{prompt}")
    row = {
        "prompt": [{"role": "user", "content": "my dog ate my rent"}],
        "chosen": [{"role": "assistant", "content": " dog ate rent"}],
        "rejected": [{"role": "assistant", "content": " dog"}],
    }
    (pair,) = rm.tokenize_pairs(Dataset.from_list([row]), tok, args, "train")
    prompt = list(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
    for key in ("chosen", "rejected"):
        text = row[key][0]["content"]
        assert pair[key] == prompt + tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_normalisation_makes_mean_reference_reward_zero(assets, tmp_path):
    args = rm.Args(
        sft_model_path=str(assets / "models" / "tiny-neox"),
        dataset_name_or_path=str(assets / "tiny-tldr" / "preference"),
        norm_dataset_name_or_path=str(assets / "tiny-tldr" / "sft"),
        num_norm_examples=40,
        max_train_samples=32,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        num_eval_examples=16,
        max_length=160,
        output_dir=str(tmp_path),
        run_name="rm",
        num_threads=1,
        confidence_field="confidence",
    )
    metrics = rm.main(args)
    assert metrics["eval/reward_bias"] != 0.0
    # reload as a consumer would, and score the same reference responses independently
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm" / "model", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "rm" / "model")
    assert model.config.reward_type == "outcome"
    assert model.config.reward_bias == pytest.approx(metrics["eval/reward_bias"])
    rows = rm.load_split(str(assets / "tiny-tldr" / "sft"), "train").select(range(40))
    seqs = [
        tok(r["query"], add_special_tokens=False)["input_ids"]
        + tok(r["reference_response"], add_special_tokens=False)["input_ids"]
        + [tok.eos_token_id]
        for r in rows
    ]
    ids, mask, _ = rm.right_pad(seqs, tok.pad_token_id)
    with torch.no_grad():
        rewards = rm.outcome_reward(model.eval(), ids, mask)
    assert abs(rewards.mean().item()) < 1e-4


@pytest.mark.parametrize("objective", ["outcome", "process"])
def test_one_step_is_the_same_however_the_batch_is_split_into_micro_batches(assets, tmp_path, objective):
    """The same 4 examples in one optimizer step as one micro-batch of 4, as 2 accumulated micro-batches of 2, and as
    2 micro-batches of 2 in a step of accumulation 4 that the epoch's end cuts short give the same logged loss and
    weights: the loss is the mean over the whole step's pairs, (1/N) sum_i -log sigmoid(r_c,i - r_r,i) (outcome), or
    over its labelled steps, (1/S) sum_s BCE(score_s, label_s) (process; solutions hold different numbers of steps).
    Adam's first update is lr * g / (|g| + eps): with eps = 1 it follows the gradient's size, not only its sign.
    (Before: per-micro-batch means, and a short last step scaled by its share of 4.)"""
    from safetensors.torch import load_file

    if objective == "outcome":
        data = dict(
            sft_model_path=str(assets / "models" / "tiny-neox"),
            dataset_name_or_path=str(assets / "tiny-tldr" / "preference"),
            max_length=160,
            normalize=False,
        )
    else:
        data = dict(
            objective="process",
            sft_model_path=str(assets / "models" / "tiny-llama"),
            max_length=192,
            dataset_name_or_path=str(assets / "tiny-math" / "prm"),
            eval_split="test",
            prompt_template="Question: {prompt}\nAnswer:\n",
            normalize=False,
        )
    results = []
    for batch_size, accumulation in [(4, 1), (2, 2), (2, 4)]:
        name = f"b{batch_size}x{accumulation}"
        args = rm.Args(
            **data,
            max_train_samples=4,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            learning_rate=0.1,
            adam_eps=1.0,
            max_grad_norm=1e9,
            num_eval_examples=4,
            eval_every=100,
            log_every=1,
            output_dir=str(tmp_path),
            run_name=name,
            num_threads=1,
        )
        rm.main(args)
        (train,) = [
            r
            for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r
        ]
        results.append((train["train/loss"], load_file(tmp_path / name / "model" / "model.safetensors")))
    (loss, weights), others = results[0], results[1:]
    for other_loss, other_weights in others:
        assert other_loss == pytest.approx(loss, rel=1e-5)
        for k in weights:
            torch.testing.assert_close(other_weights[k], weights[k], atol=1e-6, rtol=1e-5)


def test_lookup_reads_dotted_paths():
    row = {"confidence": 4, "extra": {"confidence": 7}, "none": {"confidence": None}}
    assert rm.lookup(row, "confidence") == 4 and rm.lookup(row, "extra.confidence") == 7
    assert rm.lookup(row, "none.confidence") is None and rm.lookup(row, "missing.confidence") is None
    assert rm.lookup(row, "confidence.deeper") is None  # a level that is not a dict


def test_wrong_normalisation_path_fails_before_training(assets, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the missing folder is then no hub name either
    args = rm.Args(
        sft_model_path=str(assets / "models" / "tiny-neox"),
        dataset_name_or_path=str(assets / "tiny-tldr" / "preference"),
        norm_dataset_name_or_path=str(tmp_path / "missing"),
        max_length=160,
        output_dir=str(tmp_path),
        run_name="rm",
    )
    with pytest.raises(SystemExit, match="--norm-dataset-name-or-path"):
        rm.main(args)
    assert not (tmp_path / "rm").exists()  # nothing was trained or written


@pytest.fixture(scope="module")
def real_pythia_rm_start(tmp_path_factory):
    """A small random GPT-NeoX with Pythia's vocabulary, saved with the real Pythia tokenizer (no pad token, as the
    hub's loads under transformers 4; transformers 5 would default it to `<|padding|>`), like an SFT checkpoint."""
    out = tmp_path_factory.mktemp("real-pythia-tiny")
    tok = AutoTokenizer.from_pretrained(REAL / "tokenizers" / "pythia")
    tok.pad_token = None
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=50304,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=2048,
        eos_token_id=0,
        bos_token_id=0,
    )
    GPTNeoXForCausalLM(config).save_pretrained(out)
    return out


@needs_real
def test_real_preference_rows_train_and_log_accuracy_by_confidence(real_pythia_rm_start, tmp_path):
    """The tldr preset's data path on the real N+ rows: responses already ending in EOS get no second one, pairs
    fit --max-length 638, and the nested `extra.confidence` groups the validation accuracy (null ones left out)."""
    preset = rm.PRESETS["tldr-pythia-1b"][1]
    args = dataclasses.replace(
        preset,
        sft_model_path=str(real_pythia_rm_start),
        dataset_name_or_path=str(REAL / "tldr" / "preference"),
        norm_dataset_name_or_path=str(REAL / "tldr" / "sft"),
        num_norm_examples=8,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        output_dir=str(tmp_path),
        run_name="rm",
        num_threads=2,
        save_model=False,
    )
    tok = rm.load_checked_tokenizer(args.sft_model_path, args)
    assert tok.pad_token == "[PAD]" and tok.pad_token_id == 50277  # N+'s [PAD]
    rows = rm.load_split(args.dataset_name_or_path, "train")
    pairs = rm.tokenize_pairs(rows, tok, args, "train")
    for pair, row in zip(pairs, rows, strict=True):
        for key in ("chosen", "rejected"):
            assert pair[key][-1] == tok.eos_token_id != pair[key][-2]
            assert len(pair[key]) == row[f"query_{key}_token_len"]  # N+'s own count: one EOS
    rm.main(args)
    logged = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    by_confidence = {k for row in logged for k in row if k.startswith("eval/accuracy_confidence_")}
    validation = (REAL / "tldr" / "preference" / "validation.jsonl").read_text().splitlines()
    validation = [json.loads(line) for line in validation]
    expected = {(r.get("extra") or {}).get("confidence") for r in validation} - {None}
    assert expected and by_confidence == {f"eval/accuracy_confidence_{c}" for c in expected}


def test_shard_length_drops_the_padding_of_every_shorter_shard():
    """`split_between_processes(apply_padding=True)` pads every shorter shard with the last row, not only the last
    rank's: 9 rows on 4 ranks are [0 1 2] [3 4 8] [5 6 8] [7 8 8]; keeping each rank's own rows gives all 9 once."""
    from types import SimpleNamespace

    rows, ranks = list(range(9)), 4
    per, extra = divmod(len(rows), ranks)
    kept = []
    for rank in range(ranks):
        start = rank * per + min(rank, extra)
        shard = rows[start : start + per + (rank < extra)]
        shard += [rows[-1]] * (per + (extra > 0) - len(shard))  # accelerate's padding
        kept += shard[: engines.shard_length(len(rows), SimpleNamespace(num_processes=ranks, process_index=rank))]
    assert kept == rows
