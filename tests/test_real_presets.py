"""The real presets on the real tokenizers and real-schema data (shared/real-assets): one EOS per TL;DR response,
weights that move under the bf16 presets, and gradient accumulation that holds on every update."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dpo
import ppo_rlhf
import remax
import reward_model
import rloo
import sft
from benchmark.tools.real_check import PYTHIA, build_model, default_assets

REPO = Path(__file__).resolve().parent.parent
ASSETS = default_assets()
needs_assets = pytest.mark.skipif(
    ASSETS is None or not ASSETS.is_dir(),
    reason="no real assets (set CLEAN_RLHF_REAL_ASSETS or put them in ../shared/real-assets)",
)


@pytest.fixture(scope="module")
def pythia_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "pythia")


def _split(path: Path):
    from datasets import load_dataset

    return load_dataset("json", data_files=str(path), split="train")


# ---- item 5: the N+ responses already end with the text <|endoftext|> (Pythia's EOS) ----


@needs_assets
def test_every_real_dpo_response_ends_in_exactly_one_eos(pythia_tokenizer):
    """sft.py's and reward_model.py's are checked against N+'s own counts in tests/test_sft.py, test_reward_model.py."""
    tok, eos = pythia_tokenizer, pythia_tokenizer.eos_token_id
    args = dpo.PRESETS["tldr-pythia-1b"][1]
    for item in dpo.tokenize_pairs(_split(ASSETS / "tldr" / "preference" / "train.jsonl"), tok, args, "train"):
        for key in ("chosen", "rejected"):
            assert item[key][-1] == eos and item[key].count(eos) == 1, key


@needs_assets
def test_reward_model_reads_its_reward_where_ppo_reads_it(pythia_tokenizer):
    """The reward model is trained on query + response (its reward at the last token); PPO scores a sampled response
    at the index of its last real token after truncating at the first EOS. Same token for the same text."""
    tok, eos = pythia_tokenizer, pythia_tokenizer.eos_token_id
    rm_args = reward_model.PRESETS["tldr-pythia-1b"][1]
    ds = _split(ASSETS / "tldr" / "preference" / "train.jsonl")
    pairs = reward_model.tokenize_pairs(ds, tok, rm_args, "train")
    for row, pair in zip(ds, pairs, strict=True):
        query = tok(row["query"], add_special_tokens=False)["input_ids"]
        sampled = torch.tensor(
            [tok(row["chosen"], add_special_tokens=False)["input_ids"] + [eos, eos]]
        )  # the policy goes on
        truncated = ppo_rlhf.truncate_response(sampled, eos, tok.pad_token_id)
        ppo_index = len(query) + int(ppo_rlhf.first_true_indices(truncated == tok.pad_token_id)[0]) - 1
        assert pair["chosen"][: len(query)] == query
        assert len(pair["chosen"]) - 1 == ppo_index


# ---- item 3: bf16 with fp32 master weights ----


def _real_presets(mod):
    return {name: args for name, (_, args) in mod.PRESETS.items() if not name.startswith("tiny")}


@pytest.mark.parametrize("mod", [sft, reward_model, ppo_rlhf, rloo, remax, dpo], ids=lambda m: m.__name__)
def test_real_presets_keep_float32_weights(mod):
    """bf16 comes from the accelerate config's mixed precision (DeepSpeed keeps fp32 master weights, DDP autocasts):
    weights loaded in bf16 and stepped by plain AdamW round an update of lr 3e-6 away."""
    for name, args in _real_presets(mod).items():
        assert args.dtype == "float32", (mod.__name__, name)


@needs_assets
def test_weights_move_under_the_bf16_sft_preset_at_its_learning_rate(tmp_path):
    """`accelerate launch --config_file multi_gpu.yaml sft.py tldr-pythia-1b` (mixed precision bf16), 4 optimizer steps
    at the preset's learning rate 3e-6: most transformer weights move (with the weights in bf16, 3.6% did)."""
    from safetensors.torch import load_file

    model = build_model(tmp_path / "pythia-1b", PYTHIA, str(ASSETS / "tokenizers" / "pythia"))
    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": "bf16", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [
            sys.executable,
            str(REPO / "sft.py"),
            "tldr-pythia-1b",
            "--model-name-or-path",
            str(model),
            "--dataset-name-or-path",
            str(ASSETS / "tldr" / "sft"),
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "bf16",
            "--per-device-train-batch-size",
            "2",
            "--max-train-samples",
            "8",
            "--num-eval-examples",
            "2",
            "--eval-every",
            "1000",
            "--num-threads",
            "1",
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    before, after = load_file(model / "model.safetensors"), load_file(tmp_path / "bf16" / "model" / "model.safetensors")
    layers = [k for k in before if ".layers." in k and k.endswith("weight") and before[k].dim() == 2]
    moved = sum(int((after[k] != before[k].to(after[k].dtype)).sum()) for k in layers)  # a bf16 copy is no move
    total = sum(before[k].numel() for k in layers)
    assert moved / total > 0.3, f"only {moved / total:.2%} of the layer weights moved"


