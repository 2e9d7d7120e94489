"""Where a training step's time goes: each phase's seconds, for our script and for TRL's trainer on the same work.

    CLEAN_RLHF_PHASES=DIR python -m benchmark.tools.speed --algos ppo rm --steps 8   # both sides; DIR/phases.md
    python -m benchmark.tools.phases OUT.json SCRIPT [ARGS...]                       # our side alone

How: a line timer. `sys.settrace` is told about every Python call, but traces lines only in the functions of TRACED
(our script's `main` and its training helpers; TRL's `train` or the HF Trainer's inner loop and its step). Each traced
line is charged the wall-clock time from its start to the next traced line: the calls it makes into untraced code
(torch, transformers, a helper's body) are inside its time, a traced callee's lines are charged to themselves and not
to the line that called it, so no second is counted twice. Each line then goes to one phase of PHASES by what its
statement calls (RULES: the first pattern that matches the statement's source text), else by the loop or block it
sits in, else its function's default; lines outside the training loop are `setup` or `evaluation`, which the
table leaves out (benchmark.tools.speed's training seconds leave them out too). The tracing costs about a
microsecond per Python call, on both sides alike; the table's shares are of the traced loop's time.
"""

from __future__ import annotations

import ast
import atexit
import inspect
import json
import re
import runpy
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path

PHASES = (
    "sampling",
    "policy logprobs (rollout)",
    "value forward (rollout)",
    "reference forward",
    "reward forward",
    "rewards, GAE, whitening",
    "data (batches, collation)",
    "training forward and loss",
    "backward",
    "gradient clipping",
    "optimizer",
    "statistics, logging and the rest",
)
"""the rows of the table; `setup` and `evaluation` are measured but left out of it"""
OTHER = "statistics, logging and the rest"

