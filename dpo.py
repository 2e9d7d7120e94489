"""Direct Preference Optimization, offline on a preference dataset and online (optionally asynchronous).

Offline (`--mode offline`): "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
(Rafailov et al. 2023, arXiv:2305.18290) on (prompt, chosen, rejected) pairs, as run on TL;DR in "The N+
Implementation Details of RLHF with PPO" (Huang et al. 2024, arXiv:2403.17031; beta 0.05, lr 3e-6, cosine,
batch 64, one epoch over the 92,832 OpenAI preference pairs).
  * The sequence logprob log pi(y|x) is the sum of the response tokens' logprobs (EOS included) of the
    right-padded prompt + response + EOS, with position ids from the attention mask, so the side of the
    padding never changes it (tests check left against right padding). The forward passes run on packed pairs
    (`--pack-pairs`, default; `pack_pairs`): no padding, and the prefix shared by chosen and rejected (the prompt)
    computed once, the rest of rejected masked off from the rest of chosen; the logprobs equal the padded batch's.
  * The implicit reward is r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x)); with h = the chosen-minus-rejected
    difference of log pi - log pi_ref, the losses (`--loss-type`) are
      sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (DPO; eps = label smoothing is
               conservative DPO, Mitchell 2023, "A note on DPO with noisy preferences")
      ipo:     (h - 1 / (2 beta))^2   (Azar et al. 2023, arXiv:2310.12036); by default (`--ipo-average`) h is taken
               on per-token averaged logprobs (sum / response tokens, policy and reference alike), as TRL does and as
               the IPO authors confirmed produced the paper's results; `--no-ipo-average` takes it on summed logprobs
               (beta does not carry over between the two)
      hinge:   max(0, 1 - beta h)     (SLiC, Zhao et al. 2023, arXiv:2305.10425)
    The loss of an optimizer step is the mean over the pairs of its whole batch (every micro-batch of the gradient
    accumulation, every process; online: the untied pairs), so the gradient does not depend on how the batch is split.
  * The reference logprobs of the frozen SFT model are computed once before training and cached with the
    pairs (`--precompute-ref-logprobs`, default), so the reference model is not in memory while training.
  * Implicit reward accuracy counts a pair as 1 when r_chosen > r_rejected, 0 when smaller and 1/2 on an
    exact tie (as the win rate does): at initialisation policy = reference, every pair ties and the accuracy
    is 0.5, not 0 (TRL counts ties as wrong and reports 0).

Online (`--mode online`): online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI
Feedback", arXiv:2402.04792), the RLHF algorithm "Asynchronous RLHF" (Noukhovitch et al. 2024, arXiv:2410.18252)
found most robust to off-policy data. Each step samples two responses per prompt from the current policy
(temperature 0.7, truncated after the first EOS; a response without EOS gets `penalty_reward_value`, N+),
labels them with the reward model or the tiny world's gold judge (`--judge rm|gold`), and takes a DPO step
on (higher, lower); tied pairs carry no preference and are left out of the loss (`objective/tie_rate`), whose mean
is over the untied pairs of the whole batch (their number differs between micro-batches and processes).
With `--async`, generation of batch t+1 runs in a separate thread with its own copy of the policy while the
learner trains on batch t (Noukhovitch et al.'s one-step off-policy "Cleanba" setup): the copy is synced
after every step, so every batch after the first was sampled by the policy of one step earlier
(`async/policy_lag` = 1). On CPU the torch threads are split between learner and generator (`num_threads`
and `generation_threads`). Only the generator thread draws random numbers, one batch after another, so on CPU an
async run repeats exactly (checked with 1 + 1 and 3 + 1 threads; not checked on a GPU).

`--lora-r` trains LoRA adapters (Hu et al. 2021, arXiv:2106.09685) through peft; the reference is then the policy with
its adapters disabled (no second copy; with --async, the generator thread's copy), and `model/` the merged plain model.

Durable runs (`Run`; tests/test_faults_dpo.py): SIGTERM / SIGINT finish the step, write checkpoint/ and exit; the same
command with `--resume` continues to the metrics and weights of an uninterrupted run, exactly in every mode (checked
on CPU in float32). The batches drawn so far are replayed from the loader's own generator (no compute); offline,
the cached reference logprobs are computed again (the same frozen model, batches and precision: the same values).
Online, a checkpoint holds the batch already sampled for the next step (async: sampled by the weights of the step
before; a checkpoint waits for it), with its labels and reference logprobs, and the resumed run trains on it, so the
weights it was sampled by need not be kept. A non-finite loss or gradient norm writes a checkpoint of the step before
and stops.

Usage:
    python dpo.py tiny-tldr                   # after `python -m benchmark.run tiny-tldr` (SFT and RM)
    python dpo.py tiny-tldr-online --judge gold --async
    accelerate launch --config_file benchmark/accelerate_configs/deepspeed_zero2.yaml dpo.py tldr-pythia-1b
"""

from __future__ import annotations

import copy
import math
import os
import re
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from clean_rlhf_utils.args import DataArgs, LoraArgs, ModelArgs, OptimArgs, RunArgs
from clean_rlhf_utils.data import chat_messages, end_with_eos, left_pad, template_fields, whole_field_messages
from clean_rlhf_utils.engines import (
    LoraReference,
    add_lora,
    backward_share,
    configure_deepspeed,
    cpu_threads,
    global_count,
    make_accelerator,
    peak_mem_gb,
    prepare_frozen,
    shard_length,
    zero3,
)
from clean_rlhf_utils.loading import ensure_pad_token, load_split, require_hub
from clean_rlhf_utils.runs import Run, check_args


@dataclass
class Args(OptimArgs, DataArgs, LoraArgs, ModelArgs, RunArgs):
    # shared flags: clean_rlhf_utils/args.py (a shared flag redeclared here has this script's default or docstring)
    # ---- experiment ----
    exp_name: str = "dpo"
    """name of this experiment; the run name starts with it"""
    save_every: int = 0
    """write a checkpoint every N optimizer steps; 0: only when stopped (SIGTERM, SIGINT, a non-finite loss)"""

    # ---- models ----
    sft_model_path: str = "vwxyzjn/EleutherAI_pythia-1b-deduped__sft__tldr"
    """the SFT model: initial policy and frozen reference (hub name or local directory)"""
    reward_model_path: str | None = None
    """reward model (reward_model.py format): labels online pairs with `judge=rm`; if set, evaluation logs its score"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the models"""

    # ---- data ----
    mode: Literal["offline", "online"] = "offline"
    """`offline`: DPO on the preference pairs; `online`: sample pairs from the policy and label them each step"""
    dataset_name_or_path: str = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"
    """preference pairs (offline training; validation pairs for the implicit-reward accuracy in both modes):
    hub name, `save_to_disk` folder, folder of `{split}.jsonl|json|parquet`, or one such file"""
    prompt_dataset_name_or_path: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """prompts with reference responses: online training prompts and the evaluation prompts of both modes"""
    dataset_config: str | None = None
    """dataset configuration name on the hub"""
    train_split: str = "train"
    """split to train on (pairs offline, prompts online)"""
    eval_split: str = "validation"
    """split to evaluate on (pairs and prompts)"""
    chosen_field: str = "chosen"
    """field of the preferred response"""
    rejected_field: str = "rejected"
    """field of the dispreferred response"""
    reference_template: str = "{reference_response}"
    """format string of the reference response of a prompt row (the tiny-tldr win rate compares against it)"""
    max_prompt_length: int = 512
    """longest prompt in tokens (N+: 512); longer is an error unless `drop_overlong`"""
    max_response_length: int = 170
    """longest preference response in tokens, EOS included (the N+ TL;DR pairs: at most 169 tokens)"""
    drop_overlong: bool = False
    """drop (and count) overlong rows instead of failing"""
    max_train_samples: int | None = None
    """use only the first N training rows (pairs offline, prompts online; debugging)"""

    # ---- DPO ----
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """`sigmoid` (DPO, with label smoothing = cDPO), `ipo` (Azar et al. 2023), `hinge` (SLiC)"""
    ipo_average: bool = True
    """(ipo) the log-ratios on per-token averaged logprobs (TRL; what the IPO results used) or, False, on summed
    logprobs; beta does not carry over between the two"""
    beta: float = 0.05
    """KL strength beta (N+ TL;DR DPO: 0.05)"""
    label_smoothing: float = 0.0
    """(sigmoid) probability eps that a preference label is flipped (conservative DPO); 0 is plain DPO"""
    precompute_ref_logprobs: bool = True
    """(offline) compute the reference logprobs of every pair once before training; else on the fly each step"""
    pack_pairs: bool = True
    """run the logprob forward passes on packed pairs: no padding, and the prefix the chosen and rejected sequences
    share (the prompt) computed once; the logprobs equal the padded batch's. False: the right-padded batch"""

    # ---- online ----
    judge: Literal["rm", "gold"] = "rm"
    """(online) who labels the two samples: the reward model, or the tiny world's gold judge (needs `facts`)"""
    total_episodes: int = 131072
    """(online) prompts (= sampled pairs) over the whole run, all processes"""
    response_length: int = 53
    """tokens sampled per response, online and at evaluation (N+: 53)"""
    temperature: float = 0.7
    """(online) sampling temperature (N+: 0.7); DPO logprobs are at temperature 1"""
    non_eos_penalty: bool = True
    """(online) replace the score of a response without EOS by `penalty_reward_value` (N+)"""
    penalty_reward_value: float = -1.0
    """(online) score of a response that never ends (N+: -1)"""
    async_generation: Annotated[bool, tyro.conf.arg(name="async")] = False
    """(online) generate the next batch in a separate thread while training on this one (one step off-policy)"""
    generation_threads: int | None = None
    """(online, async, CPU) torch threads of the generator thread; default half of `num_threads` (at least 1)"""

    # ---- optimisation ----
    learning_rate: float = 3e-6
    """peak learning rate (N+ DPO: 3e-6)"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """decay after warm-up (N+ DPO: cosine)"""
    warmup_ratio: float = 0.0
    """share of the optimizer steps spent warming the learning rate up linearly from 0"""
    num_train_epochs: int = 1
    """(offline) passes over the preference pairs (N+: 1)"""
    per_device_train_batch_size: int = 8
    """pairs per device per micro-batch (online: prompts per micro-batch, two samples each)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step; the global batch is this x per-device batch x processes"""

    # ---- evaluation and logging ----
    eval_task: Literal["none", "tldr"] = "none"
    """`tldr`: greedy summaries scored by the tiny world's gold judge, and win rate against the references"""
    eval_every: int = 100
    """evaluate every N optimizer steps (and before the first and after the last)"""
    num_eval_examples: int = 200
    """evaluation prompts (greedy generation); 0 skips generation"""
    eval_kl: bool = False
    """also log `eval/kl`, KL(pi || pi_ref) of one response sampled at temperature 1 per evaluation prompt (the same
    estimator in every script: the benchmark's frontier plots gold reward against it); one more generation per eval"""
    num_eval_pairs: int = 400
    """validation pairs for the implicit-reward accuracy and loss; 0 skips them"""
    per_device_eval_batch_size: int = 32
    """prompts or pairs per device at evaluation"""
    log_every: int = 1
    """log training metrics every N optimizer steps"""


