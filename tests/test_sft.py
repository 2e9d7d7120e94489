"""sft.py: the loss against hand-computed values, padding and EOS handling, input errors."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

import sft
from benchmark.tools.real_check import default_assets
from clean_rlhf_utils import data, engines, loading

REAL = default_assets() or Path("no-real-assets")  # $CLEAN_RLHF_REAL_ASSETS, else ../shared/real-assets


def tokenizer_of(args):
    """sft.py's tokenizer, as its main loads it (`loading.load_tokenizer`)."""
    return sft.load_tokenizer(
        args.model_name_or_path, "--model-name-or-path", args.trust_remote_code, args.add_pad_token, args.revision
    )


def test_sft_loss_counts_only_response_tokens_hand_computed():
    # vocab of 2; example 0: 2 prompt tokens, response token 1 then EOS (id 0); example 1: 1 prompt token,
    # one response token, then 2 pad positions. Position t predicts label t+1.
    labels = torch.tensor([[-100, -100, 1, 0], [-100, 1, -100, -100]])
    garbage = torch.tensor([50.0, -50.0])  # would dominate the loss if a masked position were counted
    logits = garbage.repeat(2, 4, 1).clone()
    logits[0, 1] = torch.tensor([0.0, math.log(3)])  # predicts label 1 with p = 3/4
    logits[0, 2] = torch.tensor([0.0, 0.0])  # predicts label 0 (EOS) with p = 1/2
    logits[1, 0] = torch.tensor([math.log(4), 0.0])  # predicts label 1 with p = 1/5
    expected = (math.log(4 / 3) + math.log(2) + math.log(5)) / 3  # mean over the 3 response tokens
    assert sft.sft_loss(logits, labels).item() == pytest.approx(expected, rel=1e-6)


def test_collate_right_pads_and_masks_prompt_and_padding():
    examples = [{"prompt_ids": [5, 6], "response_ids": [7, 0]}, {"prompt_ids": [5], "response_ids": [0]}]
    batch = sft.collate_right_padded(examples, pad_id=1)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [5, 0, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 0], [-100, 0, -100, -100]]


def test_left_pad_for_generation():
    ids, mask = data.left_pad([[3, 4, 5], [6]], pad_id=1)
    assert ids.tolist() == [[3, 4, 5], [1, 1, 6]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_truncate_after_first_eos():
    tokens = torch.tensor([[5, 0, 7, 0], [5, 6, 7, 8], [0, 5, 5, 5]])
    out = sft.truncate_after_eos(tokens, eos_id=0, pad_id=1)
    assert out.tolist() == [[5, 0, 1, 1], [5, 6, 7, 8], [0, 1, 1, 1]]


def _args(assets, **kw):
    base = dict(
        model_name_or_path=str(assets / "models" / "tiny-neox"),
        dataset_name_or_path=str(assets / "tiny-tldr" / "sft"),
        max_prompt_length=96,
        max_response_length=48,
    )
    return sft.Args(**{**base, **kw})


def test_tokenize_appends_eos_and_rejects_overlong_rows(assets):
    args = _args(assets)
    tok = tokenizer_of(args)
    rows = Dataset.from_list(
        [{"query": "SUBREDDIT: r/x\n\nTITLE: t\n\nPOST: p\n\nTL;DR:", "reference_response": " my dog"}]
    )
    (ex,) = sft.tokenize_split(rows, tok, args, "train")
    assert ex["response_ids"][-1] == tok.eos_token_id
    assert tok.decode(ex["response_ids"][:-1]) == " my dog"
    ends_in_eos = Dataset.from_list([{"query": "q", "reference_response": " my dog" + tok.eos_token}])
    assert sft.tokenize_split(ends_in_eos, tok, args, "train")[0]["response_ids"] == ex["response_ids"]  # no second EOS
    long = Dataset.from_list([{"query": "word " * 200, "reference_response": " x"}])
    with pytest.raises(SystemExit, match="max-prompt-length"):
        sft.tokenize_split(long, tok, args, "train")
    mixed = Dataset.from_list(
        [{"query": "word " * 200, "reference_response": " x"}, {"query": "q", "reference_response": " y"}]
    )
    assert len(sft.tokenize_split(mixed, tok, _args(assets, drop_overlong=True), "train")) == 1


def test_malformed_rows_give_clear_errors(assets):
    args = _args(assets)
    tok = tokenizer_of(args)
    with pytest.raises(SystemExit, match="no field 'reference_response'"):
        sft.tokenize_split(Dataset.from_list([{"query": "q", "summary": "s"}]), tok, args, "train")
    with pytest.raises(SystemExit, match="empty response"):
        sft.tokenize_split(Dataset.from_list([{"query": "q", "reference_response": "  "}]), tok, args, "train")


def test_tokenizer_without_pad_token_is_an_error_unless_asked_to_add_one(assets, tmp_path):
    tok = AutoTokenizer.from_pretrained(assets / "tokenizer")
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="no pad token"):
        tokenizer_of(sft.Args(model_name_or_path=str(tmp_path)))
    added = tokenizer_of(sft.Args(model_name_or_path=str(tmp_path), add_pad_token=True))
    assert added.pad_token == "[PAD]" and added.pad_token_id != added.eos_token_id