# per traced function: (line rules: pattern on the statement -> phase, block rules: pattern on an enclosing compound
# statement's header -> phase, default). The training loop's header (`loop`) marks what is setup: every line outside it.
PPO_OURS = {
    "loop": r"^for update in progress",
    "lines": [
        (r"sample_or_stop\(", "sampling"),
        (r"model\(\*\*inputs", "value forward (rollout)"),  # with the policy's when its logprobs are not the sampler's
        (r"response_logprobs\(logits|logits_entropy\(logits", "policy logprobs (rollout)"),
        (r"reference_logits\(|ref_logits", "reference forward"),
        (r"packed_outcome_reward\(|process_rewards\(|success_reward\(", "reward forward"),
        (r"kl_penalty\(|per_token_rewards\(|compute_gae\(|masked_whiten\(", "rewards, GAE, whitening"),
        (r"clip_grad_norm_\(", "gradient clipping"),
        (r"optimizer\.(step|zero_grad)\(", "optimizer"),
        (r"evaluate\(", "evaluation"),
    ],
}
PPO_MICRO = {"lines": [(r"backward\(", "backward")], "default": "training forward and loss"}
RM_OURS = {
    "loop": r"^for epoch in range",
    "lines": [
        (r"micro_batch_loss\(model, batch", "training forward and loss"),
        (r"backward\(", "backward"),
        (r"clip_grad_norm_\(", "gradient clipping"),
        (r"optimizer\.(step|zero_grad)\(|scheduler\.step\(", "optimizer"),
        (r"evaluate_reward_model\(", "evaluation"),
        (r"^for micro in step_micro_batches|^for batch in micro", "data (batches, collation)"),
    ],
}
PPO_TRL = {
    "loop": r"^for update in range",
    "lines": [
        (r"batch_generation\(", "sampling"),
        (r"selective_log_softmax\(logits, response\)", "policy logprobs (rollout)"),
        (r"forward\((ref_policy|model\.policy), query_response|selective_log_softmax\(ref_logits", "reference forward"),
        (r"get_reward\(\s*unwrapped_value_model", "value forward (rollout)"),
        (r"get_reward\(\s*reward_model", "reward forward"),
        (r"masked_whiten\(|lastgaelam|advantages_reversed|nextvalues|delta = ", "rewards, GAE, whitening"),
        (r"accelerator\.backward\(", "backward"),
        (r"optimizer\.(step|zero_grad)\(", "optimizer"),
        (r"generate_completions\(", "evaluation"),
    ],
    "blocks": [
        (r"^for t in reversed\(range\(gen_length", "rewards, GAE, whitening"),
        (r"^for ppo_epoch_idx", "training forward and loss"),
    ],
}
HF_LOOP = {  # transformers 5's Trainer._run_epoch (RewardTrainer's loop): one iteration per optimizer step
    "loop": r"^for update_step in range",
    "lines": [
        (r"get_batch_samples\(", "data (batches, collation)"),
        (r"clip_grad_norm_\(|_clip_grad_norm\(", "gradient clipping"),
        (r"optimizer\.step\(|lr_scheduler\.step\(|zero_grad\(", "optimizer"),
    ],
}
HF_STEP = {"lines": [(r"accelerator\.backward\(", "backward")], "default": OTHER}
HF_LOSS = {"lines": [], "default": "training forward and loss"}

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def statement_phases(fn, rules: dict) -> dict[int, str]:
    """Each line of `fn`'s source (absolute line numbers) -> its phase under `rules`. A rule set with a `loop` whose
    pattern matches no statement is an error: every line would be `setup`, left out of the table."""
    fn = inspect.unwrap(fn)
    lines, first = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    source = textwrap.dedent("".join(lines)).splitlines()
    out: dict[int, str] = {}
    loop = rules.get("loop")

    def text(node: ast.stmt) -> str:
        if isinstance(node, (ast.For, ast.While, ast.If, ast.With, ast.Try)):
            return source[node.lineno - 1].strip()  # a block's header: the body's lines are their own
        return "\n".join(source[node.lineno - 1 : node.end_lineno]).strip()

    def visit(node: ast.AST, block: str | None, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.stmt) or isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                continue
            t = text(child)
            here = inside or (loop is not None and re.search(loop, t) is not None)
            phase = next((p for pat, p in rules.get("lines", []) if re.search(pat, t)), None)
            if phase is None:
                phase = (block or rules.get("default", OTHER)) if here or loop is None else "setup"
            body = getattr(child, "body", None)
            last = body[0].lineno - 1 if body and isinstance(body[0], ast.stmt) else child.end_lineno or child.lineno
            for ln in range(child.lineno, max(last, child.lineno) + 1):  # a block: its header's lines only
                out.setdefault(first + ln - 1, phase)
            inner = block
            for pat, p in rules.get("blocks", []):
                if re.search(pat, t):
                    inner = p
            visit(child, inner, here)

    visit(tree.body[0], None, False)
    if loop is not None and not any(re.search(loop, line.strip()) for line in source):
        raise ValueError(f"{fn.__qualname__}: no statement matches the loop pattern {loop!r} (its rules are stale)")
    return out


def key(code) -> tuple[str, int]:
    return code.co_filename, code.co_firstlineno


class LineTimer:
    """Charges each traced line the time to the next traced event of its frame, a traced callee's time excluded."""

    def __init__(self, targets: dict):
        # keyed by where the code is, not by the code object: a script run as __main__ compiles its functions again
        # a decorated function (the scripts' `@one_error_line main`) is traced in its own body, not in the wrapper's
        self.phases = {key(inspect.unwrap(fn).__code__): statement_phases(fn, rules) for fn, rules in targets.items()}
        self.stack: list[list] = []  # [code, line, start]

    def _charge(self, now: float) -> None:
        code, line, start = self.stack[-1]
        if line is not None:
            phase = self.phases[code].get(line, OTHER)
            TIMES[phase] += now - start
            CALLS[phase] += 1

    def trace(self, frame, event, arg):
        if event != "call" or key(frame.f_code) not in self.phases:
            return None
        now = time.perf_counter()
        if self.stack:
            self._charge(now)
            self.stack[-1][1] = None  # the caller's line waits for its traced callee
        self.stack.append([key(frame.f_code), None, now])
        return self.local

    def local(self, frame, event, arg):
        now = time.perf_counter()
        if event == "line":
            self._charge(now)
            self.stack[-1][1:] = [frame.f_lineno, now]
        elif event == "return":
            self._charge(now)
            self.stack.pop()
            if self.stack:
                self.stack[-1][1:] = [frame.f_back.f_lineno if frame.f_back else None, time.perf_counter()]
        return self.local

    def install(self) -> None:
        sys.settrace(self.trace)