# The real presets load float32 weights and get bf16 from the accelerate config's mixed precision (DeepSpeed: bf16
# compute, fp32 master weights; DDP: autocast), as N+ and TRL do. Lengths: the N+ TL;DR pairs have queries of at most
# 512 tokens and responses of at most 169 tokens with their EOS (the text ends with `<|endoftext|>`; shared/real-assets
# README), so max_prompt_length 512 and max_response_length 170 keep every pair. Batch: 64 pairs per optimizer step,
# N+ dpo.py's default (8 GPUs x local_micro_batch_size 1 x gradient_accumulation_steps 8, the same for every model size:
# its sbatches/dpo.sbatch passes no batch flag), split per device as N+ scales PPO and reward_model.py does: half the
# micro-batch and twice the accumulation per size step. They checkpoint ten times a run (`save_every`; their step times
# are not measured here): offline 92,832 pairs / 64 = 1,450 steps, online 131,072 episodes / 512 = 256 steps.
PRESETS = {
    "tldr-pythia-1b": (
        "N+ offline DPO on TL;DR preferences, Pythia 1B (8 GPUs; beta 0.05, lr 3e-6, batch 64)",
        Args(
            exp_name="dpo_tldr_pythia-1b",
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            eval_every=200,
            save_every=145,
        ),
    ),
    "tldr-pythia-2.8b": (
        "N+ offline DPO on TL;DR preferences, Pythia 2.8B (8 GPUs; batch 64)",
        Args(
            exp_name="dpo_tldr_pythia-2.8b",
            sft_model_path="vwxyzjn/EleutherAI_pythia-2.8b-deduped__sft__tldr",
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            eval_every=200,
            save_every=145,
        ),
    ),
    "tldr-pythia-6.9b": (
        "N+ offline DPO on TL;DR preferences, Pythia 6.9B (8 GPUs, DeepSpeed ZeRO-2; batch 64)",
        Args(
            exp_name="dpo_tldr_pythia-6.9b",
            sft_model_path="vwxyzjn/EleutherAI_pythia-6.9b-deduped__sft__tldr",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            eval_every=200,
            save_every=145,
        ),
    ),
    # online: N+ beta / lr / temperature / response length / EOS penalty; batch 512 pairs x 256 steps is our choice
    "tldr-pythia-1b-online": (
        "online DPO on TL;DR prompts labelled by the N+ reward model, Pythia 1B (8 GPUs)",
        Args(
            exp_name="online_dpo_tldr_pythia-1b",
            mode="online",
            reward_model_path="vwxyzjn/EleutherAI_pythia-1b-deduped__reward__tldr",
            per_device_train_batch_size=16,
            gradient_accumulation_steps=4,
            total_episodes=131072,
            eval_every=50,
            save_every=25,
        ),
    ),
    "tiny-tldr": (
        "tiny-tldr offline DPO on CPU (needs `python -m benchmark.run tiny-tldr` first)",
        Args(
            exp_name="dpo_tiny-tldr",
            sft_model_path="runs/sft_tiny-tldr__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr/preference",
            prompt_dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            max_response_length=48,
            response_length=32,
            beta=0.1,
            learning_rate=1e-5,
            warmup_ratio=0.05,
            per_device_train_batch_size=32,
            eval_task="tldr",
            eval_every=50,
            num_eval_examples=200,
            log_every=5,
        ),
    ),
    "tiny-tldr-noisy": (
        "tiny-tldr-noisy (`python -m benchmark.run frontier-tldr`): offline DPO on the noisy pairs",
        Args(
            exp_name="dpo_tiny-tldr-noisy",
            sft_model_path="runs/sft_tiny-tldr__1/model",
            reward_model_path="runs/rm_tiny-tldr-noisy__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr-noisy/preference",
            prompt_dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            max_response_length=48,
            response_length=32,
            beta=0.1,
            learning_rate=5e-5,  # 1e-5 (tiny-tldr) barely moves the policy on 1,000 pairs
            warmup_ratio=0.05,
            num_train_epochs=3,
            per_device_train_batch_size=32,
            eval_task="tldr",
            eval_every=12,
            num_eval_examples=200,
            eval_kl=True,
            log_every=5,
        ),
    ),
    "tiny-tldr-noisy-online": (
        "tiny-tldr-noisy (`python -m benchmark.run frontier-tldr`): online DPO labelled by the noisy RM",
        Args(
            exp_name="online_dpo_tiny-tldr-noisy",
            mode="online",
            sft_model_path="runs/sft_tiny-tldr__1/model",
            reward_model_path="runs/rm_tiny-tldr-noisy__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr-noisy/preference",
            prompt_dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            max_response_length=48,
            response_length=32,
            beta=0.1,
            learning_rate=1e-5,
            total_episodes=2048,
            per_device_train_batch_size=32,
            lr_schedule="linear",
            eval_task="tldr",
            eval_every=8,
            num_eval_examples=200,
            num_eval_pairs=200,
            eval_kl=True,
        ),
    ),
    "tiny-tldr-online": (
        "tiny-tldr online DPO on CPU, labelled by the tiny reward model (`--judge gold` for the gold judge)",
        Args(
            exp_name="online_dpo_tiny-tldr",
            mode="online",
            sft_model_path="runs/sft_tiny-tldr__1/model",
            reward_model_path="runs/rm_tiny-tldr__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr/preference",
            prompt_dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            max_response_length=48,
            response_length=32,
            beta=0.1,
            learning_rate=1e-5,
            total_episodes=2048,
            per_device_train_batch_size=32,
            lr_schedule="linear",
            eval_task="tldr",
            eval_every=16,
            num_eval_examples=200,
            num_eval_pairs=200,
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# The DPO math: small pure functions, each checked against hand-computed values in tests/test_dpo.py
# --------------------------------------------------------------------------------------------------


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses (B,) and the implicit rewards beta * (log pi - log pi_ref) of chosen and rejected.
    h = (log pi_c - log pi_r) - (log ref_c - log ref_r) is the policy's log-ratio margin over the reference."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        # cDPO: the label is right with probability 1 - eps, so the loss is the expected BCE under flipped labels
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses, beta * (policy_chosen - ref_chosen).detach(), beta * (policy_rejected - ref_rejected).detach()


def implicit_accuracy(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Per pair: 1 if the implicit reward ranks the chosen response higher, 0 if lower, 1/2 on an exact tie
    (policy = reference gives ties everywhere, so the accuracy at initialisation is 0.5)."""
    return (chosen_rewards > rejected_rewards).float() + 0.5 * (chosen_rewards == rejected_rewards).float()


def sequence_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum over the response tokens (loss_mask = 1) of log p(token | prefix): logits at t predict token t+1."""
    logps = torch.gather(logits[:, :-1].float().log_softmax(-1), 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (logps * loss_mask[:, 1:]).sum(-1)


def response_lengths(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Response tokens (EOS included) of each chosen and of each rejected sequence of a pair batch, padded or packed:
    the tokens `forward_logprobs` sums over."""
    mask = batch["mask"] if "allowed" in batch else batch["loss_mask"][:, 1:]
    return mask.sum(-1).float().chunk(2)


def pair_weights(batch: dict) -> torch.Tensor:
    """1 for each pair of the batch that enters the loss; 0 for a tied online pair (`valid` False: no preference)."""
    if "valid" in batch:
        return batch["valid"].float()
    return torch.ones_like(response_lengths(batch)[0])


def pair_losses(
    batch: dict,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    args: Args,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dpo_loss` of the summed sequence logprobs of `batch`'s pairs; for IPO with `ipo_average` every logprob, policy
    and reference (cached or not) alike, is first divided by its response's token count (TRL's per-token average)."""
    if args.loss_type == "ipo" and args.ipo_average:
        len_c, len_r = response_lengths(batch)
        chosen, rejected = chosen / len_c, rejected / len_r
        ref_chosen, ref_rejected = ref_chosen / len_c, ref_rejected / len_r
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta, args.loss_type, args.label_smoothing)


def micro_batch_loss(policy, ref_policy, batch: dict, args: Args, autocast=nullcontext) -> tuple[torch.Tensor, dict]:
    """One micro-batch of `main`'s DPO update: the losses of its pairs summed over the pairs that count (`pair_weights`;
    `main` divides by their number in the whole batch, `global_count`, in `backward_share`), and detached statistics:
    implicit rewards and the summed sequence logprobs. The reference logprobs come cached with the pairs or from
    `ref_policy` (under `autocast`, the training precision)."""
    chosen, rejected = forward_logprobs(policy, batch)
    if "ref_chosen" in batch:
        ref_c, ref_r = batch["ref_chosen"], batch["ref_rejected"]
    else:
        with torch.no_grad(), autocast():
            ref_c, ref_r = forward_logprobs(ref_policy, batch)
    losses, r_c, r_r = pair_losses(batch, chosen, rejected, ref_c, ref_r, args)
    stats = {
        "r_chosen": r_c,
        "r_rejected": r_r,
        "chosen": chosen.detach(),
        "rejected": rejected.detach(),
        "ref_chosen": ref_c,
        "ref_rejected": ref_r,
    }
    return (losses * pair_weights(batch)).sum(), stats


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress if schedule == "linear" else 1.0

    return f


# --------------------------------------------------------------------------------------------------
# main: the training loop, as numbered steps
# --------------------------------------------------------------------------------------------------


def main(args: Args) -> dict:
    # the batches come from an endless `while True: yield from loader`: the loader's end is no optimizer-step boundary
    accelerator = make_accelerator(args.gradient_accumulation_steps, sync_with_dataloader=False)
    threads = args.num_threads or cpu_threads(accelerator.num_processes)
    gen_threads = None
    if accelerator.device.type == "cpu":  # one BLAS pool per process, or the processes fight over cores
        if args.mode == "online" and args.async_generation:  # learner and generator thread split the process's share
            gen_threads = args.generation_threads or max(1, threads // 2)
            threads = max(1, threads - gen_threads)
        torch.set_num_threads(threads)
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}"
    check_dpo_args(args)
    run = Run(args, accelerator, PRESETS)  # refuses a used run directory now, before anything loads
    set_seed(args.seed)
    device = accelerator.device
    online = args.mode == "online"
    synced = zero3(accelerator)  # every forward pass is a collective: `generate` must step until every process is done
    if online and args.async_generation and synced:
        raise SystemExit(
            "error: --async copies the policy's weights into a generator thread, but ZeRO-3 shards them "
            "across processes; run online DPO under ZeRO-3 without --async (or use DDP or ZeRO-2)"
        )

    # ---- models: the policy (trained), the reference and the reward model (frozen) ----
    tokenizer = load_tokenizer(args)
    policy = load_pretrained(AutoModelForCausalLM, args.sft_model_path, args, "policy", "--sft-model-path")
    if tokenizer.pad_token_id >= policy.config.vocab_size:  # padding goes through the embedding: it needs a row
        raise SystemExit(
            f"error: the pad token id {tokenizer.pad_token_id} is past the embedding of "
            f"{args.sft_model_path} ({policy.config.vocab_size} rows); add the pad token at the SFT stage "
            "(sft.py --add-pad-token)"
        )
    ref_policy = None  # with LoRA: the policy with its adapters disabled (after `prepare`), not a second copy
    if not args.lora_r:
        ref_policy = load_pretrained(AutoModelForCausalLM, args.sft_model_path, args, "reference", "--sft-model-path")
        ref_policy = ref_policy.eval().requires_grad_(False)
    if args.pack_pairs and policy.config._attn_implementation not in ("eager", "sdpa"):
        raise SystemExit(
            f"error: --pack-pairs hands the attention a 4D mask, which {policy.config._attn_implementation} attention "
            "does not "
            "take; pass --no-pack-pairs (or use sdpa / eager attention)"
        )
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy = add_lora(policy, args)
    reward_model = None
    if args.reward_model_path and (args.judge == "rm" or not online):
        reward_model = load_reward_model(args, tokenizer)

    # ---- data: every field training and evaluation use is checked now, before the first update ----
    pad, positions = tokenizer.pad_token_id, model_positions(policy)
    eval_rows = []
    if args.num_eval_examples > 0:
        eval_ds = load_split(
            args.prompt_dataset_name_or_path, args.eval_split, args.dataset_config, "--prompt-dataset-name-or-path"
        )
        eval_rows = prepare_prompts(
            eval_ds.select(range(min(args.num_eval_examples, len(eval_ds)))),
            tokenizer,
            args,
            args.eval_split,
            positions,
            evaluation=True,
        )
    eval_pairs = []
    if args.num_eval_pairs > 0:
        ds = load_split(args.dataset_name_or_path, args.eval_split, args.dataset_config)
        eval_pairs = tokenize_pairs(
            ds.select(range(min(args.num_eval_pairs, len(ds)))), tokenizer, args, args.eval_split, positions
        )
    if online:
        ds = load_split(
            args.prompt_dataset_name_or_path, args.train_split, args.dataset_config, "--prompt-dataset-name-or-path"
        )
    else:
        ds = load_split(args.dataset_name_or_path, args.train_split, args.dataset_config)
    if args.max_train_samples:
        ds = ds.select(range(min(args.max_train_samples, len(ds))))
    if online:
        train = prepare_prompts(ds, tokenizer, args, args.train_split, positions, evaluation=False)
    else:
        train = tokenize_pairs(ds, tokenizer, args, args.train_split, positions)

    # ---- batch arithmetic and optimiser ----
    step_pairs = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps
    )  # pairs per process per optimizer step
    batch_pairs = step_pairs * accelerator.num_processes
    generator = torch.Generator().manual_seed(args.seed)  # same shuffle on every process; accelerate shards it
    if online:  # one item per optimizer step: the prompts of a whole step, generated together
        loader = torch.utils.data.DataLoader(
            list(range(len(train))), batch_size=step_pairs, shuffle=True, drop_last=True, generator=generator
        )
    else:
        loader = torch.utils.data.DataLoader(
            train,
            batch_size=args.per_device_train_batch_size,
            shuffle=True,
            drop_last=True,
            generator=generator,
            collate_fn=lambda b: collate_pairs(b, pad, args.pack_pairs),
        )
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=args.adam_eps)
    configure_deepspeed(accelerator, args.per_device_train_batch_size, args.max_grad_norm)  # pairs per backward pass
    policy, optimizer, loader = accelerator.prepare(policy, optimizer, loader)
    # offline: epochs over the pairs (the prepared loader is this process's shard); online: episodes = sampled pairs
    if online:
        total_steps = args.total_episodes // batch_pairs
    else:
        total_steps = len(loader) // args.gradient_accumulation_steps * args.num_train_epochs
    if online and len(loader) == 0:  # the endless loader below would never yield a batch
        raise SystemExit(
            f"error: split '{args.train_split}' of --prompt-dataset-name-or-path has {len(train)} usable "
            f"prompts, fewer than one step's {batch_pairs} (--per-device-train-batch-size x "
            "--gradient-accumulation-steps x processes)"
        )
    if total_steps == 0:
        raise SystemExit(f"error: the data makes no full batch of {batch_pairs} pairs (online: raise --total-episodes)")
    ref_policy, reward_model = prepare_frozen(ref_policy, accelerator), prepare_frozen(reward_model, accelerator)
    if args.lora_r:  # the unwrapped policy itself, its adapters disabled for each reference forward pass
        ref_policy = LoraReference(accelerator.unwrap_model(policy))
    if not online and args.precompute_ref_logprobs:  # the loader's collate reads the cached values from the pairs
        # on --resume they are computed again, to the same values (the same frozen model, batches and precision)
        t0 = time.time()
        cache_ref_logprobs(ref_policy, train, pad, args, accelerator)
        cache_ref_logprobs(ref_policy, eval_pairs, pad, args, accelerator)
        n = len(train) + len(eval_pairs)
        accelerator.print(f"cached reference logprobs of {n} pairs in {time.time() - t0:.1f}s")
        if not args.eval_kl:  # every pair now carries its reference logprobs: free the model
            ref_policy = None
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.lr_schedule, int(args.warmup_ratio * total_steps), total_steps)
    )
    accelerator.register_for_checkpointing(scheduler)  # saved and restored with the checkpoint
    unwrapped = accelerator.unwrap_model(policy)
    run.begin()
    accelerator.print(
        f"run {args.run_name}: {args.mode} DPO ({args.loss_type}, beta {args.beta}), {total_steps} steps of "
        f"{batch_pairs} pairs"
        + (
            f", async generation ({gen_threads or 'default'} generator threads, {threads} learner threads)"
            if online and args.async_generation
            else ""
        )
    )

    def run_eval(step: int) -> dict:
        metrics = {}
        if eval_pairs:
            metrics.update(evaluate_pairs(unwrapped, ref_policy, eval_pairs, pad, args, accelerator))
        if eval_rows:
            gen_metrics, records = evaluate(
                unwrapped, reward_model, tokenizer, eval_rows, args, accelerator, ref_policy
            )
            metrics.update(gen_metrics)
            run.log_samples(records[:8], step)
        if metrics:  # --num-eval-pairs 0 and --num-eval-examples 0: nothing evaluated, nothing logged
            run.log(metrics, step, step * batch_pairs)
            accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics

    def batches():
        while True:
            yield from loader

    def draw():  # the next batch of the endless loader (online: prompt indices), counted for the replay on resume
        nonlocal drawn
        drawn += 1
        return next(iterator)

    def loop_state(step: int, n_drawn: int, pending: dict | None) -> dict:
        """The loop's state after `step` optimizer steps: the batches drawn so far (replayed on resume), the last
        evaluation, and online the batch already sampled for the next step (`pending`, every process's own, with its
        labels and reference logprobs), which the resumed run trains on as the uninterrupted run would."""
        return {
            "step": step,
            "episode": step * batch_pairs,
            "drawn": n_drawn,
            "metrics": metrics,
            "pending": gather_object([portable(pending)]) if online else None,
        }

    def failed(step: int, data: dict | None, what: str) -> None:
        """A non-finite value in step `step`: a checkpoint of the state before it (online: with its batch), and out."""
        if executor and pending is not None:
            pending.result()  # the generator thread has drawn and is sampling the next batch: let it finish
        # not replayed: offline this step's micro-batches; async the next step's prompts, drawn already
        ahead = int(executor is not None and pending is not None)
        before = drawn - (ahead if online else args.gradient_accumulation_steps)
        run.stop(
            loop_state(step - 1, before, data),
            f"non-finite {what} at step {step}: lower --learning-rate (now {args.learning_rate:g}) or check the data",
        )

    iterator, drawn, start, pending = batches(), 0, 0, None
    if state := run.resume():  # weights, optimizer, scheduler and every process's RNG; the loop's counters below
        start, metrics = state["step"], state["metrics"]
        for _ in range(state["drawn"]):  # the batches the finished steps drew (the loader's own generator, no compute)
            draw()
        if online and state["pending"][accelerator.process_index] is not None:
            pending = restored(state["pending"][accelerator.process_index], device)
    else:
        metrics = run_eval(0)
    gen_policy, executor, rows_of = unwrapped, None, None
    if online:
        rows_of = lambda idx: [train[i] for i in idx.tolist()]  # noqa: E731
        if args.async_generation:  # the generator samples with its own copy of the weights, synced after each step
            gen_policy = copy.deepcopy(unwrapped).eval().requires_grad_(False)
            # LoRA: the thread's reference is its copy with the adapters disabled; disabling the learner's adapters
            # from the thread would switch them off under the learner's own forward pass
            gen_ref = LoraReference(gen_policy) if args.lora_r else ref_policy
            executor = ThreadPoolExecutor(max_workers=1)
            if pending is None:  # the first batch, sampled by the initial policy
                pending = executor.submit(
                    sample_pairs,
                    gen_policy,
                    gen_ref,
                    reward_model,
                    tokenizer,
                    rows_of(draw()),
                    args,
                    device,
                    0,
                    gen_threads,
                    synced,
                    accelerator.autocast,
                )
            else:  # a resumed run: the batch sampled before the checkpoint
                pending = done_future(pending)

    start_time, episode, grad_norm = time.time(), start * batch_pairs, None
    progress = tqdm(
        range(start + 1, total_steps + 1),
        initial=start,
        total=total_steps,
        disable=not accelerator.is_main_process,
        desc=f"{args.mode} dpo",
    )
    for step in progress:
        wait_start = time.time()
        stats, data = {}, None
        if online:
            if executor:
                data = pending.result()
                wait = time.time() - wait_start
                pending = None
                if step < total_steps:  # the generator's copy synced to the current weights (step - 1) samples the next
                    gen_policy.load_state_dict(unwrapped.state_dict())
                    pending = executor.submit(
                        sample_pairs,
                        gen_policy,
                        gen_ref,
                        reward_model,
                        tokenizer,
                        rows_of(draw()),
                        args,
                        device,
                        step - 1,
                        gen_threads,
                        synced,
                        accelerator.autocast,
                    )
            else:  # synchronous: this step's batch, sampled now by the current weights (or restored by --resume)
                data = (
                    pending
                    if pending is not None
                    else sample_pairs(
                        gen_policy,
                        ref_policy,
                        reward_model,
                        tokenizer,
                        rows_of(draw()),
                        args,
                        device,
                        step - 1,
                        gen_threads,
                        synced,
                        accelerator.autocast,
                    )
                )
                pending, wait = None, time.time() - wait_start
            micro = []
            n_pairs = len(data["pairs"])
            for i in range(args.gradient_accumulation_steps):
                sel = list(range(i, n_pairs, args.gradient_accumulation_steps))
                mb = {
                    k: v.to(device)
                    for k, v in collate_pairs([data["pairs"][j] for j in sel], pad, args.pack_pairs).items()
                }
                mb["valid"] = data["valid"][sel]
                micro.append(mb)
            stats = {k: float(v) for k, v in data["stats"].items()}
            stats.update(
                {
                    "async/policy_lag": (step - 1) - data["version"],
                    "perf/generation_wait_sec": wait,
                    "perf/generation_sec": data["gen_time"],
                }
            )
        else:
            micro = [draw() for _ in range(args.gradient_accumulation_steps)]

        # ---- DPO update: the mean over the (untied) pairs of the whole batch, all micro-batches and processes ----
        train_start, running = time.time(), []
        total = global_count(sum(pair_weights(mb).sum().item() for mb in micro), accelerator)
        share = accelerator.gradient_accumulation_steps * accelerator.num_processes / max(total, 1.0)
        for mb in micro:
            with accelerator.accumulate(policy):
                loss_sum, out = micro_batch_loss(policy, ref_policy, mb, args, accelerator.autocast)
                if not run.all_finite(loss_sum):
                    failed(step, data, "DPO loss")
                backward_share(accelerator, loss_sum, total)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                    if not run.all_finite(grad_norm):  # before the optimizer writes it into the weights
                        failed(step, data, "gradient norm")
                optimizer.step()
                optimizer.zero_grad()
            r_c, r_r, chosen, rejected = out["r_chosen"], out["r_rejected"], out["chosen"], out["rejected"]
            # loss_sum * share, averaged over the micro-batches and processes below, is the batch mean of the gradient
            running.append(
                {
                    "train/loss": loss_sum.detach() * share,
                    "rewards/chosen": r_c.mean(),
                    "rewards/rejected": r_r.mean(),
                    "rewards/accuracies": implicit_accuracy(r_c, r_r).mean(),
                    "rewards/margins": (r_c - r_r).mean(),
                    "logps/chosen": chosen.mean(),
                    "logps/rejected": rejected.mean(),
                    # online: the mean of log pi - log pi_ref over the sampled responses (k1, per response)
                    "objective/kl": ((chosen - out["ref_chosen"]) + (rejected - out["ref_rejected"])).mean() / 2,
                }
            )
        scheduler.step()
        train_sec = time.time() - train_start  # the update only (not the sampling)
        episode = step * batch_pairs

        # ---- logging ----
        if step % args.log_every == 0 or step == total_steps:
            names = list(running[0])  # every process's micro-batch means, by name, averaged over all of them
            means = torch.stack([torch.stack([r[k] for k in names]) for r in running]).mean(0)
            logged = dict(zip(names, accelerator.gather(means[None]).mean(0).tolist()))
            if online:
                logged.update(stats)
            else:
                del logged["objective/kl"]  # offline pairs are not the policy's samples
            logged.update(
                {
                    "train/grad_norm": float("nan") if grad_norm is None else float(grad_norm),  # DeepSpeed
                    "lr": scheduler.get_last_lr()[0],
                    "perf/train_sec": train_sec,
                    "perf/episodes_per_sec": (episode - start * batch_pairs) / (time.time() - start_time),
                    "perf/peak_mem_gb": peak_mem_gb(device),
                }
            )
            run.log(logged, step, episode)
            progress.set_postfix(loss=f"{logged['train/loss']:.3f}", acc=f"{logged['rewards/accuracies']:.2f}")
        if step % args.eval_every == 0 or step == total_steps:
            if executor and pending is not None:
                pending.result()  # the generator thread shares the reward and reference models: let it finish first
            metrics = run_eval(step)
        stop = run.stop_requested()
        if stop or (args.save_every and step % args.save_every == 0 and step < total_steps):
            # async: the next batch, sampled, is part of the state; waiting for it leaves the RNG where the thread does
            now = loop_state(step, drawn, pending.result() if executor and pending is not None else None)
            if stop:
                run.stop(now)
            else:
                run.checkpoint(now)
    progress.close()
    if executor:
        executor.shutdown(wait=True)

    episodes = total_steps * batch_pairs
    run.finish(
        policy,
        tokenizer,
        {"step": total_steps, "episode": episodes, "total_steps": total_steps, "total_episodes": episodes},
    )
    accelerator.end_training()
    return metrics


# --------------------------------------------------------------------------------------------------
# Plumbing: loading, engines, data, sampling, evaluation, durable runs (copied helpers are kept equal
# across scripts by tests/test_conventions.py)
# --------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Offline-first loading (same helpers as every script of this repository)
# ----------------------------------------------------------------------------------------------------


def load_pretrained(cls, path: str, args: Args, what: str, flag: str, **kwargs):
    local = os.path.isdir(path)
    if not local:
        require_hub(path, "model", flag)
    try:
        model = cls.from_pretrained(
            path,
            trust_remote_code=args.trust_remote_code,
            local_files_only=local,
            dtype=getattr(torch, args.dtype),
            **kwargs,
        )
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # no config.json, no weights, mismatched shapes
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(f"error: {flag} {path} cannot be loaded as the {what} ({cls.__name__}): {reason}") from None
    for module in model.modules():  # N+: dropout off, so rollout and training logprobs agree
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def load_tokenizer(args: Args):
    """The SFT model's tokenizer, with a pad token distinct from EOS (`ensure_pad_token`)."""
    local = os.path.isdir(args.sft_model_path)
    if not local:
        require_hub(args.sft_model_path, "model", "--sft-model-path")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            args.sft_model_path, trust_remote_code=args.trust_remote_code, local_files_only=local
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(
            f"error: --sft-model-path {args.sft_model_path} holds no tokenizer that transformers can "
            f"load (is it a model saved with save_pretrained?): {reason}"
        ) from None
    return ensure_pad_token(tokenizer, args.add_pad_token, args.sft_model_path)


def load_reward_model(args: Args, tokenizer):
    """The frozen outcome reward model of `--reward-model-path` (saved by reward_model.py: a sequence classifier with
    one label), checked before training: a process reward model, or one whose tokenizer gives the policy's tokens
    other ids (it scores the policy's token ids), is a one-line error. A checkpoint without a trained score head (a
    causal LM) loads with a random head: a warning."""
    path, flag = args.reward_model_path, "--reward-model-path"
    model = load_pretrained(AutoModelForSequenceClassification, path, args, "reward model", flag, num_labels=1)
    kind = getattr(model.config, "reward_type", "outcome")
    if kind != "outcome":
        raise SystemExit(
            f"error: {flag} {path} is a {kind} reward model (config.reward_type); this script scores "
            "whole responses: give an outcome reward model (reward_model.py --objective outcome)"
        )
    if not any(a.endswith("ForSequenceClassification") for a in model.config.architectures or []):
        print(
            f"warning: {flag} {path} is a {(model.config.architectures or ['?'])[0]}, not a reward model: its score "
            "head is untrained, so the rewards are noise",
            file=sys.stderr,
        )
    try:
        rm_vocab = AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path)).get_vocab()
    except (OSError, ValueError, KeyError, TypeError):
        rm_vocab = None  # no tokenizer saved with it: nothing to compare
    if rm_vocab is not None:
        differ = [t for t, i in tokenizer.get_vocab().items() if i != tokenizer.pad_token_id and rm_vocab.get(t) != i]
        if differ:
            raise SystemExit(
                f"error: the tokenizer of {flag} {path} differs from the policy's ({len(differ)} tokens, "
                f"e.g. {differ[0]!r}); it scores the policy's token ids, so it needs the same tokenizer"
            )
    model.config.pad_token_id = tokenizer.pad_token_id  # its own forward refuses batches without a pad id
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------------
# Engines: one process, DDP, DeepSpeed ZeRO-2/3 and FSDP, all through `accelerate launch` (helpers copied
# verbatim between scripts), and the tokenizer checks
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# Padding, reward-model scores, tiny-world judge (copied from sft.py / ppo_rlhf.py / benchmark/tiny_world.py)
# ----------------------------------------------------------------------------------------------------