def test_short_run_writes_run_directory(assets, tmp_path):
    args = _args(
        assets,
        output_dir=str(tmp_path),
        run_name="r",
        max_train_samples=64,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        num_eval_examples=8,
        per_device_eval_batch_size=4,  # two evaluation batches: the harness's state carries over between them
        eval_every=4,
        log_every=2,
        eval_task="tldr",
        num_threads=1,
    )
    metrics = sft.main(args)
    run = tmp_path / "r"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all({"step", "episode", "time"} <= set(r) for r in rows)
    train_rows = [r for r in rows if "train/loss" in r]
    assert train_rows[-1]["train/loss"] < train_rows[0]["train/loss"]  # 8 steps at lr 1e-3 must reduce the loss
    assert [r["episode"] for r in train_rows] == [r["step"] * 8 for r in train_rows]
    assert {"eval/gold_reward", "eval/win_rate", "eval/loss"} <= set(metrics)
    assert json.loads((run / "config.json").read_text())["learning_rate"] == 1e-3
    assert (run / "model" / "model.safetensors").exists() and not list((run / "model").glob("*.bin"))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="Linux, 2 cores or more")
def test_the_thread_pool_is_the_share_of_the_cores_the_process_may_use(assets, tmp_path):
    """Restricted to one core (taskset, a SLURM cpuset, an xdist worker here), a run sizes its pool to that core, not
    to all of the machine's: more threads than cores spin against each other."""
    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    assert engines.cpu_threads(1) == len(allowed) and engines.cpu_threads(len(allowed)) == 1
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert engines.cpu_threads(1) == engines.cpu_threads(2) == 1
        torch.set_num_threads(2)
        sft.main(
            _args(
                assets,
                output_dir=str(tmp_path),
                run_name="r",
                max_train_samples=8,
                num_eval_examples=8,
                per_device_train_batch_size=8,
                num_threads=None,
            )
        )
        assert torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)


def test_one_step_is_the_same_however_the_batch_is_split_into_micro_batches(assets, tmp_path):
    """The same 4 sequences in one optimizer step as one micro-batch of 4, as 2 accumulated micro-batches of 2, and as
    2 micro-batches of 2 in a step of accumulation 4 that the epoch's end cuts short: the loss is the mean over the
    response tokens of the whole step, sum_i sum_t -log p(y_it) / sum_i |y_i|, so the logged loss and the weights after
    the step are equal. Adam's first update is lr * g / (|g| + eps): with eps = 1 it follows the gradient's size, not
    only its sign. (Before: the mean of per-micro-batch means, and a short last step scaled by its share of 4.)"""
    from safetensors.torch import load_file

    results = []
    for batch_size, accumulation in [(4, 1), (2, 2), (2, 4)]:
        name = f"b{batch_size}x{accumulation}"
        args = _args(
            assets,
            output_dir=str(tmp_path),
            run_name=name,
            max_train_samples=4,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            learning_rate=0.1,
            adam_eps=1.0,
            max_grad_norm=1e9,
            num_eval_examples=1,
            eval_every=100,
            log_every=1,
            num_threads=1,
        )
        sft.main(args)
        (train,) = [
            r
            for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r
        ]
        results.append((train["train/loss"], load_file(tmp_path / name / "model" / "model.safetensors")))
    (loss, weights), others = results[0], results[1:]
    start = load_file(assets / "models" / "tiny-neox" / "model.safetensors")
    assert any(not torch.equal(weights[k], start[k]) for k in start)  # the step moved the weights
    for other_loss, other_weights in others:
        assert other_loss == pytest.approx(loss, rel=1e-5)
        for k in weights:
            torch.testing.assert_close(other_weights[k], weights[k], atol=1e-6, rtol=1e-5)


