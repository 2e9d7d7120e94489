"""Launched by tests/test_offline_and_distributed.py under one process, DDP or DeepSpeed ZeRO-2 (argv: model
directory, output directory, the dtype to load in): one AdamW step on a tiny model, then `save_model` (what
`runs.Run.finish` calls) writes OUT/model in that dtype. Rank 0 also writes, for the test to compare, the trained
weights by another route: DeepSpeed's own checkpoint converted to float32 by its `zero_to_fp32` (the master weights),
elsewhere the module's weights; and the module's weights as the engine holds them (DeepSpeed: bf16)."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from clean_rlhf_utils.engines import make_accelerator, save_model

model_dir, out, dtype = Path(sys.argv[1]), Path(sys.argv[2]), getattr(torch, sys.argv[3])
accelerator = make_accelerator(1, sync_with_dataloader=True)
deepspeed = accelerator.state.deepspeed_plugin is not None
if deepspeed:
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2  # no dataloader here
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(accelerator.process_index))
accelerator.backward(model(input_ids=ids, labels=ids).loss)
optimizer.step()
save_model(model, tokenizer, accelerator, out / "model", dtype=dtype)
unwrapped = accelerator.unwrap_model(model)
module = {k: v.detach().clone().contiguous() for k, v in unwrapped.named_parameters()}
if deepspeed:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model.save_checkpoint(str(out / "ds"))  # every rank writes its partition of the optimizer's float32 weights
    accelerator.wait_for_everyone()
    trained = get_fp32_state_dict_from_zero_checkpoint(str(out / "ds")) if accelerator.is_main_process else {}
else:
    trained = module
if accelerator.is_main_process:
    save_file({k: v.contiguous() for k, v in trained.items() if k in module}, out / "trained.safetensors")
    save_file(module, out / "module.safetensors")
    info = {
        "processes": accelerator.num_processes,
        "deepspeed": deepspeed,
        "mixed_precision": accelerator.mixed_precision,
    }
    (out / "result.json").write_text(json.dumps(info))
accelerator.wait_for_everyone()