def render(template: str, row: dict, index: int, split: str, what: str, flag: str) -> str:
    """`template` filled in with the row's fields. A field it uses that is missing, null or not text (a list, a dict,
    chat messages) is a one-line error naming the row, the field and the flag, never a silent `None` or `[...]`."""
    for name in template_fields(template, flag):
        value = row.get(name)
        if name not in row:
            raise SystemExit(
                f"error: row {index} of split '{split}' has no field '{name}' used by the {what} template "
                f"({flag} {template!r}); its fields are {sorted(row)}"
            )
        if value is None:
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{name}' of the {what} ({flag} "
                f"{template!r}) is missing or null; fill it in or drop the row"
            )
        if chat_messages(value):
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{name}' holds chat messages, which a "
                f"text template cannot hold; pass {flag} '{{{name}}}' alone to render them with the "
                "tokenizer's chat template"
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{name}' of the {what} ({flag} "
                f"{template!r}) is a {type(value).__name__}, not text: {str(value)[:60]!r}"
            )
    try:
        text = template.format(**row)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(
            f"error: row {index} of split '{split}': {flag} {template!r} cannot be filled in: {e}"
        ) from None
    if not text.strip():
        raise SystemExit(f"error: row {index} of split '{split}' renders an empty {what} ({flag} {template!r})")
    return text


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Index of the first True in each row, or the row length when there is none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def truncate_response(responses: torch.Tensor, stop_token_id: int, pad_id: int) -> torch.Tensor:
    """Everything after the first stop token (EOS) becomes pad; the stop token itself is kept."""
    trunc_idxs = first_true_indices(responses == stop_token_id).unsqueeze(-1)
    idxs = torch.arange(responses.size(1), device=responses.device).view(1, -1)
    return torch.masked_fill(responses, idxs > trunc_idxs, pad_id)