def test_chat_template_wraps_the_prompt_as_a_user_turn(assets):
    args = _args(assets, use_chat_template=True, prompt_template="{question}", response_template="{answer}")
    tok = tokenizer_of(args)
    (ex,) = sft.tokenize_split(
        Dataset.from_list([{"question": "What is 2 + 2?", "answer": "#### 4"}]), tok, args, "train"
    )
    assert tok.decode(ex["prompt_ids"]) == "<|user|>\nWhat is 2 + 2?<|endoftext|>\n<|assistant|>\n"
    assert ex["response_ids"][-1] == tok.eos_token_id


@pytest.mark.skipif(not (REAL / "tldr" / "sft").is_dir(), reason=f"no real assets at {REAL}")
def test_real_tldr_rows_fit_the_preset_with_one_eos():
    """The N+ references end with the text `<|endoftext|>` (Pythia's EOS): tokenised with the real tokenizer they get no
    second EOS, so the longest N+ reference (53 tokens, EOS included) fits the preset's --max-response-length 53."""
    args = dataclasses.replace(
        sft.PRESETS["tldr-pythia-1b"][1],
        model_name_or_path=str(REAL / "tokenizers" / "pythia"),
        dataset_name_or_path=str(REAL / "tldr" / "sft"),
    )
    assert (args.max_prompt_length, args.max_response_length) == (512, 53)
    tok = tokenizer_of(args)
    for split in ("train", "validation", "test"):
        rows = loading.load_split(args.dataset_name_or_path, split)
        for ex, row in zip(sft.tokenize_split(rows, tok, args, split), rows, strict=True):
            assert ex["response_ids"][-1] == tok.eos_token_id != ex["response_ids"][-2]
            assert len(ex["response_ids"]) == row["reference_response_token_len"]  # N+'s own count: one EOS
    # a reference as long as the longest N+ one: 52 tokens of text, then `<|endoftext|>`
    longest = " " + " ".join(["word"] * 52) + "<|endoftext|>"
    query = "SUBREDDIT: r/x\n\nTITLE: t\n\nPOST: p\n\nTL;DR:"
    rows = Dataset.from_list([{"query": query, "reference_response": longest}])
    (ex,) = sft.tokenize_split(rows, tok, args, "train")
    assert len(ex["response_ids"]) == 53 and ex["response_ids"].count(tok.eos_token_id) == 1


def test_conversational_rows_are_rendered_with_the_chat_template(assets):
    """TRL's `messages` rows (`{messages}` as both templates) and its conversational prompt/completion rows give the
    prompt's turns in the tokenizer's chat template with the generation prompt, and the last assistant turn's text
    as the response (one EOS appended): the same token ids as `--use-chat-template` on the plain-text row."""
    plain = {"query": "my dog ate my rent", "reference_response": " dog ate rent"}
    tok = tokenizer_of(_args(assets))
    (want,) = sft.tokenize_split(Dataset.from_list([plain]), tok, _args(assets, use_chat_template=True), "train")
    user, assistant = {"role": "user", "content": plain["query"]}, {"role": "assistant", "content": " dog ate rent"}
    for row, templates in [
        ({"messages": [user, assistant]}, ("{messages}", "{messages}")),
        ({"prompt": [user], "completion": [assistant]}, ("{prompt}", "{completion}")),
    ]:
        args = _args(assets, prompt_template=templates[0], response_template=templates[1])
        (got,) = sft.tokenize_split(Dataset.from_list([row]), tok, args, "train")
        assert (got["prompt_ids"], got["response_ids"], got["response"]) == (
            want["prompt_ids"],
            want["response_ids"],
            plain["reference_response"],
        )
