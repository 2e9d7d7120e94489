"""Time the generation calls of one side of `benchmark.tools.speed`, to split a step into generation and the rest.

    python -m benchmark.tools.gen_timer OUT.json SCRIPT [ARGS...]   # our script, as `python SCRIPT ARGS...` runs it

Ours: wraps clean_rlhf_utils.generation's samplers (`sample_with_kv_cache`: grpo_math.py; `sample_responses`:
ppo_rlhf.py, rloo.py, remax.py) before the script imports them. TRL: `install_trl(OUT)` wraps GRPOTrainer._generate
(TRL 1.16) and the experimental PPO trainer's `batch_generation` (TRL 1.12). Each call's seconds (after a CUDA
synchronize on both ends, so a GPU's queued work is counted where it runs) and its number of prompts go to OUT.json
when the process exits; ours also its decoding steps and the contexts it read (`decoded`: the bytes it moved,
benchmark.tools.limits.decode_bytes). The wrappers only time: every argument and result passes through unchanged.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import runpy
import sys
import time
from pathlib import Path

CALLS: list[dict] = []


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _size(args: tuple, kwargs: dict) -> int:
    """The number of prompts of a sampler call: its first argument after the model (a list or a batch tensor)."""
    for x in (*args[1:2], kwargs.get("prompts"), kwargs.get("queries")):
        if x is not None and hasattr(x, "__len__"):
            return len(x)
    return -1


def decoded(fn, args: tuple, kwargs: dict, result) -> dict:
    """Of one call of our samplers: `steps`, the decoding steps (the longest completion), and `contexts`, the sum
    over the rows of the context before each token decoded (benchmark.tools.limits.decode_bytes). Empty when the
    call's shapes are not those of `sample_with_kv_cache` / `sample_responses`."""
    from benchmark.tools.limits import row_contexts

    bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    if "prompts" in bound:  # sample_with_kv_cache: token lists in, token lists out
        prompts, lengths = [len(p) for p in bound["prompts"]], [len(c) for c in result[0]]
    elif "queries" in bound:  # sample_responses: left-padded queries, responses PAD after the first EOS
        prompts = bound["qmask"].sum(1).tolist()
        lengths = (result[0] != bound["pad_id"]).sum(1).tolist()
    else:
        return {}
    return {"steps": max(lengths, default=0), "contexts": row_contexts(prompts, lengths)}


def timed(fn, size=_size, shapes=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _sync()
        start = time.perf_counter()
        result = None
        try:
            result = fn(*args, **kwargs)
            return result
        finally:
            _sync()
            call = {"seconds": time.perf_counter() - start, "prompts": size(args, kwargs)}
            if shapes is not None and result is not None:
                call.update(shapes(fn, args, kwargs, result))
            CALLS.append(call)

    return wrapper


def write_calls(out: str) -> None:
    """OUT.json with the calls so far; its folder is made if missing (an exception at exit would only be printed)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"calls": CALLS}) + "\n")


def write_at_exit(out: str) -> None:
    atexit.register(write_calls, out)


def install_ours(out: str) -> None:
    from clean_rlhf_utils import generation

    for name in ("sample_with_kv_cache", "sample_responses"):
        setattr(generation, name, timed(getattr(generation, name), shapes=decoded))
    write_at_exit(out)


def install_trl(out: str) -> None:
    try:
        from trl import GRPOTrainer

        GRPOTrainer._generate = timed(GRPOTrainer._generate, size=lambda a, k: len(a[1]))
    except (ImportError, AttributeError):
        pass
    try:
        from trl.experimental.ppo import ppo_trainer

        ppo_trainer.batch_generation = timed(ppo_trainer.batch_generation, size=lambda a, k: len(a[1]))
    except (ImportError, AttributeError):
        pass
    write_at_exit(out)


def generation_calls(path: Path, min_prompts: int) -> list[dict]:
    """The calls with more than `min_prompts` prompts: the training loop's sampling, not the evaluation's."""
    return [c for c in json.loads(path.read_text())["calls"] if c["prompts"] > min_prompts]


def generation_seconds(path: Path, min_prompts: int) -> tuple[float, int]:
    """(seconds, calls) of the calls with more than `min_prompts` prompts: the training loop's sampling, not the
    evaluation's (benchmark.tools.speed evaluates 8 prompts)."""
    calls = generation_calls(path, min_prompts)
    return sum(c["seconds"] for c in calls), len(calls)


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(f"usage: python -m benchmark.tools.gen_timer OUT.json SCRIPT [ARGS...]\n\n{__doc__}")
        sys.exit(0)
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m benchmark.tools.gen_timer OUT.json SCRIPT [ARGS...]")
    out, script = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    install_ours(out)
    runpy.run_path(script, run_name="__main__")