def token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token scalar scores (B, T) of a reward model saved as AutoModelForSequenceClassification: the
    `score` head applied to every hidden state. The model's own forward computes exactly these per-token
    scores before pooling them at one position; a forward hook on the head captures them. Going through the
    model's forward (not its backbone directly) keeps DistributedDataParallel's gradient all-reduce working
    when `model` is wrapped. Position ids follow the attention mask, so left and right padding give the
    same scores for the real tokens."""
    captured = {}
    head = getattr(model, "module", model).score  # DDP / DeepSpeed wrappers keep the model in `.module`
    handle = head.register_forward_hook(lambda module, inputs, output: captured.update(scores=output))
    try:
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    finally:
        handle.remove()
    return captured["scores"].squeeze(-1).float()


def outcome_reward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The reward (B,) read at the last non-pad token of each row, whatever side the padding is on, plus
    the normalisation bias stored in the config."""
    scores = token_scores(model, input_ids, attention_mask)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask * positions).argmax(dim=1)
    bias = getattr(getattr(model, "module", model).config, "reward_bias", 0.0)
    return scores[torch.arange(len(scores), device=scores.device), last] + bias


TLDR_FACT_WORDS = {
    "who": [
        "roommate",
        "boyfriend",
        "girlfriend",
        "boss",
        "sister",
        "brother",
        "neighbor",
        "friend",
        "coworker",
        "landlord",
    ],
    "what": ["rent", "car", "dog", "cat", "wedding", "job", "phone", "laptop", "party", "exam"],
    "feel": ["angry", "sad", "confused", "anxious", "happy", "jealous", "tired", "worried"],
}


