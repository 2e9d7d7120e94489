"""LoRA through peft (Hu et al. 2021, arXiv:2106.09685): the merge of `model/` against hand-computed weights, and
grpo_math.py with `--lora-r`: only the adapters train, the reference is the base model with the adapters disabled (no
second copy), and the written model is the plain merged one. sft/dpo and ppo/rloo/remax: tests/test_lora_*.py."""

from __future__ import annotations

import itertools
import json
import types

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import grpo_math as grpo
from clean_rlhf_utils import engines

pytest.importorskip("peft")


def test_merge_lora_adds_alpha_over_r_times_b_a():
    # W' = W + (alpha / r) B A (LoRA eq. 3 with peft's scaling alpha / r); here r = 2, alpha = 4: scale 2
    W = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]])  # out 2 x in 3
    A = torch.tensor([[1.0, 0.0, 1.0], [0.0, 2.0, 0.0]])  # r x in
    B = torch.tensor([[1.0, 0.0], [0.0, -1.0]])  # out x r
    p = "base_model.model.layer.q"
    sd = {
        f"{p}.base_layer.weight": W,
        f"{p}.base_layer.bias": torch.tensor([0.5, -0.5]),
        f"{p}.lora_A.default.weight": A,
        f"{p}.lora_B.default.weight": B,
        "base_model.model.head.weight": torch.ones(1, 2),
    }
    config = types.SimpleNamespace(r=2, lora_alpha=4.0, fan_in_fan_out=False)
    merged = engines.merge_lora(sd, config)
    # B A = [[1, 0, 1], [0, -2, 0]]; times 2, plus W
    assert torch.equal(merged["layer.q.weight"], torch.tensor([[3.0, 0.0, 4.0], [0.0, -3.0, -1.0]]))
    assert torch.equal(merged["layer.q.bias"], torch.tensor([0.5, -0.5]))
    assert torch.equal(merged["head.weight"], torch.ones(1, 2))
    assert set(merged) == {"layer.q.weight", "layer.q.bias", "head.weight"}  # no peft names left
    # GPT-2's Conv1D stores W as in x out (fan_in_fan_out): the update is transposed
    sd_t = {**sd, f"{p}.base_layer.weight": W.T.contiguous()}
    merged_t = engines.merge_lora(sd_t, types.SimpleNamespace(r=2, lora_alpha=4.0, fan_in_fan_out=True))
    assert torch.equal(merged_t["layer.q.weight"], torch.tensor([[3.0, 0.0, 4.0], [0.0, -3.0, -1.0]]).T)


def _args(assets, tmp_path, **kw) -> grpo.Args:
    base = {
        "model_name_or_path": str(assets / "models" / "tiny-llama"),
        "dataset_name_or_path": str(assets / "tiny-math" / "gsm8k"),
        "dataset_config": None,
        "prompt_template": "Question: {question}\nAnswer:\n",
        "reference_template": "{answer}",
        "max_prompt_length": 96,
        "questions_per_device": 2,
        "num_generations": 4,
        "total_steps": 2,
        "max_completion_length": 12,
        "micro_batch_size": 4,
        "num_mini_batches": 2,
        "learning_rate": 1e-2,
        "eval_every": 10,
        "num_eval_examples": 4,
        "pass_k": 0,
        "output_dir": str(tmp_path),
        "num_threads": 1,
        "seed": 3,
        "beta": 0.04,
        "lora_r": 4,
        "lora_alpha": 8.0,
    }
    base.update(kw)
    return grpo.Args(**base)


def test_grpo_lora_trains_adapters_against_the_base_as_reference(assets, tmp_path, monkeypatch):
    calls = itertools.count()  # rewards 1, 0, 1, 0, ...: every group of 4 has both, so step 1 always updates
    monkeypatch.setattr(grpo, "success_reward", lambda text, gold, fmt: float(next(calls) % 2 == 0))
    loads, refs = [], []
    load = grpo.loading.load_causal_lm
    monkeypatch.setattr(grpo.loading, "load_causal_lm", lambda *a, **k: loads.append(1) or load(*a, **k))

    class Recorded(grpo.engines.LoraReference):
        def __init__(self, policy):
            super().__init__(policy)
            refs.append(self)

    monkeypatch.setattr(grpo.engines, "LoraReference", Recorded)
    grpo.main(_args(assets, tmp_path, run_name="lora", num_mini_batches=1))  # step 1: one update, from the base
    assert len(loads) == 1 and len(refs) == 1  # the reference is the policy itself, not a second load
    rows = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss/policy" in r]
    assert train[0]["objective/kl"] == 0.0  # B = 0 at the start: the policy is its base
    assert train[1]["objective/kl"] > 0.0
    # only the adapters moved: with them disabled the trained policy is the initial model, to the bit
    initial = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-llama").eval()
    x = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.equal(refs[0](input_ids=x).logits, initial(input_ids=x).logits)
        trained = refs[0].policy[0](input_ids=x).logits
    # model/ is the plain model with the adapters merged: no peft names, and the same outputs
    saved = load_file(tmp_path / "lora" / "model" / "model.safetensors")
    assert not [k for k in saved if "lora_" in k or "base_layer" in k]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "model").eval()
    with torch.no_grad():
        out = merged(input_ids=x).logits
    assert torch.allclose(out, trained, atol=1e-5) and not torch.allclose(out, initial(input_ids=x).logits, atol=1e-3)


def test_lora_errors_name_the_flag(assets, tmp_path):
    with pytest.raises(SystemExit, match=r"error: --lora-target-modules \['no_such_module'\]"):
        grpo.main(_args(assets, tmp_path, run_name="bad", lora_target_modules=["no_such_module"]))
