"""benchmark.assets: deterministic builds, the tokenizer and the tiny models."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmark.assets import build


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_files_and_another_seed_does_not(tmp_path):
    a, b, c = (
        build(tmp_path / name, seed=seed, n_train=200, n_eval=20) for name, seed in (("a", 0), ("b", 0), ("c", 1))
    )
    tree_a, tree_b, tree_c = _tree(tmp_path / "a"), _tree(tmp_path / "b"), _tree(tmp_path / "c")
    assert tree_a.keys() == tree_b.keys()
    assert any(k.endswith("model.safetensors") for k in tree_a) and any(k.endswith("tokenizer.json") for k in tree_a)
    for name in tree_a:
        assert tree_a[name] == tree_b[name], f"{name} differs between two builds with the same seed"
    data = [k for k in tree_a if k.endswith(".jsonl")]
    assert len(data) == 13
    assert all(tree_a[k] != tree_c[k] for k in data)
    for rel, entry in a["files"].items():  # the manifest describes the files
        assert hashlib.sha256((tmp_path / "a" / rel).read_bytes()).hexdigest() == entry["sha256"]
        assert len((tmp_path / "a" / rel).read_text().splitlines()) == entry["rows"]


def test_tokenizer_has_distinct_eos_and_pad_single_digit_tokens_and_a_chat_template(assets):
    tok = AutoTokenizer.from_pretrained(assets / "tokenizer")
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    assert len(tok("123", add_special_tokens=False)["input_ids"]) == 3
    row = json.loads((assets / "tiny-tldr" / "sft" / "train.jsonl").open().readline())
    answer = json.loads((assets / "tiny-math" / "gsm8k" / "train.jsonl").open().readline())["answer"]
    for text in (row["query"] + row["reference_response"], answer):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"


def test_tiny_models_load_from_disk_and_are_small(assets):
    tok = AutoTokenizer.from_pretrained(assets / "tokenizer")
    kinds = {}
    for name in ("tiny-neox", "tiny-llama"):
        path = assets / "models" / name
        assert (path / "model.safetensors").exists() and not list(path.glob("*.bin"))
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 10_000_000
        assert model.config.vocab_size >= len(tok)
        assert model.config.pad_token_id == tok.pad_token_id and model.config.eos_token_id == tok.eos_token_id
        kinds[name] = model.config.model_type
    assert kinds == {"tiny-neox": "gpt_neox", "tiny-llama": "llama"}
