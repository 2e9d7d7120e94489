"""Launched by tests/test_real_check.py under ZeRO-3 (2 processes): one training step on a small Pythia-shaped model,
then `save_model` (clean_rlhf_utils.engines's, which every script uses) writes OUT/model, and rank 0 writes the trained
weights, gathered from the shards by DeepSpeed itself, to OUT/trained.safetensors for the test to compare."""

import json
import sys
from pathlib import Path

import deepspeed
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from clean_rlhf_utils.engines import make_accelerator, save_model

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
accelerator = make_accelerator(1, sync_with_dataloader=True)
accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2  # no dataloader here
model = AutoModelForCausalLM.from_pretrained(model_dir)  # partitioned by zero.Init (zero3_init_flag)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(accelerator.process_index))
accelerator.backward(model(input_ids=ids, labels=ids).loss)
optimizer.step()
unwrapped = accelerator.unwrap_model(model)
partitioned = sum(p.numel() == 0 for p in unwrapped.parameters())  # weights this rank holds no part of in full
save_model(model, tokenizer, accelerator, out / "model")
with deepspeed.zero.GatheredParameters(list(unwrapped.parameters())):
    trained = {k: v.detach().clone().contiguous() for k, v in unwrapped.named_parameters()}
if accelerator.is_main_process:
    save_file(trained, out / "trained.safetensors")
    info = {
        "zero_stage": accelerator.state.deepspeed_plugin.zero_stage,
        "processes": accelerator.num_processes,
        "partitioned": partitioned,
    }
    (out / "result.json").write_text(json.dumps(info))
accelerator.wait_for_everyone()
