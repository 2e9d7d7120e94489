"""Supervised fine-tuning (SFT) of a causal language model on prompt/response pairs.

The first stage of the RLHF pipeline of "Learning to summarize from human feedback" (Stiennon et al. 2020),
as reproduced in "The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR Summarization"
(Huang et al. 2024, arXiv:2403.17031; code: github.com/vwxyzjn/summarize_from_feedback_details), and the
starting policy of the math track.

Details that matter (N+ paper, sections 3-5):
  * The loss is next-token cross-entropy on the response tokens only: prompt and pad positions get label
    -100. It is averaged over the response tokens of the whole batch of an optimizer step (every micro-batch of the
    gradient accumulation, every process; not over sequences, nor per micro-batch), as TRL does with
    `num_items_in_batch`: the micro-batches of a step are counted before its first backward pass.
  * Every response ends with exactly one EOS, so the model learns to stop: EOS is appended unless the response
    already ends with it (the N+ TL;DR responses end with the text `<|endoftext|>`, Pythia's EOS). PAD must be a
    different token from EOS, or EOS would be masked out with the padding and the model would never learn to stop
    (N+ adds a `[PAD]` token to Pythia's tokenizer; `--add-pad-token` does that here, and a tokenizer without a pad
    token, or with PAD = EOS, is an error otherwise).
  * Right padding for training, left padding for generation (so every prompt ends at the same position and
    `generate` continues it directly).
  * Prompts are never truncated silently: too long a prompt or response is an error (or, with
    `--drop-overlong`, the row is dropped and counted). N+ filters TL;DR queries to 512 tokens and
    reference responses to 53 tokens.
  * Real-track hyperparameters (N+ paper, Table 3 and the repository's `sft.py`): learning rate 3e-6,
    cosine schedule, 1 epoch, batch size 128, AdamW with eps 1e-5, dropout disabled.

`--lora-r` trains LoRA adapters (Hu et al. 2021, arXiv:2106.09685) through peft instead of every weight; `model/` is the
plain model with the adapters merged in, so the next stage loads it without peft.

Usage:
    python -m benchmark.assets                 # builds the tiny offline world under runs/assets
    python sft.py tiny-tldr                    # CPU, a few minutes
    python sft.py tiny-math
    accelerate launch --multi_gpu --num_processes 8 sft.py tldr-pythia-1b
    python sft.py tiny-tldr --help             # every flag, with its documentation
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from clean_rlhf_utils.args import DataArgs, ModelArgs, RunArgs
from clean_rlhf_utils.data import tokenize_split
from clean_rlhf_utils.engines import add_lora, configure_deepspeed, global_count
from clean_rlhf_utils.evaluation import check_sft_evaluation_fields, evaluate_sft
from clean_rlhf_utils.loading import config_positions, load_causal_lm, load_tokenizer, load_train_and_eval_rows
from clean_rlhf_utils.metrics import training_metrics
from clean_rlhf_utils.runs import cli, loop_state, one_error_line, start_run


@dataclass
class Args(DataArgs, ModelArgs, RunArgs):
    # shared flags: clean_rlhf_utils/args.py (a shared flag redeclared here has this script's default or docstring)
    # ---- experiment ----
    seed: int = 1
    """seed of the experiment (model init of added tokens, data order, sampling)"""
    save_every: int = 0
    """write a checkpoint every N optimizer steps; 0: only when stopped (SIGTERM, SIGINT, a non-finite loss)"""

    # ---- model ----
    model_name_or_path: str = "EleutherAI/pythia-1b-deduped"
    """base model: a hub name or a local directory saved with `save_pretrained`"""
    revision: str | None = None
    """hub revision (branch, tag or commit) of the model"""

    # ---- LoRA (peft) ----
    lora_r: int | None = None
    """LoRA rank (Hu et al. 2021, arXiv:2106.09685): train rank-r adapters beside the frozen weights instead of every
    weight (`pip install -e '.[peft]'`); `model/` is saved as the plain model, the adapters merged into its weights
    (range: >= 1)"""

    # ---- data ----
    dataset_name_or_path: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """a hub dataset, a `save_to_disk` folder, a folder of `{split}.jsonl|json|parquet` files, or one such file"""
    prompt_template: str = "{query}"
    """Python format string building the prompt from a row's fields (each must be text: a missing, null or list field
    is an error). Conversational data is rendered with the tokenizer's chat template when the template is one field
    alone holding chat messages: TRL's `messages` format (`{messages}` here and in `response_template`: the prompt is
    every turn before the last, an assistant turn, with the generation prompt) or its conversational
    prompt/completion format (`{prompt}`, the prompt's messages)"""
    response_template: str = "{reference_response}"
    """Python format string building the response from a row's fields (EOS is appended unless it already ends
    with the EOS token); a field alone holding chat messages gives the content of their last turn, an assistant turn
    (`{messages}`, or TRL's conversational `{completion}`)"""
    max_prompt_length: int = 512
    """longest prompt in tokens (N+: 512 for TL;DR); longer prompts are an error unless `drop_overlong`"""
    max_response_length: int = 53
    """longest response in tokens, EOS included (N+: 53 for TL;DR); also the generation budget at eval"""
    drop_overlong: bool = False
    """drop (and count) rows whose prompt or response is too long instead of failing"""
    max_train_samples: int | None = None
    """use only the first N training rows (debugging)"""

    # ---- optimisation ----
    learning_rate: float = 3e-6
    """peak learning rate (N+: 3e-6) (range: > 0)"""
    adam_eps: float = 1e-5
    """AdamW epsilon (N+: 1e-5) (range: > 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm: a negative one ascends the gradient, 0 stops learning (range: > 0)"""
    lora_alpha: float = 32.0
    """LoRA scale numerator: an adapted weight is W + (alpha / r) B A (TRL's ModelConfig default, 32) (range: > 0)"""
    lora_target_modules: list[str] | None = None
    """(LoRA) names of the modules to adapt; default every linear layer but the output head (peft's "all-linear")"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """decay after warm-up"""
    warmup_ratio: float = 0.0
    """share of the optimizer steps spent warming the learning rate up linearly from 0 (range: [0, 1))"""
    weight_decay: float = 0.0
    """AdamW weight decay (range: >= 0)"""
    num_train_epochs: int = 1
    """passes over the training split"""
    per_device_train_batch_size: int = 16
    """sequences per device per micro-batch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step; the global batch is this x per-device batch x processes"""

    # ---- evaluation and logging ----
    eval_task: Literal["none", "tldr", "gsm8k", "boxed"] = "none"
    """task-specific evaluation of greedy samples: `tldr` gold judge + win rate (tiny world), `gsm8k`
    (`#### number`) or `boxed` (`\\boxed{}`) exact-answer accuracy; `none` logs validation loss only. What it needs
    (each row's `facts` for tldr, a final answer in each reference) is checked when the evaluation split is loaded"""
    eval_every: int = 100
    """evaluate every N optimizer steps (and at the end)"""
    num_eval_examples: int = 200
    """evaluation rows used for loss and samples"""
    per_device_eval_batch_size: int = 32
    """sequences per device at evaluation"""
    log_every: int = 10
    """log training metrics every N optimizer steps"""
    save_model: bool = True
    """save the final model and tokenizer to `runs/<run_name>/model` (safetensors)"""


# The real presets load float32 weights and get bf16 from the accelerate config's mixed precision (DeepSpeed: bf16
# compute, fp32 master weights; DDP: autocast), as N+ and TRL do. Lengths: the default limits 512 / 53 fit the N+ TL;DR
# SFT data (queries at most 512 tokens; longest reference response 53 tokens with its EOS; shared/real-assets README).
# They checkpoint ten times a run (`save_every`): 116,722 rows / 128 a step = 911 steps.
PRESETS = {
    "tldr-pythia-1b": (
        "N+ SFT on TL;DR, Pythia 1B (8 GPUs)",
        Args(
            save_every=90,
            model_name_or_path="EleutherAI/pythia-1b-deduped",
            add_pad_token=True,
            per_device_train_batch_size=16,
            gradient_accumulation_steps=1,
            eval_every=200,
        ),
    ),
    "tldr-pythia-2.8b": (
        "N+ SFT on TL;DR, Pythia 2.8B (8 GPUs)",
        Args(
            save_every=90,
            model_name_or_path="EleutherAI/pythia-2.8b-deduped",
            add_pad_token=True,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            eval_every=200,
        ),
    ),
    "tldr-pythia-6.9b": (
        "N+ SFT on TL;DR, Pythia 6.9B (8 GPUs, DeepSpeed ZeRO-2)",
        Args(
            save_every=90,
            model_name_or_path="EleutherAI/pythia-6.9b-deduped",
            add_pad_token=True,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            eval_every=200,
        ),
    ),
    "tiny-tldr": (
        "tiny-tldr on CPU (needs `python -m benchmark.assets`)",
        Args(
            model_name_or_path="runs/assets/models/tiny-neox",
            dataset_name_or_path="runs/assets/tiny-tldr/sft",
            learning_rate=1e-3,
            lr_schedule="cosine",
            # 6 epochs, not 2: copying the post's feeling word into the summary forms late (docs/sft.md)
            warmup_ratio=0.05,
            num_train_epochs=6,
            per_device_train_batch_size=32,
            max_prompt_length=96,
            max_response_length=48,
            eval_task="tldr",
            eval_every=200,
            num_eval_examples=200,
        ),
    ),
    "tiny-math": (
        "tiny-math (GSM8K schema) on CPU (needs `python -m benchmark.assets`)",
        Args(
            model_name_or_path="runs/assets/models/tiny-llama",
            # 60% of the answers skip the working, so RL has something to teach; 6 epochs, not 3 (docs/sft.md)
            dataset_name_or_path="runs/assets/tiny-math/sft",
            eval_split="test",
            prompt_template="Question: {question}\nAnswer:\n",
            response_template="{answer}",
            learning_rate=1e-3,
            warmup_ratio=0.05,
            num_train_epochs=6,
            per_device_train_batch_size=32,
            max_prompt_length=96,
            max_response_length=80,
            eval_task="gsm8k",
            eval_every=250,
            num_eval_examples=200,
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# The SFT math: the loss on the response tokens, one mean over the whole mini-batch of every process
# --------------------------------------------------------------------------------------------------


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
    """Next-token cross-entropy averaged (or summed) over the positions whose label is not -100 (response tokens and
    EOS). Position t predicts label t+1, hence the shift."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    mask = labels != -100
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1), reduction="none")
    total = (nll.view_as(labels) * mask).sum()
    return total if reduction == "sum" else total / mask.sum().clamp(min=1)


def micro_batch_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One micro-batch of `main`: the cross-entropy summed over its response tokens (`main` divides by the response
    tokens of the whole batch, `global_count`, in its loss scale)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return sft_loss(logits, batch["labels"], reduction="sum")


# --------------------------------------------------------------------------------------------------
# main: the training loop, as numbered steps
# --------------------------------------------------------------------------------------------------


@one_error_line
def main(args: Args) -> dict:
    """SFT: 1. start the run; 2. load and check the data; 3. load the policy, dropout off; 4. the loader, AdamW and the
    schedule; 5. the update loop, one mean of `sft_loss` over the response tokens of each step; 6. log, evaluate and
    checkpoint; 7. save model/ and done.json. Returns the last evaluation's metrics."""
    # ---- 1. the run: accelerator, argument checks, run directory (a used one is refused before anything loads), seed.
    # Real epochs: `step_micro_batches` ends a step at the loader's end; the gradient sync is set per step below
    accelerator, run = start_run(args, PRESETS, sync_with_dataloader=False)
    set_seed(args.seed)

    # ---- 2. data: every row rendered, tokenized (the response ending in one EOS) and checked now
    tokenizer = load_tokenizer(
        args.model_name_or_path, "--model-name-or-path", args.trust_remote_code, args.add_pad_token, args.revision
    )
    train_rows, eval_rows = load_train_and_eval_rows(args)
    positions = config_positions(args)
    train = tokenize_split(train_rows, tokenizer, args, args.train_split, positions=positions)
    evals = tokenize_split(eval_rows, tokenizer, args, args.eval_split, check_sft_evaluation_fields, positions)

    # ---- 3. the policy: dropout off (N+), then LoRA adapters with --lora-r
    model = load_causal_lm(args, tokenizer)
    disable_dropout(model)
    model = add_lora(model, args)

    # ---- 4. the shuffled loader, AdamW and the learning-rate schedule
    generator = torch.Generator().manual_seed(args.seed)  # same shuffle on every process; accelerate shards it
    loader = torch.utils.data.DataLoader(
        train,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        generator=generator,
        collate_fn=lambda b: collate_right_padded(b, tokenizer.pad_token_id),
        drop_last=True,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=args.adam_eps, weight_decay=args.weight_decay)
    configure_deepspeed(accelerator, None, args.max_grad_norm)  # micro-batch: the loader's
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # the loader's last, possibly partial, accumulation steps the optimizer too (`step_micro_batches`)
    total_steps = math.ceil(len(loader) / args.gradient_accumulation_steps) * args.num_train_epochs
    if total_steps == 0:
        raise SystemExit(
            f"error: {len(train)} training rows make no full batch of {args.per_device_train_batch_size} x "
            f"{args.gradient_accumulation_steps} x {accelerator.num_processes} processes"
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.lr_schedule, int(args.warmup_ratio * total_steps), total_steps)
    )
    accelerator.register_for_checkpointing(scheduler)  # saved and restored with the checkpoint
    batch_episodes = args.per_device_train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    micro_rows = args.per_device_train_batch_size * accelerator.num_processes  # drop_last: every micro-batch is full
    run.begin()
    accelerator.print(
        f"run {args.run_name}: {len(train)} training rows, {total_steps} optimizer steps of {batch_episodes} sequences"
    )

    # ---- 5. the update loop: each step's micro-batches, the loss a mean over the response tokens of all of them
    step, episode, running, n_micro, n_steps, t_last, metrics, grad_norm = 0, 0, [], 0, 0, time.time(), {}, None
    if state := run.resume():  # the loop's counters; the data position is replayed below
        running = [torch.tensor(v) for v in state["running"][accelerator.process_index]]
        n_micro, n_steps, metrics = state["n_micro"], state["n_steps"], state["metrics"]
    resumed_at = state["step"] if state else 0

    def loop_now() -> dict:  # a checkpoint's counters: `loop_state` counts each step a full one, `episode` the rows
        return dict(loop_state(step, len(running), n_micro, n_steps, running, metrics, batch_episodes), episode=episode)

    progress = tqdm(total=total_steps, initial=resumed_at, disable=not accelerator.is_main_process, desc=args.exp_name)
    for epoch in range(args.num_train_epochs):
        for micro in step_micro_batches(loader, args.gradient_accumulation_steps):
            episode += len(micro) * micro_rows  # the rows trained: an epoch's short last step has fewer micro-batches
            if step < resumed_at:  # replay the data order up to the checkpoint, without training
                step += 1
                continue
            # the loss is the mean over the response tokens of the whole step: every micro-batch and process
            total = global_count(sum(response_tokens(b) for b in micro), accelerator)
            # `accumulate` syncs when its count of micro-batches reaches the accumulation steps: on this step's last
            accelerator.step = args.gradient_accumulation_steps - len(micro)
            for batch in micro:
                with accelerator.accumulate(model):
                    loss_sum = micro_batch_loss(model, batch)
                    if not run.all_finite(loss_sum):
                        run.fail(f"non-finite SFT loss at step {step + 1}: lower --learning-rate or check the data")
                    # the micro-batch's share of the mean over every process's batch (/ total); x accumulation
                    # steps x processes undoes accelerate's and DDP's averaging
                    scale = accelerator.gradient_accumulation_steps * accelerator.num_processes / max(total, 1.0)
                    accelerator.backward(loss_sum * scale)
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                        if not run.all_finite(grad_norm):  # before the optimizer writes it into the weights
                            run.fail(f"non-finite gradient norm at step {step + 1}: lower --learning-rate")
                    optimizer.step()
                    optimizer.zero_grad()
                running.append(loss_sum.detach() / max(total, 1.0))  # summed over micro-batches and processes: the mean
            n_micro, n_steps = n_micro + len(micro), n_steps + 1
            scheduler.step()
            step += 1
            progress.update(1)

            # ---- 6. log, evaluate, checkpoint
            if step % args.log_every == 0 or step == total_steps:
                now = time.time()
                speed = batch_episodes * n_micro / args.gradient_accumulation_steps / (now - t_last)
                lr = scheduler.get_last_lr()[0]
                logged = training_metrics(accelerator, running, n_steps, {}, lr, epoch, speed, grad_norm)
                run.log(logged, step, episode)
                progress.set_postfix(loss=f"{logged['train/loss']:.3f}")
                running, n_micro, n_steps, t_last = [], 0, 0, now
            if step % args.eval_every == 0 or step == total_steps:
                metrics, records = evaluate_sft(
                    model, tokenizer, evals, args, accelerator, sft_loss, collate_right_padded, truncate_after_eos
                )
                model.train()  # evaluation leaves it in eval mode
                run.log(metrics, step, episode)
                accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                run.log_samples(records[:8], step)
                t_last = time.time()
            if run.stop_requested():
                run.stop(loop_now())
            if run.checkpoint_due(step, total_steps):
                run.checkpoint(loop_now())
    progress.close()

    # ---- 7. model/ (LoRA merged), done.json
    budget = {"step": step, "episode": episode, "total_steps": total_steps}
    run.finish(model, tokenizer, {**budget, "total_episodes": len(loader) * micro_rows * args.num_train_epochs})
    accelerator.end_training()
    return metrics


# --------------------------------------------------------------------------------------------------
# The smaller pieces of the algorithm that main calls: the response-token labels and their count, dropout off, the
# schedule, the micro-batches of a step, and where a greedy evaluation sample ends
# --------------------------------------------------------------------------------------------------


def collate_right_padded(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """prompt + response, right-padded; labels are -100 on the prompt and on padding: the response tokens and EOS are
    the tokens that count."""
    seqs = [e["prompt_ids"] + e["response_ids"] for e in examples]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        labels[i, len(e["prompt_ids"]) : len(s)] = torch.tensor(e["response_ids"])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def response_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens `sft_loss` counts in a collated batch: those with a label (response tokens and EOS)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def disable_dropout(*models) -> None:
    """N+: every dropout off in each model (None: no model), so that sampling, the reference, the update and evaluation
    all see the same deterministic model: `nn.Dropout` modules (p = 0) and the dropout a module keeps as a float, read
    in train mode (GPT-NeoX's and Llama's `attention_dropout` on their attention modules). The config is left as loaded:
    it is saved with the model. `main` calls it on every model it loads."""
    for module in (m for model in models if model is not None for m in model.modules()):
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress if schedule == "linear" else 1.0

    return f


def step_micro_batches(loader: Iterable, gradient_accumulation_steps: int) -> Iterator[list]:
    """One pass over `loader` as the micro-batches of each optimizer step: `gradient_accumulation_steps` of them, the
    last step shorter when the loader's length is no multiple of that (a real epoch ends there). A step's micro-batches
    are drawn before its first backward pass, so its loss can be averaged over all of them."""
    batches = iter(loader)
    while micro := list(itertools.islice(batches, gradient_accumulation_steps)):
        yield micro


def truncate_after_eos(tokens: torch.Tensor, eos_id: int, pad_id: int) -> torch.Tensor:
    """Keep each row up to and including its first EOS; everything after becomes pad."""
    is_eos = tokens == eos_id
    after_first_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return tokens.masked_fill(after_first_eos, pad_id)


# --------------------------------------------------------------------------------------------------
# Plumbing: what is specific to this script (the rest is in clean_rlhf_utils/)
# --------------------------------------------------------------------------------------------------


if __name__ == "__main__":
    main(cli(PRESETS))