# ---- item 4: gradient accumulation on every update, also the ones that draw the loader's last batch ----


def _tiny_math(assets, tmp_path: Path, rows: int) -> Path:
    out = tmp_path / "data"
    out.mkdir()
    for split in ("train", "test"):
        lines = (assets / "tiny-math" / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:rows]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture
def optimizer_steps():
    """Counts the real optimizer steps (accelerate skips the inner step while it accumulates)."""
    steps = []
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: steps.append(1))
    yield steps
    handle.remove()


def _rl_args(mod, assets, data: Path, tmp_path: Path, **sizes):
    return mod.Args(
        exp_name="ga",
        run_name=f"ga_{mod.__name__}",
        output_dir=str(tmp_path),
        seed=3,
        num_threads=1,
        sft_model_path=str(assets / "models" / "tiny-neox"),
        reward_model_path=None,
        reward_source="math",
        dataset_name_or_path=str(data),
        eval_split="test",
        prompt_template="Question: {question}\nAnswer:\n",
        reference_template="{answer}",
        max_prompt_length=96,
        response_length=6,
        temperature=1.0,
        learning_rate=1e-4,
        eval_every=100,
        num_eval_examples=2,
        save_model=False,
        **sizes,
    )


@pytest.mark.parametrize("script", ["ppo_rlhf", "rloo", "remax"])
def test_optimizer_steps_per_update_hold_across_the_end_of_the_prompt_loader(assets, tmp_path, optimizer_steps, script):
    """12 prompts, 4 per update: the loader ends every third update. Each update must take exactly its configured
    number of optimizer steps (before the fix: every micro-batch of the update that drew the last batch stepped)."""
    data = _tiny_math(assets, tmp_path, 12)
    if script == "ppo_rlhf":  # 7 updates x 2 epochs x 2 minibatches, 2 micro-batches each
        args = _rl_args(
            ppo_rlhf,
            assets,
            data,
            tmp_path,
            total_episodes=28,
            per_device_batch_size=4,
            num_mini_batches=2,
            gradient_accumulation_steps=2,
            num_ppo_epochs=2,
            separate_backward=False,
        )
        expected, main = 7 * 2 * 2, ppo_rlhf.main
    elif script == "rloo":  # 2 prompts x k=2 per update; 7 updates x 1 epoch x 1 minibatch of 2 micro-batches
        args = _rl_args(
            rloo,
            assets,
            data,
            tmp_path,
            total_episodes=28,
            per_device_batch_size=4,
            rloo_k=2,
            num_mini_batches=1,
            gradient_accumulation_steps=2,
            num_ppo_epochs=1,
        )
        expected, main = 7, rloo.main
    else:  # 7 updates, one optimizer step each over 2 micro-batches
        args = _rl_args(
            remax, assets, data, tmp_path, total_episodes=28, per_device_batch_size=4, gradient_accumulation_steps=2
        )
        expected, main = 7, remax.main
    main(args)
    assert len(optimizer_steps) == expected
    rows = [json.loads(line) for line in (tmp_path / args.run_name / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 7


# ---- DeepSpeed takes the micro-batch and --max-grad-norm from the script, not from accelerate's defaults ----


@pytest.mark.parametrize("mod", [sft, reward_model, ppo_rlhf, rloo, remax, dpo], ids=lambda m: m.__name__)
def test_configure_deepspeed_sets_micro_batch_and_gradient_clipping(mod):
    from types import SimpleNamespace

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))
    # the package's function, imported by name or called as `engines.configure_deepspeed` (rloo.py, remax.py)
    configure_deepspeed = getattr(mod, "configure_deepspeed", None) or mod.engines.configure_deepspeed
    configure_deepspeed(accelerator, 3, 0.5)
    assert config == {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.5}
    configure_deepspeed(accelerator, None, 0.25)  # None: accelerate reads it from the prepared dataloader
    assert config == {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.25}
    configure_deepspeed(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)), 3, 0.5)  # no DeepSpeed
