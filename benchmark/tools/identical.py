"""Whether two sets of runs computed the same numbers: `python -m benchmark.tools.identical RUNS_A RUNS_B`.

For a change that should change no number (a refactor, a speed-up): run the same suite before and after it on one
machine, then compare the two `runs/` folders. Every run directory present in both (one holding `metrics.jsonl`) must
have the same `metrics.jsonl` rows (wall-clock and speed fields aside: `time` and `perf/*`), the same `config.json`
contents (key order aside; a key one side lacks equals None or False, a flag added off; the output folder is not a
result: `output_dir`, and a path inside it, such as an earlier stage's model, count relative to it) and bit-identical
tensors in `model/*.safetensors`. `--added KEY...` names metrics the change added: a key of those that the after
side logs in a row where the before side has none is left out (a new logged number is not a changed one); every
other key of every row still counts. A damaged metrics.jsonl or config.json is one `error:` line naming it, the line
every tool gives it (benchmark/runfiles.py).
Prints one line a run, `same` or what differs first, and exits 1 when any run differs or is missing from one side.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from benchmark import runfiles

SPEED = ("time",)  # and every `perf/` key: wall-clock and throughput differ between any two runs


def metric_rows(run: Path) -> list[dict]:
    """The run's metrics rows through the one checked reader (benchmark/runfiles.py: damage is its `error:` line; a
    torn last row is dropped and said), wall-clock and speed fields left out."""
    metrics = runfiles.read_metrics(run / "metrics.jsonl")
    if metrics.torn:
        print(f"warning: {metrics.torn}", file=sys.stderr)
    return [{k: v for k, v in r.items() if k not in SPEED and not k.startswith("perf/")} for r in metrics.rows]


def without_output_dir(config: dict) -> dict:
    """`config` with its output folder (`output_dir`) left out, and each path inside it (`runs_a/sft__1/model`, an
    earlier stage's model) made relative to it: two runs of one command into two folders computed the same."""
    root = config.get("output_dir")
    if not isinstance(root, str) or not root:
        return config
    root = root.rstrip("/")
    out = {}
    for k, v in config.items():
        if k == "output_dir":
            continue
        if isinstance(v, str) and (v == root or v.startswith(root + "/")):
            v = "<output_dir>" + v[len(root) :]
        out[k] = v
    return out


def tensor_digests(run: Path) -> dict[str, str]:
    """name -> dtype, shape and sha256 of the bytes of every tensor of every `model/*.safetensors` file."""
    out = {}
    for path in sorted((run / "model").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                out[name] = f"{t.dtype}{tuple(t.shape)}:{hashlib.sha256(raw).hexdigest()}"
    return out


def first_difference(a: Path, b: Path, added: tuple[str, ...] = ()) -> str | None:
    """None when the two runs computed the same numbers, else what differs first; `added`: metrics the change added,
    left out of the after side's rows where the before side's row lacks them."""
    rows_a, rows_b = metric_rows(a), metric_rows(b)
    rows_b = [{k: v for k, v in y.items() if k in x or k not in added} for x, y in zip(rows_a, rows_b)] + rows_b[
        len(rows_a) :
    ]
    for i, (x, y) in enumerate(zip(rows_a, rows_b)):
        if x != y:
            key = next((k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)), "?")
            return f"metrics.jsonl row {i + 1} (step {x.get('step')}): {key} {x.get(key)!r} != {y.get(key)!r}"
    if len(rows_a) != len(rows_b):
        return f"metrics.jsonl has {len(rows_a)} rows against {len(rows_b)}"
    configs = [runfiles.read_object(r / "config.json") if os.path.lexists(r / "config.json") else None for r in (a, b)]
    configs = [c if c is None else without_output_dir(c) for c in configs]
    # a flag added since (`--dual-clip`, `--use-vllm`, ...) is off at None or False: the runs before it, which lack
    # the key, ran the same
    configs = [c if c is None else {k: v for k, v in c.items() if v is not None and v is not False} for c in configs]
    if configs[0] != configs[1]:
        keys = sorted(set(configs[0] or {}) | set(configs[1] or {}))
        key = next(k for k in keys if (configs[0] or {}).get(k) != (configs[1] or {}).get(k))
        return f"config.json: {key} {(configs[0] or {}).get(key)!r} != {(configs[1] or {}).get(key)!r}"
    weights_a, weights_b = tensor_digests(a), tensor_digests(b)
    for r, w, other in ((a, weights_a, weights_b), (b, weights_b, weights_a)):
        if other and not w:  # a model one side lacks is not a model whose every tensor differs
            return f"{r.name}: no model/*.safetensors in {r.parent} (the other side has {len(other)} tensors)"
    if weights_a != weights_b:
        names = sorted(n for n in set(weights_a) | set(weights_b) if weights_a.get(n) != weights_b.get(n))
        return f"model/: {len(names)} tensors differ, e.g. {names[0]}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="a runs/ folder (or one run directory)")
    parser.add_argument("after", type=Path, help="the runs/ folder to compare it with")
    parser.add_argument(
        "--added", nargs="+", default=(), help="metrics the change added (objective/token_entropy): not a difference"
    )
    a = parser.parse_args(argv)
    for root in (a.before, a.after):
        if not root.is_dir():
            raise SystemExit(f"error: {root} is not a directory")

    def runs(root: Path) -> dict[str, Path]:
        if runfiles.is_run_dir(root):
            return {root.name: root}
        return {p.name: p for p in sorted(root.iterdir()) if runfiles.is_run_dir(p)}

    before, after = runs(a.before), runs(a.after)
    if not before:
        raise SystemExit(f"error: {a.before} holds no run directory (none has a metrics.jsonl)")
    bad = 0
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            print(f"missing {name}: only in {a.before if name in before else a.after}")
            bad += 1
            continue
        difference = first_difference(before[name], after[name], tuple(a.added))
        print(f"same    {name}" if difference is None else f"differs {name}: {difference}")
        bad += difference is not None
    print(f"{len(set(before) | set(after)) - bad} of {len(set(before) | set(after))} runs the same")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
