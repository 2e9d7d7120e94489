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
    assert len(data) == 15  # tiny-math 8, tiny-tldr 5, tiny-tldr-noisy 2
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


# The tiny world as it was before tiny-tldr-noisy (issue 22) was added: sha256 of every file of the default build (seed
# 0), so results measured on it stay valid. A change here is a new tiny world: say so in the results.
PINNED = {
    "tiny-math/gsm8k/test.jsonl": "1888f2ff73b4688eeae045664cb9c4419c9d1b6cb3ff9d75199db724cb87d6c0",
    "tiny-math/gsm8k/train.jsonl": "e56e99770312e15f7cddc1bff035eac0cf3e1d08fa27f087c354f501563db119",
    "tiny-math/math/test.jsonl": "ad363eb764a6591439f56e39a14d78e007b088efd72ec279b1986a8db7290510",
    "tiny-math/math/train.jsonl": "90726f690cd355e14cc912aa159db4bd5c8541b14a2793906bd1b71a724673cb",
    "tiny-math/prm/test.jsonl": "0087fa2509ce3946767394362b18b0c10dab002132c0052c97f0d0f6dd46fda0",
    "tiny-math/prm/train.jsonl": "d6a5fd213a16073a117e01d9f6003b1da6b709a5ca44b927539d86c75c4bf7c9",
    "tiny-math/sft/test.jsonl": "1888f2ff73b4688eeae045664cb9c4419c9d1b6cb3ff9d75199db724cb87d6c0",
    "tiny-math/sft/train.jsonl": "9a0bd2ee981939571ee0224062bcdb53ecb53eff9df49c67e4b884957774879a",
    "tiny-tldr/preference/train.jsonl": "6098a6e9c79df7ea4118d21991e107b1f7d3a4fb6d116127cfec89fdd4bcef26",
    "tiny-tldr/preference/validation.jsonl": "df6c09279c08a9acd4f749852f61f69a60b5c0a8fb57babb238b2e9cb8e8c21a",
    "tiny-tldr/sft/test.jsonl": "856e2741429b2e6202d6ed578e75e3d28b61e4d18790b1d54f2a4659535ac700",
    "tiny-tldr/sft/train.jsonl": "c33692425fc87ba807c4e6fa45b0095f6d02922356a214df47b22972df636c45",
    "tiny-tldr/sft/validation.jsonl": "c6698419ad95ccc838efe72ffa199783049a950ae1569f1228ed1e1f4425e87b",
    "tokenizer/tokenizer.json": "a97ca6935e674edc12dcc75accd24d059c3670b3cd84f4a8ae7fa4495df85809",
    "models/tiny-neox/model.safetensors": "2b9f4020476fc6cb62a443cacef65d535f2125fad2c326182d86165e52708ea4",
    "models/tiny-llama/model.safetensors": "be58b71655bbbaefe06c3eac3fd3a4cd3fdf6ec3a3cd2f0aab7f6509cb6a5830",
}


def test_the_tiny_world_stays_byte_identical(assets):
    for rel, digest in PINNED.items():
        assert hashlib.sha256((assets / rel).read_bytes()).hexdigest() == digest, f"{rel} changed"


def test_the_shipped_starts_are_placed_in_the_assets_and_a_changed_copy_is_restored(tmp_path):
    """Issue 66: GRPO's fixed-start run reads the shipped tiny-math SFT policy from runs/assets/starts/."""
    from benchmark.assets import STARTS, place_starts
    from benchmark.suites import SUITES

    out = tmp_path / "assets"
    place_starts(out)
    src, dst = STARTS / "sft_tiny-math", out / "starts" / "sft_tiny-math"
    assert _tree(dst) == _tree(src) and (src / "model.safetensors").is_file()
    (dst / "model.safetensors").write_bytes(b"not the start")
    (dst / "tokenizer.json").unlink()
    place_starts(out)
    assert _tree(dst) == _tree(src)
    assert not [p for p in (out / "starts").iterdir() if p.name.startswith(".")], "no folder left aside"
    # the main job's fixed-start stage points at the placed copy, a path relative to the run's working directory
    flags = [st.args(quick=True) for st in SUITES["quick"]([1]) if st.run_name == "grpo-fixed-start_tiny-math__1"]
    assert flags and "runs/assets/starts/sft_tiny-math" in flags[0]


def test_the_shipped_start_loads_in_float32_holding_its_float16_values_exactly():
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from benchmark.assets import STARTS

    stored = load_file(STARTS / "sft_tiny-math" / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.float16}  # 3.5 MB in the repository, not 7
    model = AutoModelForCausalLM.from_pretrained(STARTS / "sft_tiny-math", dtype=torch.float32)
    weights = model.state_dict()
    for name, t in stored.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], t.float()), name