TLDR_MAX_WORDS = 12


def gold_judge(summary: str, facts: list[str]) -> float:
    """Gold reward of a tiny-tldr summary: the share of the post's key `facts` it mentions, minus 0.5 for
    every fact word it invents (a fact word of the tiny world that is not one of this post's facts),
    minus 0.1 for every whitespace-separated token past TLDR_MAX_WORDS (digits and symbols count, so
    padding cannot dodge it). Repeated words count towards length, so repeating a fact cannot earn more
    than mentioning it once. Range: about [-inf, 1]; 1 is a perfect summary."""
    words = re.findall(r"[a-z]+", summary.lower())
    vocab = {w for group in TLDR_FACT_WORDS.values() for w in group}
    covered = sum(1 for f in facts if f in words) / len(facts)
    invented = len({w for w in words if w in vocab and w not in facts})
    too_long = max(0, len(summary.split()) - TLDR_MAX_WORDS)
    return covered - 0.5 * invented - 0.1 * too_long


# ----------------------------------------------------------------------------------------------------
# Metrics and the learning-rate schedule
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# The DPO math: small pure functions, each checked against hand-computed values in tests/test_dpo.py
# ----------------------------------------------------------------------------------------------------


def forward_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence logprobs of a pair batch whose first half of rows are the chosen responses, or of
    a `pack_pairs` batch. Position ids follow the attention mask, so the side of the padding does not change the
    result."""
    if "allowed" in batch:
        return packed_logprobs(model, batch)
    mask = batch["attention_mask"]
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids).logits
    return sequence_logprobs(logits, batch["input_ids"], batch["loss_mask"]).chunk(2)


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def prompt_token_ids(row: dict, index: int, split: str, tokenizer, args: Args) -> list[int]:
    """The prompt of a row as token ids: `--prompt-template` filled in (wrapped as a user message with
    `--use-chat-template`), or, where the template is one field holding chat messages (TRL's conversational prompt
    format, {"prompt": [{"role": "user", "content": ...}]}), those messages in the tokenizer's chat template, ready for
    the assistant's turn."""
    messages = whole_field_messages(args.prompt_template, row)
    if messages is None:
        prompt = render(args.prompt_template, row, index, split, "prompt", "--prompt-template")
        if not args.use_chat_template:
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not tokenizer.chat_template:
            raise SystemExit(
                f"error: --use-chat-template: the tokenizer of --sft-model-path {args.sft_model_path} has "
                "no chat template; drop the flag or give a model that has one"
            )
        messages = [{"role": "user", "content": prompt}]
    elif messages[-1]["role"] == "assistant":
        raise SystemExit(
            f"error: row {index} of split '{split}': the chat messages of --prompt-template "
            f"{args.prompt_template!r} end with an assistant turn; an RL prompt ends before the answer: "
            "give the prompt's messages only (TRL's conversational prompt format, the completion "
            "elsewhere)"
        )
    elif not tokenizer.chat_template:
        raise SystemExit(
            f"error: row {index} of split '{split}' holds chat messages, but the tokenizer of "
            f"--sft-model-path {args.sft_model_path} has no chat template to render them; give "
            "plain-text prompts or a model with a chat template"
        )
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def reference_text(row: dict, index: int, split: str, args: Args) -> str:
    """The reference response: `--reference-template` filled in, or the assistant turns of a field of chat messages
    (TRL's conversational completion, [{"role": "assistant", "content": ...}])."""
    messages = whole_field_messages(args.reference_template, row)
    if messages is None:
        return render(args.reference_template, row, index, split, "reference", "--reference-template")
    text = "\n".join(m["content"] for m in messages if m["role"] == "assistant")
    if not text.strip():
        raise SystemExit(
            f"error: row {index} of split '{split}': the chat messages of --reference-template "
            f"{args.reference_template!r} hold no assistant turn to take the reference from"
        )
    return text