def write_at_exit(out: str) -> None:
    def write():
        sys.settrace(None)
        Path(out).write_text(json.dumps({"seconds": dict(TIMES), "lines": dict(CALLS)}, indent=1) + "\n")

    atexit.register(write)


def install_ours(out: str, module) -> None:
    """Trace our script's `main` and its training helpers (`module`: the script, imported under its own name)."""
    targets = {}
    if hasattr(module, "ppo_micro_batch"):
        targets = {module.main: PPO_OURS, module.ppo_micro_batch: PPO_MICRO}
    elif hasattr(module, "micro_batch_loss"):
        targets = {module.main: RM_OURS}
    if not targets:
        raise SystemExit(f"error: {module.__file__}: no phase rules for this script (benchmark/tools/phases.py)")
    LineTimer(targets).install()
    write_at_exit(out)


def install_trl(out: str, algo: str) -> None:
    if algo == "ppo":
        from trl.experimental.ppo import PPOTrainer

        targets = {PPOTrainer.train: PPO_TRL}
    elif algo == "rm":
        from transformers import Trainer
        from trl import RewardTrainer

        targets = {Trainer._run_epoch: HF_LOOP, Trainer.training_step: HF_STEP}
        targets[RewardTrainer.compute_loss] = HF_LOSS
    else:
        raise SystemExit(f"error: no phase rules for TRL's {algo} (benchmark/tools/phases.py: ppo, rm)")
    LineTimer(targets).install()
    write_at_exit(out)


def table(rows: dict[str, dict[str, dict]], steps: dict[str, int]) -> str:
    """rows: algo -> side -> its OUT.json; seconds per step of each phase, and each phase's share of the loop."""
    lines = []
    for algo, sides in rows.items():
        lines += [
            f"**{algo}** ({steps[algo]} steps): seconds per step (share of the traced loop)",
            "",
            "| phase | ours | TRL | ours / TRL |",
            "| --- | --- | --- | --- |",
        ]
        totals = {s: sum(v for k, v in d["seconds"].items() if k in PHASES) for s, d in sides.items()}
        for phase in PHASES:
            cells = []
            for side in ("ours", "trl"):
                s = sides.get(side, {}).get("seconds", {}).get(phase, 0.0)
                share = s / totals[side] if totals.get(side) else 0.0
                cells.append(f"{s / steps[algo]:.3f} ({share:.0%})")
            o, t = (sides.get(x, {}).get("seconds", {}).get(phase, 0.0) for x in ("ours", "trl"))
            ratio = f"{o / t:.2f}" if t > 0 and o > 0 else "-"
            lines.append(f"| {phase} | {cells[0]} | {cells[1]} | {ratio} |")
        o, t = totals.get("ours", 0.0), totals.get("trl", 0.0)
        lines.append(f"| **the loop** | {o / steps[algo]:.3f} | {t / steps[algo]:.3f} | {o / t if t else 0:.2f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]) or len(sys.argv) < 3:
        print(f"usage: python -m benchmark.tools.phases OUT.json SCRIPT [ARGS...]\n\n{__doc__}")
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    out, script = sys.argv[1], Path(sys.argv[2]).resolve()
    sys.argv = sys.argv[2:]
    sys.path.insert(0, str(script.parent))
    import importlib

    module = importlib.import_module(script.stem)  # its functions, which `main` looks up by name as it runs
    install_ours(out, module)
    runpy.run_path(str(script), run_name="__main__")
