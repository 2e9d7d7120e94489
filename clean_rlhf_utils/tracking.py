"""What produced a run and where its numbers are mirrored: the run's name (after its script's file), `provenance.json`
(the commit, the script and its hash, the library versions, the host) and Weights & Biases (`--track`). `runs.Run`
calls them, and `args.check_flags` a fork's PARENT line (`check_parent`); nothing here changes a number."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import secrets
import subprocess
import sys
from pathlib import Path

import torch

PROVENANCE_PACKAGES = ("torch", "transformers", "accelerate", "datasets", "peft", "deepspeed", "trl", "vllm", "wandb")


# The library's own scripts keep the run names their presets spelled before names followed the file name (issue 49):
# the presets' model paths, the benchmark and the docs name them. A label per script, a hub preset's first `-` as `_`
# (`rloo_tldr_pythia-1b`), and four presets of their own; any other file writes `<file name>_<preset>`.
LIBRARY_LABELS = {
    "sft": "sft",
    "reward_model": "rm",
    "ppo_rlhf": "ppo",
    "rloo": "rloo",
    "remax": "remax",
    "grpo_math": "grpo",
    "dpo": "dpo",
}
LIBRARY_NAMES = {
    ("reward_model", "tiny-math-prm"): "prm_tiny-math",
    ("dpo", "tldr-pythia-1b-online"): "online_dpo_tldr_pythia-1b",
    ("dpo", "tiny-tldr-online"): "online_dpo_tiny-tldr",
    ("dpo", "tiny-tldr-noisy-online"): "online_dpo_tiny-tldr-noisy",
}


def script_path(args) -> Path:
    """The file of the script whose `Args` these are: the one started (`python X.py`, `accelerate launch X.py`) or the
    module a test imported."""
    return Path(getattr(sys.modules.get(type(args).__module__), "__file__", None) or sys.argv[0]).resolve()


def exp_name(script: Path, preset: str | None) -> str:
    """The default `--exp-name`: the script's file name and the preset, `<script>_<preset>` (a copy saved as
    `rloo_batchmean.py` writes `runs/rloo_batchmean_tiny-tldr__1`), or the file name alone without a preset; the
    library's own scripts keep their names (LIBRARY_NAMES)."""
    name = script.stem
    if name not in LIBRARY_LABELS:
        return f"{name}_{preset}" if preset else name
    if preset is None:
        return LIBRARY_LABELS[name]
    tail = preset if preset.startswith("tiny") else preset.replace("-", "_", 1)  # a hub preset: tldr_pythia-1b
    return LIBRARY_NAMES.get((name, preset), f"{LIBRARY_LABELS[name]}_{tail}")


def provenance(script: Path | None = None) -> dict:
    """What produced a run (Open RL Benchmark's point: a curve compares only with runs of the same code, libraries and
    machine): the git commit of this checkout and whether its tracked files had uncommitted changes or the script is
    not the committed one (None outside a git checkout), the script itself (`script_record`), the versions of the
    libraries a result depends on (those installed), and the host."""
    repo, git = Path(__file__).resolve().parent.parent, {"commit": None, "dirty": None}
    mine = script_record(script, repo) if script is not None else None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            changes = ["git", "status", "--porcelain", "--untracked-files=no"]
            status = subprocess.run(changes, cwd=repo, capture_output=True, text=True, timeout=10)
            changed = mine is not None and mine["git"] in ("modified", "untracked")  # a fork is not the commit's code
            git = {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) or changed}
    except (OSError, subprocess.TimeoutExpired):
        pass
    versions = {}
    for name in PROVENANCE_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    cpu, flags = platform.processor() or platform.machine(), None
    if Path("/proc/cpuinfo").exists():  # Linux: the model name and flags, which platform does not give
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name") and ":" in line]
        cpu = models[0] if models else cpu
        first = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags") and ":" in line), [])
        flags = sorted(set(first) & NUMERIC_CPU_FLAGS)
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    host = {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpus, "python": platform.python_version()}
    return {"git": git, "script": mine, "versions": versions, "host": {**host, **numerics(flags)}}


