"""Engines: one process, DDP, DeepSpeed ZeRO-2/3 and FSDP, all through `accelerate launch`; LoRA through peft; the
gathered save of the trained weights; the counts and gradient scaling that make a mean over the whole mini-batch of
every process independent of how it is split (tests/test_invariance.py). Nothing here changes a number: the same
run on one process or several, with or without an engine, computes the same thing."""

from __future__ import annotations

import contextlib
import copy
import os
import resource
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    gather_object,
    set_seed,
)

from clean_rlhf_utils.preferences import collate_preference_pairs


def cpu_threads(processes: int) -> int:
    """Each process's share of the cores this one may run on (taskset, a SLURM cpuset, a pinned test worker), not of
    all the machine's: one BLAS pool per process, or the processes fight over the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // processes)


def make_accelerator(gradient_accumulation_steps: int, sync_with_dataloader: bool) -> Accelerator:
    """The Accelerator of `accelerate launch`, whose config picks the engine and the mixed precision. Loops that draw
    from an endless prepared loader pass `sync_with_dataloader=False`: otherwise accelerate steps the optimizer on every
    micro-batch once the loader hands out its last batch, and gradient accumulation is off for that whole update.
    Without a GPU, several processes join one gloo group: DDP through `cpu=True`, DeepSpeed and FSDP through gloo."""
    engine = any(os.environ.get(f"ACCELERATE_USE_{e}", "false").lower() == "true" for e in ("DEEPSPEED", "FSDP"))
    gloo = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    plugin = GradientAccumulationPlugin(
        num_steps=gradient_accumulation_steps, sync_with_dataloader=sync_with_dataloader
    )
    handlers = [InitProcessGroupKwargs(backend="gloo")] if gloo and engine else []
    if gloo and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        # accelerate 1.15 makes the engine FSDP only over a GPU backend: on CPU it leaves DistributedType.NO, and
        # `prepare`, `reduce` and `gather` then do nothing (two unrelated processes that each train alone). Start the
        # gloo group and let AcceleratorState take its GPU branch, which sets FSDP: every collective runs on gloo.
        PartialState(backend="gloo")
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    return Accelerator(gradient_accumulation_plugin=plugin, cpu=gloo and not engine, kwargs_handlers=handlers)


def seed_per_process(accelerator: Accelerator, seed: int) -> None:
    """After `prepare`, each process's random streams (torch, numpy, random) seeded with seed + rank * 100003, as the N+
    code does: the processes sample different completions for the same prompt, and a rerun repeats them. Before it,
    `set_seed(seed)` gave every process the same stream, so the weights a script draws (fresh heads, LoRA) agree; the
    loaders shuffle with generators of their own, which accelerate keeps in step. With one process there is nothing
    to decorrelate: its stream goes on untouched, so a single-process run draws what it always drew."""
    if accelerator.num_processes > 1:
        set_seed(seed + accelerator.process_index * 100003)


def zero3(accelerator: Accelerator) -> bool:
    """DeepSpeed ZeRO-3: every rank holds a shard of each weight, so every forward pass is a collective of all ranks
    (sampling loops and `generate` must keep stepping until every rank is done)."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


def sharded(accelerator: Accelerator) -> bool:
    """ZeRO-3 or FSDP: every rank holds a shard of each weight and gathers the rest for each forward pass, so every
    forward pass is a collective of all ranks: sampling loops and `generate` keep stepping until every rank is done,
    evaluation shards are padded to one length. (Under FSDP2 the prepared module is the model itself, its layers
    sharded in place, so a forward pass through it, wherever it is called from, gathers and reshards its weights.)"""
    return zero3(accelerator) or accelerator.distributed_type == DistributedType.FSDP


@contextlib.contextmanager
def full_weights(model, accelerator: Accelerator):
    """For forward passes that bypass the prepared model's own forward (sampling with a submodule such as PPO's
    `policy`, its evaluation), under no_grad. FSDP gathers each unit's weights in that unit's forward, and the root
    unit's (the weights in no per-layer unit: under PPO's wrapper, the embeddings and heads) only in the root's forward,
    so here they are gathered for the block (FSDP2: `unshard`, then `reshard`; FSDP1:
    `summon_full_params(recurse=False)`, as TRL generates, which also makes the root the root before any inner unit
    runs). The per-layer units still gather their own weights as they run. Elsewhere it does nothing."""
    if accelerator.distributed_type != DistributedType.FSDP:
        yield
    elif accelerator.state.fsdp_plugin.fsdp_version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False):
            yield
    else:
        model.unshard()
        try:
            yield
        finally:
            model.reshard()