def response_text(row: dict, index: int, split: str, field: str, flag: str) -> str:
    """The chosen or rejected response of a row: the field's text, or the assistant turn of TRL's conversational
    preference format ({"prompt": [user messages], "chosen": [{"role": "assistant", "content": ...}], ...}). A missing,
    null, empty or non-text field, or a whole conversation (TRL's implicit-prompt format, the prompt repeated in both
    responses), is a one-line error naming the row, the field and the flag."""
    if field not in row:
        raise SystemExit(
            f"error: row {index} of split '{split}' has no field '{field}' ({flag}); its fields are {sorted(row)}"
        )
    value = row[field]
    if value is None:
        raise SystemExit(
            f"error: row {index} of split '{split}': field '{field}' ({flag}) is missing or null; fill it "
            "in or drop the row"
        )
    if chat_messages(value):
        if any(m["role"] != "assistant" for m in value):
            raise SystemExit(
                f"error: row {index} of split '{split}': field '{field}' ({flag}) holds a whole "
                f"conversation (roles {[m['role'] for m in value]}), TRL's implicit-prompt format; give "
                "the prompt's messages in their own field (--prompt-template '{prompt}') and only the "
                "assistant's turn in chosen and rejected (TRL's prompt/chosen/rejected format)"
            )
        value = "\n".join(m["content"] for m in value)
    elif not isinstance(value, str):
        raise SystemExit(
            f"error: row {index} of split '{split}': field '{field}' ({flag}) is a "
            f"{type(value).__name__}, not text: {str(value)[:60]!r}"
        )
    if not value.strip():
        raise SystemExit(f"error: row {index} of split '{split}': field '{field}' ({flag}) is empty")
    return value


def model_positions(model) -> int | None:
    """The longest sequence the model's position embeddings cover (None when its config does not say)."""
    config = model.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def tokenize_pairs(ds: Dataset, tokenizer, args: Args, split: str, max_positions: int | None = None) -> list[dict]:
    """Prompt ids and chosen / rejected response ids, each ending in exactly one EOS (the N+ responses already end
    with the text `<|endoftext|>`), every field checked now (`prompt_token_ids`, `response_text`). A pair longer than
    `--max-prompt-length` / `--max-response-length`, or than the model's positions, is an error (or dropped with
    `--drop-overlong`); so is a split whose every pair has chosen = rejected (no preference to learn)."""
    out, dropped, same = [], 0, 0
    for i, row in enumerate(ds):
        item = {}
        for key, name, flag in (
            ("chosen", args.chosen_field, "--chosen-field"),
            ("rejected", args.rejected_field, "--rejected-field"),
        ):
            ids = tokenizer(response_text(row, i, split, name, flag), add_special_tokens=False)["input_ids"]
            item[key] = end_with_eos(ids, tokenizer.eos_token_id)
        # the prompt after the responses: TRL's implicit-prompt rows get the message about their format
        prompt_ids = item["prompt_ids"] = prompt_token_ids(row, i, split, tokenizer, args)
        longest = max(len(item["chosen"]), len(item["rejected"]))
        too_long = len(prompt_ids) > args.max_prompt_length or longest > args.max_response_length
        no_room = max_positions is not None and len(prompt_ids) + longest > max_positions
        if too_long or no_room:
            if args.drop_overlong:
                dropped += 1
                continue
            if too_long:
                raise SystemExit(
                    f"error: row {i} of split '{split}' has a {len(prompt_ids)}-token prompt and a "
                    f"{longest}-token response (EOS included); the limits are --max-prompt-length "
                    f"{args.max_prompt_length} and --max-response-length {args.max_response_length}. "
                    "Raise them or pass --drop-overlong."
                )
            raise SystemExit(
                f"error: row {i} of split '{split}' has a {len(prompt_ids)}-token prompt and a {longest}-"
                f"token response, {len(prompt_ids) + longest} tokens, more than the {max_positions} "
                f"positions of --sft-model-path (max_position_embeddings); lower --max-prompt-length (now "
                f"{args.max_prompt_length}) or --max-response-length, with --drop-overlong"
            )
        same += item["chosen"] == item["rejected"]
        out.append(item)
    if dropped:
        print(
            f"dropped {dropped} of {len(ds)} pairs of '{split}' longer than --max-prompt-length / "
            "--max-response-length or than the model's positions"
        )
    if not out:
        raise SystemExit(f"error: no usable pairs in split '{split}'")
    if same == len(out):
        raise SystemExit(
            f"error: every pair of split '{split}' has the same chosen and rejected response "
            f"(--chosen-field '{args.chosen_field}', --rejected-field '{args.rejected_field}'): there is "
            "no preference to learn; check the two fields"
        )
    if same:
        print(
            f"warning: {same} of {len(out)} pairs of '{split}' have the same chosen and rejected response: they "
            "count in the loss's mean but carry no preference",
            file=sys.stderr,
        )
    return out