# The CPU's vector instructions that change how torch and its BLAS round (wider vectors, fused multiply-add, another
# reduction order): two hosts whose sets differ do not give the same digits, and RL turns a last digit into another run
NUMERIC_CPU_FLAGS = {"avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni"}
NUMERIC_CPU_FLAGS |= {"amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "asimd", "sve", "sve2"}  # AMX; Arm
# environment variables that choose the kernels, and so the rounding: `ATEN_CPU_CAPABILITY=default` is a second
# rounding regime on one machine (docs/results.md)
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")


def numerics(cpu_flags: list[str] | None) -> dict:
    """What sets the rounding of a run on this host: the CPU's vector flags (`cpu_flags`), the kernels torch
    dispatches to (`cpu_capability`: DEFAULT, AVX2, AVX512, ...; ATEN_CPU_CAPABILITY lowers it), its BLAS, its intra-op
    threads (a reduction split another way), and the environment variables that choose among them."""
    blas = next((part.split("=", 1)[1] for part in torch.__config__.show().split(", ") if "BLAS_INFO=" in part), None)
    return {
        "cpu_flags": cpu_flags,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": blas,
        "threads": torch.get_num_threads(),
        "numerics_env": {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ},
    }


def _imported() -> tuple[Path, str] | None:
    """The running script (`__main__`) and the sha256 of its bytes when this module was imported, at the script's
    own start: what the run's records name, whatever happens to the file while it runs."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        return (Path(main).resolve(), hashlib.sha256(Path(main).read_bytes()).hexdigest()) if main else None
    except OSError:
        return None


IMPORTED = _imported()


def script_record(script: Path, repo: Path | None = None) -> dict:
    """The script that ran: its path relative to the checkout, or for a fork kept elsewhere (`~/experiments/x.py`) its
    file name only with `outside: true` (a record names no folder of the user's machine), the sha256 of its bytes, and
    what git says of it: `tracked` (the committed file), `modified` (uncommitted changes), `untracked` (a copy git
    does not know, ignored or outside the checkout), or None outside a git checkout. The sha256 is of the bytes the
    running script imported (IMPORTED) where `script` is it, with `edited_while_running` (the sha256 of the file at
    the time of the record) when the file changed since."""
    repo = repo or Path(__file__).resolve().parent.parent
    script = script.resolve()
    in_checkout = script.is_relative_to(repo)
    path = script.relative_to(repo) if in_checkout else Path(script.name)
    state = None
    try:
        ask = ["git", "status", "--porcelain", "--ignored", "--", str(script)]
        out = subprocess.run(ask, cwd=repo, capture_output=True, text=True, timeout=10)
        inside = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, timeout=10).returncode == 0
        if inside:
            code = out.stdout[:2] if out.returncode == 0 else "??"  # a path outside the checkout: git refuses it
            state = "tracked" if not code.strip() else "untracked" if code in ("??", "!!") else "modified"
    except (OSError, subprocess.TimeoutExpired):
        pass
    now = hashlib.sha256(script.read_bytes()).hexdigest()
    ran = IMPORTED[1] if IMPORTED and IMPORTED[0] == script else now  # the bytes this process imported
    record = {"path": str(path), "sha256": ran, "git": state}
    if ran != now:  # the file was edited while it ran: the suite runs it again (benchmark/launch.py script_change)
        record["edited_while_running"] = now
    record = record if in_checkout else {**record, "outside": True}
    parent = fork_parent(script, repo)
    return {**record, "parent": parent} if parent else record


PARENT_LINE = re.compile(r"""^PARENT\s*(?::\s*str\s*)?=\s*["']([^"'\n]*)["']""", re.MULTILINE)
"""a fork's module-level `PARENT = "rloo"` line"""
CLOSER_BY = 0.1
"""(`check_parent`) a fork that shares this much more of its lines with another library script than with the one its
PARENT line names was copied from that other one"""


def declared_parent(text: str) -> str | None:
    """The script a fork's `PARENT = "rloo"` line names, as benchmark/study.py reads it (`"rloo.py"` is `rloo`), or
    None without such a line."""
    declared = PARENT_LINE.search(text)
    return Path(declared.group(1)).stem if declared else None


def check_parent(script: Path, repo: Path | None = None) -> None:
    """A fork that runs names the library script it was copied from in its PARENT line (its records, its study family
    and its fork check are that script's), checked before anything loads (`args.check_flags`); else one `error:` line,
    as benchmark/study.py refuses it: a name that is no library script of this checkout, or the wrong one, where the
    fork shares CLOSER_BY more of its lines with another library script (difflib's ratio, the study's measure). A
    script without the line, or the library's own, is left alone."""
    repo = repo or Path(__file__).resolve().parent.parent
    try:
        text = script.read_text(errors="replace")
    except OSError:  # no file (an interactive session's class): nothing to check
        return
    name = declared_parent(text)
    if name is None or (script.resolve() == (repo / f"{name}.py").resolve()):
        return
    scripts = [s for s in LIBRARY_LABELS if (repo / f"{s}.py").is_file()]
    given = PARENT_LINE.search(text).group(1)
    if name not in scripts:
        raise SystemExit(
            f"error: {script.name}: PARENT = {given!r} names no script of this checkout (one of {', '.join(scripts)}): "
            "name the script it was copied from"
        )
    lines = text.splitlines()

    def share(lib: str) -> float:
        source = (repo / f"{lib}.py").read_text(errors="replace").splitlines()
        return difflib.SequenceMatcher(None, source, lines, autojunk=False).ratio()

    own = share(name)
    if own + CLOSER_BY >= 1:  # no other script can share more
        return
    best, closest = max((share(s), s) for s in scripts if s != name)
    if best > own + CLOSER_BY:
        raise SystemExit(
            f"error: {script.name}: PARENT = {given!r}, but it shares {own:.0%} of its lines with {name}.py and "
            f"{best:.0%} with {closest}.py: name the script it was copied from (PARENT = {closest!r}?)"
        )


def fork_parent(script: Path, repo: Path) -> dict | None:
    """A fork's parent (its module-level `PARENT = "rloo"`, a script of this checkout): its name, its sha256 and the
    lines the fork adds and removes against it, so that a curve names the code it came from; None otherwise."""
    declared = declared_parent(script.read_text(errors="replace"))
    source = repo / f"{declared}.py" if declared else None
    if source is None or not source.is_file() or source.resolve() == script.resolve():
        return None
    diff = difflib.unified_diff(source.read_text().splitlines(), script.read_text().splitlines(), lineterm="", n=0)
    changed = [line[0] for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    sha = hashlib.sha256(source.read_bytes()).hexdigest()
    return {"name": source.stem, "sha256": sha, "added": changed.count("+"), "removed": changed.count("-")}


def record_provenance(run_dir: Path, resumed: bool, script: Path | None = None) -> None:
    """`provenance.json` of a run: what started it (`script`: the file that ran), and what each `--resume` continued
    it with."""
    # the command too: an unfinished run (no done.json) can still be checked against the library's early updates
    path, now = run_dir / "provenance.json", {**provenance(script), "argv": sys.argv[1:]}
    record = json.loads(path.read_text()) if resumed and path.exists() else {"started": now, "resumed": []}
    if resumed:
        record.setdefault("resumed", []).append(now)
    tmp = path.with_name("provenance.json.tmp")  # written whole, then renamed: a reader never sees half of it
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def start_wandb(args, run_dir: Path):
    """(--track) The run mirrored to Weights & Biases: every row of metrics.jsonl under the same names and steps, the
    arguments as its config. The wandb run id is made here and kept in `wandb_id`, so `--resume` continues the same
    wandb run (wandb 0.31 dropped the `wandb.util.generate_id` this used). `WANDB_MODE=offline` tracks without network
    (`wandb sync` uploads later). A failure to start is a one-line error."""
    try:
        import wandb
    except ImportError:
        raise SystemExit("error: --track needs the wandb package: pip install 'wandb>=0.31,<0.32'") from None
    id_file = run_dir / "wandb_id"
    script = script_path(args)
    family = (fork_parent(script, Path(__file__).resolve().parent.parent) or {}).get("name", script.stem)
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)  # 8 characters, as wandb's
    try:
        run = wandb.init(
            project=args.wandb_project,
            entity=args.wandb_entity,
            name=args.run_name,
            group=family,  # a fork's runs beside its parent's: filter variants in wandb as the local tools do
            tags=[script.stem],
            id=run_id,
            resume="allow",
            config=dataclasses.asdict(args),
            dir=str(run_dir),
        )
    except Exception as e:  # no network, no login, a bad entity: wandb's own message, on one line
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise SystemExit(
            f"error: --track: wandb did not start ({why}); log in (`wandb login`), set WANDB_MODE=offline to "
            "track without network, or drop --track"
        ) from None
    id_file.write_text(run_id)
    return run
