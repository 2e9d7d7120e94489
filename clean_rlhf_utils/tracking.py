"""What produced a run and where its numbers are mirrored: `provenance.json` (the commit, the library versions, the
host) and Weights & Biases (`--track`). `runs.Run` calls them; nothing here changes a number."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import secrets
import subprocess
from pathlib import Path

import torch

PROVENANCE_PACKAGES = ("torch", "transformers", "accelerate", "datasets", "peft", "deepspeed", "trl", "vllm", "wandb")


def provenance() -> dict:
    """What produced a run (Open RL Benchmark's point: a curve compares only with runs of the same code, libraries and
    machine): the git commit of this checkout and whether its tracked files had uncommitted changes (None outside a
    git checkout), the versions of the libraries a result depends on (those installed), and the host."""
    repo, git = Path(__file__).resolve().parent.parent, {"commit": None, "dirty": None}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            changes = ["git", "status", "--porcelain", "--untracked-files=no"]
            status = subprocess.run(changes, cwd=repo, capture_output=True, text=True, timeout=10)
            git = {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        pass
    versions = {}
    for name in PROVENANCE_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():  # Linux: the model name, which platform does not give
        models = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name") and ":" in line
        ]
        cpu = models[0] if models else cpu
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    host = {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpus, "python": platform.python_version()}
    return {"git": git, "versions": versions, "host": host}


def record_provenance(run_dir: Path, resumed: bool) -> None:
    """`provenance.json` of a run: what started it, and what each `--resume` continued it with."""
    path, now = run_dir / "provenance.json", provenance()
    record = json.loads(path.read_text()) if resumed and path.exists() else {"started": now, "resumed": []}
    if resumed:
        record.setdefault("resumed", []).append(now)
    path.write_text(json.dumps(record, indent=2) + "\n")


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
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)  # 8 characters, as wandb's
    try:
        run = wandb.init(
            project=args.wandb_project,
            entity=args.wandb_entity,
            name=args.run_name,
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