def collate_pairs(items: list[dict], pad_id: int, pack: bool = False) -> dict[str, torch.Tensor]:
    """Chosen rows first, then rejected rows, right-padded (one forward pass for both); the loss mask marks
    the response tokens and EOS. With `pack`, the `pack_pairs` batch instead. Cached reference logprobs travel
    with the pairs when present."""
    if pack:
        batch = pack_pairs(items, pad_id)
        if "ref_chosen" in items[0]:
            batch["ref_chosen"] = torch.tensor([it["ref_chosen"] for it in items])
            batch["ref_rejected"] = torch.tensor([it["ref_rejected"] for it in items])
        return batch
    seqs = [(it["prompt_ids"], it[key]) for key in ("chosen", "rejected") for it in items]
    width = max(len(p) + len(r) for p, r in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention_mask[i, : len(p) + len(r)] = 1
        loss_mask[i, len(p) : len(p) + len(r)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    if "ref_chosen" in items[0]:
        batch["ref_chosen"] = torch.tensor([it["ref_chosen"] for it in items])
        batch["ref_rejected"] = torch.tensor([it["ref_rejected"] for it in items])
    return batch


def prepare_prompts(
    ds: Dataset, tokenizer, args: Args, split: str, max_positions: int | None, evaluation: bool
) -> list[dict]:
    """Prompt token ids plus what the judge and evaluation need: the reference response and the key facts
    (tiny-tldr), each checked on every row now, so a bad row fails before the first update and not at an evaluation
    hours in. A prompt longer than `--max-prompt-length`, or one that leaves fewer than `--response-length` of the
    model's positions, is an error (or dropped with `--drop-overlong`)."""
    rows, dropped = [], 0
    needs_reference = evaluation and args.eval_task == "tldr"
    needs_facts = needs_reference or (not evaluation and args.mode == "online" and args.judge == "gold")
    for i, row in enumerate(ds):
        ids = prompt_token_ids(row, i, split, tokenizer, args)
        too_long = len(ids) > args.max_prompt_length
        no_room = max_positions is not None and len(ids) + args.response_length > max_positions
        if too_long or no_room:
            if args.drop_overlong:
                dropped += 1
                continue
            if too_long:
                raise SystemExit(
                    f"error: row {i} of split '{split}' has a {len(ids)}-token prompt; the limit is "
                    f"--max-prompt-length {args.max_prompt_length}. Raise it or pass --drop-overlong."
                )
            raise SystemExit(
                f"error: row {i} of split '{split}' has a {len(ids)}-token prompt, and --response-length "
                f"{args.response_length} more tokens do not fit the {max_positions} positions of "
                f"--sft-model-path (max_position_embeddings); lower --max-prompt-length (now "
                f"{args.max_prompt_length}) with --drop-overlong, or --response-length"
            )
        item = {"prompt_ids": ids, "reference": None, "facts": None}
        if needs_reference:
            item["reference"] = reference_text(row, i, split, args)
        if needs_facts:
            facts = row.get("facts")
            if not (isinstance(facts, list) and facts and all(isinstance(f, str) for f in facts)):
                why = "--eval-task tldr" if needs_reference else "--judge gold"
                raise SystemExit(
                    f"error: row {i} of split '{split}': {why} judges summaries by the row's 'facts' "
                    f"(a list of words, as in tiny-tldr), but it is {str(facts)[:60]!r}; use --eval-task "
                    "none and --judge rm for other data"
                )
            item["facts"] = facts
        rows.append(item)
    if dropped:
        print(
            f"dropped {dropped} of {len(ds)} prompts of '{split}' longer than --max-prompt-length "
            f"{args.max_prompt_length} or than the model's positions less --response-length"
        )
    if not rows:
        raise SystemExit(f"error: no usable prompts in split '{split}'")
    return rows


# ----------------------------------------------------------------------------------------------------
# Reference logprobs, online pairs, evaluation
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def cache_ref_logprobs(ref_policy, items: list[dict], pad_id: int, args: Args, accelerator: Accelerator) -> None:
    """Reference logprobs of every pair, computed once (each process takes a shard, all get the union; under ZeRO-3 the
    shards are padded to equal size, every forward pass being a collective, and a padded duplicate rewrites a value)."""
    out = []
    with accelerator.split_between_processes(list(range(len(items))), apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            idx = shard[start : start + args.per_device_eval_batch_size]
            batch = {
                k: v.to(accelerator.device)
                for k, v in collate_pairs([items[i] for i in idx], pad_id, args.pack_pairs).items()
            }
            with accelerator.autocast():  # the training precision (bf16 mixed precision: as the policy computes)
                chosen, rejected = forward_logprobs(ref_policy, batch)
            out.extend(zip(idx, chosen.tolist(), rejected.tolist()))
    for i, c, r in gather_object(out):
        items[i]["ref_chosen"], items[i]["ref_rejected"] = c, r


@torch.no_grad()
def sample_pairs(
    gen_policy,
    ref_policy,
    reward_model,
    tokenizer,
    rows: list[dict],
    args: Args,
    device,
    version: int,
    num_threads: int | None = None,
    synced: bool = False,
    autocast=nullcontext,
) -> dict:
    """Online DPO data for one step: two samples per prompt from `gen_policy`, truncated after EOS, scored by
    the judge; the higher-scored one is `chosen`. Returns the pairs as token lists (the offline pairs' format) with
    their reference logprobs, which pairs tie, the policy version that generated them, and rollout statistics. Runs
    in the generator thread with --async. `synced` (ZeRO-3): `generate` keeps stepping until every process is done.
    `autocast`: the training precision's context (accelerator.autocast), for the frozen models' forward passes."""
    if num_threads:  # a new thread starts with the default OpenMP pool; give it its share of the cores
        torch.set_num_threads(num_threads)
    t0 = time.time()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    queries, qmask = left_pad([r["prompt_ids"] for r in rows for _ in range(2)], pad)  # rows 2i and 2i+1: prompt i
    queries, qmask = queries.to(device), qmask.to(device)
    out = gen_policy.generate(
        input_ids=queries,
        attention_mask=qmask,
        max_new_tokens=args.response_length,
        do_sample=True,
        temperature=args.temperature + 1e-7,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad,
        eos_token_id=eos,
        synced_gpus=synced,
    )
    responses = truncate_response(out[:, queries.shape[1] :], eos, pad)
    if (responses[:, 0] == pad).any():
        raise RuntimeError("a sampled response is empty (its first token is PAD); the policy emits the pad token")
    contain_eos = (responses == eos).any(1)
    if args.judge == "gold":
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores = torch.tensor([gold_judge(t, rows[i // 2]["facts"]) for i, t in enumerate(texts)], device=device)
    else:
        seqs = torch.cat([queries, responses], 1)
        with autocast():
            scores = outcome_reward(reward_model, seqs.masked_fill(seqs == pad, 0), (seqs != pad).long()).float()
    if args.non_eos_penalty:
        scores = torch.where(contain_eos, scores, torch.full_like(scores, args.penalty_reward_value))
    first_wins = scores[0::2] >= scores[1::2]
    chosen = torch.where(first_wins[:, None], responses[0::2], responses[1::2])
    rejected = torch.where(first_wins[:, None], responses[1::2], responses[0::2])
    # the pairs as token lists, pad tokens dropped (the padded forward masks them out), like the offline pairs
    real = lambda t: t[t != pad].tolist()  # noqa: E731
    pairs = [
        {"prompt_ids": real(queries[2 * i]), "chosen": real(chosen[i]), "rejected": real(rejected[i])}
        for i in range(len(rows))
    ]
    batch = {k: v.to(device) for k, v in collate_pairs(pairs, pad, args.pack_pairs).items()}
    with autocast():
        ref_logprobs = forward_logprobs(ref_policy, batch)
    for it, ref_c, ref_r in zip(pairs, *ref_logprobs):
        it["ref_chosen"], it["ref_rejected"] = ref_c.item(), ref_r.item()
    high, low = scores.view(-1, 2).max(1).values, scores.view(-1, 2).min(1).values
    stats = {
        "objective/reward": scores.mean(),
        "objective/score_margin": (high - low).mean(),
        "objective/tie_rate": (high == low).float().mean(),
        "objective/eos_rate": contain_eos.float().mean(),
        "objective/completion_length": (responses != pad).sum(1).float().mean(),
    }
    return {"pairs": pairs, "valid": high != low, "version": version, "stats": stats, "gen_time": time.time() - t0}


def portable(data: dict | None) -> dict | None:
    """`sample_pairs`'s batch as JSON (token lists, floats, booleans), for a checkpoint's state."""
    if data is None:
        return None
    return {
        "pairs": data["pairs"],
        "valid": data["valid"].tolist(),
        "version": data["version"],
        "stats": {k: float(v) for k, v in data["stats"].items()},
        "gen_time": data["gen_time"],
    }


def restored(data: dict, device) -> dict:
    """The batch of `portable` back in `sample_pairs`'s form (the floats are the float32 values, so exact)."""
    return {**data, "valid": torch.tensor(data["valid"], dtype=torch.bool, device=device)}


def done_future(result) -> Future:
    """A future that already holds `result` (a resumed async run's first batch, sampled before the checkpoint)."""
    future = Future()
    future.set_result(result)
    return future


@torch.no_grad()
def evaluate_pairs(policy, ref_policy, items: list[dict], pad_id: int, args: Args, accelerator: Accelerator) -> dict:
    """DPO loss and implicit-reward accuracy on held-out preference pairs (under ZeRO-3, shards padded to equal size
    and the padded duplicates dropped after)."""
    policy.eval()
    records = []
    with accelerator.split_between_processes(items, apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            batch = {
                k: v.to(accelerator.device)
                for k, v in collate_pairs(
                    shard[start : start + args.per_device_eval_batch_size], pad_id, args.pack_pairs
                ).items()
            }
            with accelerator.autocast():
                chosen, rejected = forward_logprobs(policy, batch)
                if "ref_chosen" in batch:
                    ref_c, ref_r = batch["ref_chosen"], batch["ref_rejected"]
                else:
                    ref_c, ref_r = forward_logprobs(ref_policy, batch)
            losses, rc, rr = pair_losses(batch, chosen, rejected, ref_c, ref_r, args)
            records.extend(zip(losses.tolist(), rc.tolist(), rr.tolist(), implicit_accuracy(rc, rr).tolist()))
    records = gather_object(records[: shard_length(len(items), accelerator)])  # without the padded rows
    policy.train()
    n = len(records)
    return {
        "eval/loss": sum(r[0] for r in records) / n,
        "eval/accuracy": sum(r[3] for r in records) / n,
        "eval/reward_chosen": sum(r[1] for r in records) / n,
        "eval/reward_rejected": sum(r[2] for r in records) / n,
        "eval/reward_margin": sum(r[1] - r[2] for r in records) / n,
    }


@torch.no_grad()
def sampled_kl(policy, reference, queries, qmask, response_length: int, pad_id: int, eos_id: int, synced: bool) -> list:
    """(--eval-kl) KL(pi || pi_ref) per prompt, estimated the same way in every script (the x-axis of the benchmark's
    gold-reward-against-KL frontier): one response sampled at temperature 1, then the sum over its tokens of
    log pi - log pi_ref (the unbiased k1 estimator, Schulman 2020 "Approximating KL Divergence"). Its own generator
    seeded from the prompts, so evaluating leaves the training's random stream alone and repeats exactly."""
    devices = [queries.device.index or 0] if queries.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(queries.sum()))
        out = policy.generate(
            input_ids=queries,
            attention_mask=qmask,
            max_new_tokens=response_length,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
            synced_gpus=synced,
        )
    responses = out[:, queries.shape[1] :]
    ended = (responses == eos_id).long()
    # the response up to its first EOS, from positions, not from the pad id: a sampled pad token is a token
    valid = (ended.cumsum(1) - ended == 0).long()
    mask = torch.cat([qmask, valid], 1)
    inputs = {
        "input_ids": torch.cat([queries, responses], 1).masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - mask).clamp(min=0),
    }
    kl = torch.zeros(len(queries), device=queries.device)
    for model, sign in ((policy, 1.0), (reference, -1.0)):
        logits = model(**inputs, logits_to_keep=responses.shape[1] + 1).logits[:, :-1].float()
        logprobs = torch.gather(logits.log_softmax(-1), 2, responses[..., None])[..., 0]
        kl += sign * (logprobs * valid).sum(1)
    return kl.tolist()


@torch.no_grad()
def evaluate(
    policy, reward_model, tokenizer, rows: list[dict], args: Args, accelerator: Accelerator, reference=None
) -> tuple[dict, list[dict]]:
    """Greedy responses to the evaluation prompts, scored by the gold judge (tiny-tldr) and the reward model if any.
    Under ZeRO-3 the shards are padded to equal size and `generate` synced (every forward pass is a collective)."""
    policy.eval()
    records = []
    with accelerator.split_between_processes(rows, apply_padding=zero3(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            batch = shard[start : start + args.per_device_eval_batch_size]
            queries, qmask = left_pad([r["prompt_ids"] for r in batch], tokenizer.pad_token_id)
            queries, qmask = queries.to(accelerator.device), qmask.to(accelerator.device)
            out = policy.generate(
                input_ids=queries,
                attention_mask=qmask,
                max_new_tokens=args.response_length,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                synced_gpus=zero3(accelerator),
            )
            responses = truncate_response(out[:, queries.shape[1] :], tokenizer.eos_token_id, tokenizer.pad_token_id)
            scores = [None] * len(batch)
            if reward_model is not None:
                seqs = torch.cat([queries, responses], 1)
                with accelerator.autocast():
                    scores = outcome_reward(
                        reward_model,
                        seqs.masked_fill(seqs == tokenizer.pad_token_id, 0),
                        (seqs != tokenizer.pad_token_id).long(),
                    ).tolist()
            kls = [None] * len(batch)
            if args.eval_kl and reference is not None:
                kls = sampled_kl(
                    policy,
                    reference,
                    queries,
                    qmask,
                    args.response_length,
                    tokenizer.pad_token_id,
                    tokenizer.eos_token_id,
                    zero3(accelerator),
                )
            for r, resp, score, kl in zip(batch, responses, scores, kls):
                text = tokenizer.decode(resp, skip_special_tokens=True)
                rec = {
                    "response": text,
                    "score": score,
                    "kl": kl,
                    "length": int((resp != tokenizer.pad_token_id).sum()),
                    "eos": bool((resp == tokenizer.eos_token_id).any()),
                }
                if args.eval_task == "tldr":
                    rec["gold_reward"], rec["reference_gold_reward"] = (
                        gold_judge(text, r["facts"]),
                        gold_judge(r["reference"], r["facts"]),
                    )
                records.append(rec)
    records = gather_object(records[: shard_length(len(rows), accelerator)])  # without the padded rows
    policy.train()
    n = len(records)
    metrics = {
        "eval/completion_length": sum(r["length"] for r in records) / n,
        "eval/eos_rate": sum(r["eos"] for r in records) / n,
    }
    if reward_model is not None:
        metrics["eval/score"] = sum(r["score"] for r in records) / n
    if args.eval_kl and reference is not None:
        metrics["eval/kl"] = sum(r["kl"] for r in records) / n
    if args.eval_task == "tldr":
        metrics["eval/gold_reward"] = sum(r["gold_reward"] for r in records) / n
        metrics["eval/win_rate"] = (
            sum(
                1.0
                if r["gold_reward"] > r["reference_gold_reward"]
                else 0.5
                if r["gold_reward"] == r["reference_gold_reward"]
                else 0.0
                for r in records
            )
            / n
        )
    return metrics, records


# ----------------------------------------------------------------------------------------------------
# Durable runs: the run directory, checkpoints that resume exactly, SIGTERM / SIGINT, the end-of-run marker and the
# argument checks (copied verbatim between scripts; tests/test_faults.py)
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# The script's own argument checks and loop state
# ----------------------------------------------------------------------------------------------------


def check_dpo_args(args: Args) -> None:
    """dpo.py's own flags, checked before anything loads (`check_args` checks those every script shares)."""
    check_args(args, zero_means_none=("num_eval_examples", "num_eval_pairs"))  # 0 skips that evaluation
    for flag, value in (("--num-eval-examples", args.num_eval_examples), ("--num-eval-pairs", args.num_eval_pairs)):
        if value < 0:
            raise SystemExit(f"error: {flag} is {value}; 0 skips that evaluation")
    if not args.beta > 0:
        raise SystemExit(f"error: --beta is {args.beta}; the KL strength must be above 0")
    if not 0 <= args.label_smoothing < 0.5:
        raise SystemExit(
            f"error: --label-smoothing is {args.label_smoothing}; the probability that a label is flipped "
            "must be in [0, 0.5)"
        )
    if args.mode == "online" and args.judge == "rm" and not args.reward_model_path:
        raise SystemExit(
            "error: online DPO with --judge rm labels its pairs with a reward model: pass "
            "--reward-model-path (reward_model.py's output), or --judge gold on tiny-tldr"
        )


# --------------------------------------------------------------------------------------------------
# Speed work (skippable on a first reading): the same results, faster
# --------------------------------------------------------------------------------------------------


def pack_pairs(items: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """A padding-free batch of preference pairs for one forward pass. Why: in a right-padded batch of prompt + response
    rows about a quarter of the tokens are padding, and chosen and rejected repeat the same prompt, most of the tokens
    in TL;DR; the matmuls, most of a step's time, scale with the tokens. A causal model computes the same hidden states
    for a shared prefix whatever follows it, so each pair is laid out once as [common prefix, rest of chosen, rest of
    rejected] (the prefix is the prompt plus any first response tokens both share, capped so both rests keep at least
    one token). The rest of rejected sees the prefix and itself but not the chosen tokens, and its position ids
    continue from the prefix, so every token sees exactly what it sees in its own padded row. Pairs are laid end to end
    in rows of at most `capacity` tokens (first-fit, longest first; twice the longest sequence packed best on CPU: the
    attention and mask cost grow with the row length). `allowed` (rows, W, W) says which key each query may attend to
    (block-diagonal per pair, causal, rejected not seeing chosen). `rows`, `cols` (2N, C) locate the positions whose
    logits predict each response token (C: the longest response), chosen sequences first, then rejected ones, as in
    the padded batch; `targets` are those tokens and `mask` marks the real ones."""
    n = len(items)
    prompts = [it["prompt_ids"] for it in items]
    chosen = [it["prompt_ids"] + it["chosen"] for it in items]
    rejected = [it["prompt_ids"] + it["rejected"] for it in items]
    shared = [
        min(next((k for k, (a, b) in enumerate(zip(c, r)) if a != b), min(len(c), len(r))), min(len(c), len(r)) - 1)
        for c, r in zip(chosen, rejected)
    ]
    units = [len(c) + len(r) - s for c, r, s in zip(chosen, rejected, shared)]
    capacity = max(2 * max(len(s) for s in chosen + rejected), max(units))
    members, free = [], []
    for i in sorted(range(n), key=lambda i: -units[i]):
        row = next((r for r in range(len(members)) if free[r] >= units[i]), None)
        if row is None:
            members.append([]), free.append(capacity)
            row = len(members) - 1
        members[row].append(i)
        free[row] -= units[i]
    width, C = capacity - min(free), max(len(it[k]) for it in items for k in ("chosen", "rejected"))
    input_ids = torch.full((len(members), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(members), width), dtype=torch.long)
    pair = torch.full((len(members), width), -1, dtype=torch.long)  # which pair of the row a token belongs to
    part = torch.zeros(
        (len(members), width), dtype=torch.long
    )  # 0: shared prefix or padding, 1: rest of chosen, 2: rest of rejected
    rows, cols = torch.zeros((2 * n, C), dtype=torch.long), torch.zeros((2 * n, C), dtype=torch.long)
    targets, mask = torch.full((2 * n, C), pad_id, dtype=torch.long), torch.zeros((2 * n, C), dtype=torch.long)
    for r, row in enumerate(members):
        offset = 0
        for i in row:
            c, rej, s, P = chosen[i], rejected[i], shared[i], len(prompts[i])
            input_ids[r, offset : offset + units[i]] = torch.tensor(c + rej[s:])
            position_ids[r, offset : offset + len(c)] = torch.arange(len(c))
            position_ids[r, offset + len(c) : offset + units[i]] = torch.arange(s, len(rej))
            pair[r, offset : offset + units[i]] = i
            part[r, offset + s : offset + len(c)], part[r, offset + len(c) : offset + units[i]] = 1, 2
            # token t of a sequence is predicted by the logits at token t - 1; rejected token t - 1 sits in the prefix
            # while t - 1 < s, and after the whole chosen sequence from then on
            before_c, before_r = torch.arange(P - 1, len(c) - 1), torch.arange(P - 1, len(rej) - 1)
            rows[i, : len(before_c)], cols[i, : len(before_c)] = r, offset + before_c
            rows[n + i, : len(before_r)] = r
            cols[n + i, : len(before_r)] = torch.where(before_r < s, offset + before_r, offset + len(c) + before_r - s)
            targets[i, : len(before_c)], mask[i, : len(before_c)] = torch.tensor(c[P:]), 1
            targets[n + i, : len(before_r)], mask[n + i, : len(before_r)] = torch.tensor(rej[P:]), 1
            offset += units[i]
        position_ids[r, offset:] = torch.arange(width - offset)  # the padding tail sees only itself; it is never read
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (pair[:, :, None] == pair[:, None, :]) & causal & ~((part[:, :, None] == 2) & (part[:, None, :] == 1))
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "allowed": allowed,
        "rows": rows,
        "cols": cols,
        "targets": targets,
        "mask": mask,
    }


def packed_logprobs(model, packed: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence logprobs of a `pack_pairs` batch. The mask goes in as a 4D additive mask, which
    transformers hands to the attention as is (eager and sdpa attention; flash-attention kernels take no such mask).
    use_cache=False: no KV cache is needed here. Only the logits that predict response tokens go through log_softmax."""
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(packed["allowed"].shape, dtype=dtype, device=packed["allowed"].device)
    mask = mask.masked_fill(~packed["allowed"], torch.finfo(dtype).min)[:, None]
    logits = model(
        input_ids=packed["input_ids"], attention_mask=mask, position_ids=packed["position_ids"], use_cache=False
    ).logits
    logps = torch.gather(
        logits[packed["rows"], packed["cols"]].float().log_softmax(-1), 2, packed["targets"].unsqueeze(-1)
    ).squeeze(-1)
    return (logps * packed["mask"]).sum(-1).chunk(2)


if __name__ == "__main__":
    main(tyro.extras.overridable_config_cli(PRESETS))