def configure_deepspeed(accelerator: Accelerator, micro_batch_size: int | None, max_grad_norm: float) -> None:
    """DeepSpeed's config takes the micro-batch size of one backward pass, which accelerate otherwise reads from a
    prepared dataloader (None: from the dataloader), and clips gradients inside its own step at its `gradient_clipping`,
    which accelerate would fill with 1.0 whatever `--max-grad-norm` says. Call it before `prepare`."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        if micro_batch_size is not None:
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size
        plugin.deepspeed_config["gradient_clipping"] = max_grad_norm


def prepare_frozen(model, accelerator: Accelerator):
    """A frozen model (reference policy, reward model) ready for the engine in use; call it after `prepare`. Under
    DeepSpeed it becomes an inference engine in the training precision, as TRL's `prepare_deepspeed` does: sharded under
    ZeRO-3, where `from_pretrained` already partitioned its weights (moved with `.to(device)` it would hold empty
    tensors), unsharded (stage 0) otherwise. Elsewhere it moves to the device."""
    if model is None:
        return None
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return model.to(accelerator.device)
    import deepspeed

    config = copy.deepcopy(plugin.deepspeed_config)
    if config["zero_optimization"]["stage"] != 3:
        config["zero_optimization"]["stage"] = 0
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()
    object.__setattr__(engine.module, "_frozen_engine", engine)  # kept alive with the module, not registered in it
    return engine.module


def save_model(model, tokenizer, accelerator: Accelerator, path: Path, prefix: str = "", dtype=torch.float32) -> None:
    """The trained model (safetensors) and its tokenizer, written by the main process, in `dtype`, the dtype the model
    was loaded and trained in (`--dtype`), whatever the engine: DeepSpeed under bf16 / fp16 mixed precision trains a
    half-precision copy and keeps float32 master weights in its optimizer, so each trained weight is saved from its
    master (then cast to `dtype`); one process, DDP and FSDP save the module's own weights, which are the trained ones;
    a weight without a master (frozen, such as LoRA's base weights, which DeepSpeed cast to half precision) is the
    module's, cast. config.json records `dtype`. Every rank must call it: `get_state_dict` gathers the full weights
    (under ZeRO-3 and FSDP each rank holds only a shard) and the masters are gathered from every rank's partition.
    `prefix` keeps one submodule's weights (PPO saves `policy.`, not the value model). LoRA adapters are merged in."""
    state_dict = accelerator.get_state_dict(model)
    masters = master_weights(model, accelerator, prefix)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        state_dict = {k: masters.get(k, v).to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        if prefix:
            unwrapped = unwrapped.get_submodule(prefix.rstrip("."))
            state_dict = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if hasattr(unwrapped, "peft_config"):
            unwrapped, state_dict = unwrapped.get_base_model(), merge_lora(state_dict, unwrapped.peft_config["default"])
        unwrapped.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        config = copy.deepcopy(unwrapped.config)  # save_pretrained wrote the module's dtype (DeepSpeed's: bf16)
        config.dtype = dtype
        config.save_pretrained(path)
        tokenizer.save_pretrained(path)
    accelerator.wait_for_everyone()


def master_weights(model, accelerator: Accelerator, prefix: str = "") -> dict:
    """DeepSpeed's float32 master weights of the trained parameters whose names start with `prefix`, by the module's
    state-dict names (tied weights under each name), on the main process ({} elsewhere and without DeepSpeed). Every
    rank calls it: each weight is a collective (`safe_get_full_fp32_param` gathers the ranks' partitions)."""
    if accelerator.state.deepspeed_plugin is None:
        return {}
    from deepspeed.utils import safe_get_full_fp32_param

    masters, by_param = {}, {}
    for name, param in accelerator.unwrap_model(model).named_parameters(remove_duplicate=False):
        if not param.requires_grad or not name.startswith(prefix):
            continue
        if id(param) not in by_param:
            full = safe_get_full_fp32_param(param)  # the main process keeps it: a 7B model is 28 GB in float32
            by_param[id(param)] = full.detach().cpu() if full is not None and accelerator.is_main_process else None
        if by_param[id(param)] is not None:
            masters[name] = by_param[id(param)]
    return masters


def add_lora(model, args):
    """(--lora-r) LoRA through peft: the model's weights frozen, rank-r adapters A (random) and B (zeros) beside each
    target module, so training starts from the model itself. Without --lora-r, the model as it is."""
    if not args.lora_r:
        return model
    try:
        import peft
    except ImportError:
        raise SystemExit("error: --lora-r needs peft: pip install -e '.[peft]'") from None
    problem = lora_rank_problem(model, args.lora_r, args.lora_target_modules)
    if problem:
        raise SystemExit(problem)
    config = peft.LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=args.lora_target_modules or "all-linear",
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:  # a target module the model does not have
        raise SystemExit(f"error: --lora-target-modules {args.lora_target_modules}: {str(e).splitlines()[0]}") from None


def lora_rank_problem(model, r: int, targets) -> str | None:
    """The one-line error of a LoRA rank above the size of a layer it adapts, or None: a rank-r adapter of a layer
    whose smaller side is d < r is a full-rank update at the cost of r (a rank of 100000 on 192-wide layers ran 500
    times slower). The layers: the Linear modules named by `targets`, or with "all-linear" every Linear but the output
    head (peft's rule)."""
    vocab = getattr(model.config, "vocab_size", None)
    sizes = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        chosen = leaf in targets if targets else module.out_features != vocab and leaf not in ("lm_head", "score")
        if chosen:
            sizes.append((min(module.in_features, module.out_features), name))
    if sizes and r > min(sizes)[0]:
        d, name = min(sizes)
        return (
            f"error: --lora-r {r} is above the size of a layer it adapts ({name}: {d}); give a rank of at most {d} "
            "(LoRA ranks are usually 8-64), or leave --lora-r out to train every weight"
        )
    return None


class LoraReference(torch.nn.Module):
    """(LoRA) the reference policy: the policy's own frozen weights, its adapters disabled for each forward pass, so
    no second copy of the model is loaded (TRL and OpenRLHF do the same)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = [policy]  # a list, not a submodule: nothing to prepare, save or count twice
        self.config = policy.config

    def parameters(self, recurse: bool = True):  # the policy's: code reads their device and dtype
        return self.policy[0].parameters(recurse)

    def forward(self, *args, **kwargs):
        with self.policy[0].disable_adapter():
            return self.policy[0](*args, **kwargs)


def merge_lora(state_dict: dict, config) -> dict:
    """(LoRA) peft's weights as the plain model's: each adapted weight W + (alpha / r) B A, peft's names removed, so
    that `model/` loads without peft (the next stage, evaluation, vLLM)."""
    scale, merged = config.lora_alpha / config.r, {}
    for key, w in state_dict.items():
        name = key.removeprefix("base_model.model.")
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            if leaf == "weight":
                a, b = (state_dict[f"base_model.model.{module}.lora_{x}.default.weight"].float() for x in "AB")
                delta = scale * (b @ a)
                w = (w.float() + (delta.T if config.fan_in_fan_out else delta)).to(w.dtype)
            name = f"{module}.{leaf}"
        merged[name] = w
    return merged


def shard_length(n: int, accelerator: Accelerator) -> int:
    """Rows of `n` that `split_between_processes` gives this process before any padding (the first `n % processes`
    ranks take one more). The padded rows repeat the last row at the end of each shorter shard, of every such rank."""
    per_process, extra = divmod(n, accelerator.num_processes)
    return per_process + (accelerator.process_index < extra)


def global_count(count: float, accelerator: Accelerator) -> float:
    """`count` (the tokens, pairs or sequences of this process's mini-batch) summed over all processes: the
    denominator of a mean over the whole mini-batch, so the gradient does not depend on how the batch is split."""
    if accelerator.num_processes == 1:
        return float(count)
    return accelerator.reduce(torch.tensor(float(count), device=accelerator.device), "sum").item()


def peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


@torch.no_grad()
def cache_reference_logprobs(
    ref_policy, items: list[dict], pad_id: int, args, accelerator: Accelerator, forward_logprobs
) -> None:
    """Reference logprobs of every preference pair (the script's `forward_logprobs(model, batch)`), computed once and
    stored in the pairs as `ref_chosen` / `ref_rejected` (each process takes a shard, all get the union; under ZeRO-3
    the shards are padded to equal size, every forward pass being a collective, and a padded duplicate rewrites a
    value)."""
    out = []
    with accelerator.split_between_processes(list(range(len(items))), apply_padding=sharded(accelerator)) as shard:
        for start in range(0, len(shard), args.per_device_eval_batch_size):
            idx = shard[start : start + args.per_device_eval_batch_size]
            batch = {
                k: v.to(accelerator.device)
                for k, v in collate_preference_pairs([items[i] for i in idx], pad_id, args.pack_pairs).items()
            }
            with accelerator.autocast():  # the training precision (bf16 mixed precision: as the policy computes)
                chosen, rejected = forward_logprobs(ref_policy, batch)
            out.extend(zip(idx, chosen.tolist(), rejected.tolist()))
    for i, c, r in gather_object(out):
        items[i]["ref_chosen"], items[i]["ref_rejected"] = c, r


def split_cpu_threads(
    accelerator: Accelerator, num_threads: int | None, generation_threads: int | None, generator_thread: bool
) -> tuple[int, int | None]:
    """On CPU, this process's torch threads (one BLAS pool per process, or the processes fight over cores); with a
    `generator_thread` (asynchronous sampling), the learner and the generator thread split the process's share (the
    generator's count is returned for that thread to set). Returns (learner threads, generator threads or None)."""
    threads = num_threads or cpu_threads(accelerator.num_processes)
    gen_threads = None
    if accelerator.device.type == "cpu":
        if generator_thread:
            gen_threads = generation_threads or max(1, threads // 2)
            threads = max(1, threads - gen_threads)
        torch.set_num_threads(threads)
    return threads, gen_threads


def mean_over_processes(records: list[dict], accelerator: Accelerator) -> dict[str, float]:
    """Scalar tensors by name, one dict per micro-batch: each name's mean over the micro-batches and processes."""
    names = list(records[0])
    means = torch.stack([torch.stack([r[k] for k in names]) for r in records]).mean(0)
    return dict(zip(names, accelerator.gather(means[None]).mean(0).tolist()))
