"""Data-parallel sanity check: `accelerate launch --multi_gpu --num_processes 2 benchmark/tools/ddp_check.py OUT_DIR
[ASSETS_DIR]`.

Every process takes a different shard of a fixed batch of tiny-tldr sequences, runs a few SGD steps of
the SFT loss on the tiny GPT-NeoX model through `accelerate` (gloo on CPU, NCCL on GPUs), and saves its
final weights to OUT_DIR/rank{R}.safetensors. Run without `accelerate launch` it takes the whole batch in
one process. The test compares: the ranks must end with identical weights (gradients were all-reduced),
the weights must have moved, and they must match the single-process run on the union batch (data parallel
gives the same update as one big batch when every sequence has the same length).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from benchmark.assets import ensure_assets

STEPS, GLOBAL_BATCH, LENGTH = 3, 8, 24


def main(out_dir: str, assets_dir: str = "runs/assets") -> None:
    # without a GPU, Accelerator joins the launched processes into a gloo group only when told it runs on CPU
    accelerator = Accelerator(cpu=not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1)
    torch.set_num_threads(1)
    assets = Path(assets_dir)
    if accelerator.is_main_process:
        ensure_assets(assets)
    accelerator.wait_for_everyone()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        assets / "models" / "tiny-neox", local_files_only=True, dtype=torch.float32
    )
    vocab = model.config.vocab_size
    data = torch.randint(2, vocab, (STEPS, GLOBAL_BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    # plain SGD: the update is linear in the gradient, so float32 rounding stays at its own size; Adam's first steps
    # are about lr * sign(gradient), which turns a rounding difference on a near-zero gradient into a visible one
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    per_rank = GLOBAL_BATCH // accelerator.num_processes
    for step in range(STEPS):
        batch = data[step, accelerator.process_index * per_rank : (accelerator.process_index + 1) * per_rank].to(
            accelerator.device
        )
        logits = model(input_ids=batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.detach().cpu().contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(state, str(Path(out_dir) / f"rank{accelerator.process_index}_of{accelerator.num_processes}.safetensors"))
    accelerator.print(
        f"{accelerator.num_processes} process(es), backend {accelerator.state.backend}, final loss {loss.item():.4f}"
    )


if __name__ == "__main__":
    if not sys.argv[1:] or sys.argv[1] in ("-h", "--help"):  # not an OUT_DIR named --help
        print(f"usage: python -m benchmark.tools.ddp_check OUT_DIR [ASSETS_DIR]\n\n{__doc__}")
        sys.exit(0 if sys.argv[1:] else 2)
    main(*sys.argv[1:])
