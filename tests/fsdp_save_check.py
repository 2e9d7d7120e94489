"""Launched by tests/test_real_check.py under FSDP2 (benchmark/accelerate_configs/fsdp.yaml, 2 processes, gloo on CPU):
one training step on a small Pythia-shaped model, then `save_model` (clean_rlhf_utils.engines's, which every script
uses) writes OUT/model, and rank 0 writes the trained weights, gathered from the shards by FSDP itself
(`DTensor.full_tensor`), to OUT/trained.safetensors for the test to compare; OUT/result.json says which engine ran."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from clean_rlhf_utils.engines import global_count, make_accelerator, save_model, sharded

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
accelerator = make_accelerator(1, sync_with_dataloader=True)
model = AutoModelForCausalLM.from_pretrained(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(accelerator.process_index))
accelerator.backward(model(input_ids=ids, labels=ids).loss)
optimizer.step()
params = dict(accelerator.unwrap_model(model).named_parameters())
shards = sum(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in params.values())
save_model(model, tokenizer, accelerator, out / "model")
trained = {
    k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().contiguous() for k, p in params.items()
}
counted = global_count(1, accelerator)  # `reduce` sums over both processes (a collective: every rank calls it)
if accelerator.is_main_process:
    save_file(trained, out / "trained.safetensors")
    info = {
        "distributed_type": str(accelerator.distributed_type),
        "processes": accelerator.num_processes,
        "processes_counted": counted,
        "sharded": sharded(accelerator),
        "shards": shards,
    }
    (out / "result.json").write_text(json.dumps(info))
accelerator.wait_for_everyone()
