"""`disable_dropout` (issue 49 item 7): every dropout a model has is off, the attention dropout that GPT-NeoX and Llama
keep as a float on their attention modules included, so two train-mode forward passes give the same logits."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig

CONFIGS = {
    "gpt-neox": GPTNeoXConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        attention_dropout=0.3,
        hidden_dropout=0.0,
    ),
    "llama": LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        attention_dropout=0.3,
    ),
}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("script", ["sft", "reward_model", "ppo_rlhf", "rloo", "remax", "grpo_math", "dpo"])
def test_disable_dropout_switches_off_attention_dropout(script, arch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch], attn_implementation="sdpa").train()
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, model(ids).logits)  # the attention dropout is on in train mode
        importlib.import_module(script).disable_dropout(model, None)
        assert model.training and torch.equal(model(ids).logits, model(ids).logits)
