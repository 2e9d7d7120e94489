"""The single-file rule and the script conventions of CONTRIBUTING.md, checked on every top-level script."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in REPO.glob("*.py") if p.name not in ("setup.py", "conftest.py"))
LOCAL = {p.stem for p in SCRIPTS} | {"benchmark", "tests"}
COPIED = ["gold_judge", "extract_gsm8k_answer", "extract_boxed_answer", "numbers_equal", "TLDR_FACT_WORDS", "TLDR_MAX_WORDS"]
# helpers copied between scripts verbatim (variants that differ on purpose, e.g. ReMax's greedy sampler, or PPO's pack and
# check_packing for its one-row packed_sdpa attention, are not listed)
ALL = ["sft", "reward_model", "ppo_rlhf", "rloo", "remax", "grpo_math", "dpo"]
RL = ["ppo_rlhf", "rloo", "remax", "grpo_math", "dpo"]
LORA = ["sft", "ppo_rlhf", "rloo", "remax", "grpo_math", "dpo"]
MATH = ["ppo_rlhf", "rloo", "remax", "grpo_math"]  # one MATH grader (math-verify) in every script that grades answers
GLOBAL_MEAN = ["sft", "reward_model", "ppo_rlhf", "remax", "dpo"]  # RLOO and GRPO keep their own (equal-size) means
BETWEEN_SCRIPTS = {"check_packing": ["grpo_math", "rloo", "remax"], "sample_responses": ["rloo", "ppo_rlhf"],
                   "pack": ["rloo", "remax"], "packed_logprobs": ["rloo", "remax"],
                   # the engines (DDP, DeepSpeed ZeRO-2/3, FSDP), saving, tokenizers, evaluation shards
                   "make_accelerator": ALL, "zero3": ALL, "save_model": ALL, "ensure_pad_token": ALL,
                   "shard_length": ALL, "configure_deepspeed": ALL, "prepare_frozen": RL,
                   "end_with_eos": ["sft", "reward_model", "dpo"],
                   "math_verify_equal": MATH, "extract_answer": MATH, "success_reward": MATH,
                   # one mean over the whole mini-batch of every process (tests/test_invariance.py)
                   "global_count": GLOBAL_MEAN, "backward_share": GLOBAL_MEAN, "step_micro_batches": ["sft", "reward_model"],
                   "refine_step_rewards": ["ppo_rlhf", "grpo_math"],
                   # loading and durable runs (tests/test_faults.py, tests/test_bad_inputs.py)
                   "load_split": ALL, "require_hub": ALL, "Run": ALL, "replace_dir": ALL, "check_args": ALL,
                   "chat_messages": ["sft", "reward_model", "ppo_rlhf", "rloo", "remax", "dpo"],
                   "reference_text": ["ppo_rlhf", "rloo", "remax", "dpo"],
                   "non_finite_policy": ["rloo", "remax"], "check_finite_weights": ["rloo", "remax"],
                   # LoRA through peft (tests/test_lora*.py); save_model merges the adapters in every script
                   "add_lora": LORA, "LoraReference": LORA, "merge_lora": ALL}


def _definitions(path: Path) -> dict[str, str]:
    return _definitions_of(path.read_text())


@functools.cache
def _definitions_of(source: str) -> dict[str, str]:
    """Top-level name -> its source text (what `ast.get_source_segment` gives, without its rescan of the file)."""
    lines = source.splitlines(keepends=True)

    def segment(node) -> str:
        part = [line.encode() for line in lines[node.lineno - 1 : node.end_lineno]]  # offsets count UTF-8 bytes
        part[-1] = part[-1][: node.end_col_offset]
        part[0] = part[0][node.col_offset :]
        return b"".join(part).decode()

    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = segment(node)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = segment(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):  # `TLDR_MAX_WORDS: int = 12`
            out[node.target.id] = segment(node)
    return out


def test_canonical_helpers_exist():
    """A renamed helper in tiny_world.py would make the drift check below pass vacuously."""
    assert set(COPIED) <= set(_definitions(REPO / "benchmark" / "tiny_world.py"))


def test_drift_check_catches_a_changed_copy(tmp_path):
    canonical = _definitions(REPO / "benchmark" / "tiny_world.py")
    faithful = "import re\n\n" + canonical["TLDR_MAX_WORDS"] + "\n\n\n" + canonical["numbers_equal"] + "\n"
    (tmp_path / "ok.py").write_text(faithful)
    (tmp_path / "drifted.py").write_text(faithful.replace("< 1e-6", "< 1e-3").replace("= 12", ": int = 13"))
    ok, drifted = _definitions(tmp_path / "ok.py"), _definitions(tmp_path / "drifted.py")
    assert all(ok[name] == canonical[name] for name in ("TLDR_MAX_WORDS", "numbers_equal"))
    assert all(drifted[name] != canonical[name] for name in ("TLDR_MAX_WORDS", "numbers_equal"))


def test_there_are_scripts():
    assert {"sft", "reward_model"} <= {p.stem for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_stands_alone(script):
    tree = ast.parse(script.read_text())
    assert ast.get_docstring(tree), "a module docstring says what it implements and cites the paper"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            names = [node.module.split(".")[0]]
        else:
            continue
        assert not set(names) & LOCAL, f"line {node.lineno} imports {names}: an algorithm script imports only third-party packages"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_copied_helpers_match_the_canonical_ones(script):
    canonical = _definitions(REPO / "benchmark" / "tiny_world.py")
    mine = _definitions(script)
    for name in COPIED:
        if name in mine:
            assert mine[name] == canonical[name], f"{script.name}: {name} drifted from benchmark/tiny_world.py"


@pytest.mark.parametrize("name", sorted(BETWEEN_SCRIPTS))
def test_helpers_copied_between_scripts_agree(name):
    copies = {script: _definitions(REPO / f"{script}.py").get(name) for script in BETWEEN_SCRIPTS[name]}
    assert all(copies.values()), f"{name} missing from {[k for k, v in copies.items() if not v]}"
    assert len(set(copies.values())) == 1, f"the copies of {name} differ between {list(copies)}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_args_fields_are_documented_and_presets_exist(script):
    tree = ast.parse(script.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    assert "Args" in classes
    body = classes["Args"].body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            nxt = body[i + 1] if i + 1 < len(body) else None
            documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
            assert documented, f"Args.{node.target.id} has no docstring"
    presets = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "PRESETS")
    keys = [k.value for k in presets.value.keys]
    assert any(k.startswith("tiny") for k in keys) and any(not k.startswith("tiny") for k in keys)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_lists_presets(script):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and "tiny" in out.stdout
