"""Durable runs: the run directory (`runs/<run_name>/`: config.json, metrics.jsonl, samples.jsonl, checkpoint/,
model/, done.json), checkpoints that resume exactly, SIGTERM / SIGINT, the end-of-run marker and the argument checks
every script shares (docs/faults.md; tests/test_faults*.py). Nothing here changes a number: it records and resumes."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, gather_object

from clean_rlhf_utils import ownership
from clean_rlhf_utils.engines import cpu_threads, make_accelerator, save_model
from clean_rlhf_utils.generation import sampled_pairs_to_json


def replace_dir(tmp: Path, final: Path) -> None:
    """Puts the finished directory `tmp` at `final` by renames, so a kill part way leaves the old `final` (or, between
    the two renames, `final.old`, which `Run` puts back) and never a half-written one."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


class Run:
    """runs/<run_name>/: config.json, metrics.jsonl (every row carries `step`, `episode` and `time`, the seconds since
    the start, pauses excluded), samples.jsonl, checkpoint/, model/ and done.json (the budget completed); the metrics
    go to wandb too with `--track`.

    The main process locks the directory for the life of the run (`ownership.take_lock`: a second run of the same
    directory is refused while the first lives). A directory that holds a run is refused unless `--resume` (continue
    from its checkpoint, with the arguments it was started with) or `--overwrite` (delete it and start over; neither
    when a path the run reads lies inside it). On resume `state` is the loop's state at the checkpoint, and the rows
    logged after it (by a run killed before its next checkpoint) are dropped, so the files read as one run. SIGTERM
    and SIGINT only set a flag: the loop finishes its step, checkpoints and exits (`stop_requested`, `stop`); a second
    SIGINT stops at once."""

    def __init__(self, args, accelerator: Accelerator, presets: dict):
        self.args, self.accelerator, self.main = args, accelerator, accelerator.is_main_process
        self.presets = presets  # the script's PRESETS: done.json names the one the command chose
        self.dir = Path(args.output_dir) / args.run_name
        self.state, self.signal, self.wandb, self.file = None, None, None, None
        # one owner per directory, for the whole run: the main process takes the lock before it looks at the directory
        error = ownership.take_lock(self.dir) if self.main else None
        if accelerator.num_processes > 1:  # every process leaves with the main one's error
            error = broadcast_object_list([error])[0]
        if error:
            raise SystemExit(error)
        try:
            self.look_at_directory()
        except BaseException:
            ownership.release_lock(self.dir)
            raise

    def look_at_directory(self) -> None:
        """The used-directory check, under the lock: a used directory needs `--resume` (same arguments) or
        `--overwrite`, and neither may write over a path the run reads."""
        args, accelerator = self.args, self.accelerator
        for name in ("checkpoint", "model"):  # a kill between replace_dir's two renames
            old = self.dir / f"{name}.old"
            if self.main and old.exists() and not (self.dir / name).exists():
                old.rename(self.dir / name)
        accelerator.wait_for_everyone()
        self.held = self.dir.is_dir() and any(self.dir.iterdir())
        if args.resume:
            if (self.dir / "done.json").exists():
                raise SystemExit(
                    f"error: --resume: {self.dir} finished its run (done.json); there is nothing to resume"
                )
            if not (self.dir / "checkpoint" / "state.json").exists():
                raise SystemExit(
                    f"error: --resume: {self.dir} holds no checkpoint; start the run without --resume "
                    "(with --overwrite if the directory is in use)"
                )
            ownership.check_resume_args(args, self.dir)
            self.state = json.loads((self.dir / "checkpoint" / "state.json").read_text())
        elif self.held and not args.overwrite:
            raise SystemExit(
                f"error: {self.dir} already holds a run: pass --resume to continue it, --overwrite to "
                "delete it and start over, or another --run-name"
            )
        if self.held:
            ownership.check_inputs_outside(args, self.dir)
        self.reached = (self.state["step"], self.state["episode"]) if self.state else None  # the last row's counters

    def begin(self) -> None:
        """Called once everything is loaded and checked, just before the first step: only now is an old run deleted."""
        accelerator, args = self.accelerator, self.args
        accelerator.wait_for_everyone()  # every process has looked at the directory before the main one changes it
        if self.main:
            if self.held and not args.resume:
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.dir / "checkpoint.tmp", ignore_errors=True)
            (self.dir / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=2) + "\n")
            record_provenance(self.dir, resumed=self.state is not None)
            last = self.state["step"] if self.state else -1
            for name in ("metrics.jsonl", "samples.jsonl"):  # the rows up to the checkpoint; none on a new run
                path = self.dir / name
                rows = path.read_text().splitlines(keepends=True) if self.state and path.exists() else []
                path.write_text("".join(r for r in rows if r.strip() and json.loads(r)["step"] <= last))
            self.file = open(self.dir / "metrics.jsonl", "a")
            if args.track:
                try:
                    self.wandb = start_wandb(args, self.dir)
                except SystemExit:
                    if not args.resume:  # a new run that never started: no directory left to refuse the next try
                        self.file.close()
                        shutil.rmtree(self.dir)
                    raise
        self.start = time.time() - (self.state["time"] if self.state else 0.0)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        accelerator.wait_for_everyone()

    def on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signal == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.signal = signum
        if self.main:
            print(
                f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint (Ctrl-C again "
                "to stop at once)",
                file=sys.stderr,
                flush=True,
            )

    def log(self, metrics: dict, step: int, episode: int) -> None:
        self.reached = (step, episode)
        if not self.main:
            return
        row = {
            "step": step,
            "episode": episode,
            "time": round(time.time() - self.start, 3),
            **{k: float(v) for k, v in metrics.items()},
        }
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def log_samples(self, records: list[dict], step: int) -> None:
        if self.main:
            with open(self.dir / "samples.jsonl", "a") as f:
                for r in records:
                    f.write(json.dumps({"step": step, **r}) + "\n")

    def any_process(self, flag: bool) -> bool:
        """`flag` or-ed over the processes: a collective, so every process calls it at the same point."""
        if self.accelerator.num_processes == 1:
            return flag
        total = self.accelerator.reduce(torch.tensor(float(flag), device=self.accelerator.device), "sum")
        return total.item() > 0

    def stop_requested(self) -> bool:
        """Whether any process got SIGTERM or SIGINT; every process calls it at the end of every step."""
        return self.any_process(self.signal is not None)

    def all_finite(self, *values: torch.Tensor) -> bool:
        """Whether the losses (or gradient norms) are finite on every process; every process calls it."""
        finite = all(bool(torch.isfinite(torch.as_tensor(v)).all()) for v in values if v is not None)
        return not self.any_process(not finite)

    def checkpoint(self, state: dict) -> Path:
        """checkpoint/: accelerate's state (weights, optimizer, scheduler, every process's RNG) and the loop's `state`
        (step, episode, data position, ...), written to checkpoint.tmp and renamed; every process calls it."""
        tmp, final = self.dir / "checkpoint.tmp", self.dir / "checkpoint"
        if self.main:
            shutil.rmtree(tmp, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        self.accelerator.wait_for_everyone()
        if self.main:
            state = {**state, "time": time.time() - self.start, "num_processes": self.accelerator.num_processes}
            (tmp / "state.json").write_text(json.dumps(state) + "\n")
            replace_dir(tmp, final)
        self.accelerator.wait_for_everyone()
        return final

    def resume(self) -> dict | None:
        """With `--resume`: loads the checkpoint's weights, optimizer, scheduler and RNG states (after `prepare`) and
        returns the loop's state; None on a new run."""
        if self.state is not None:
            if self.state["num_processes"] != self.accelerator.num_processes:
                raise SystemExit(
                    f"error: --resume: {self.dir} was checkpointed by {self.state['num_processes']} "
                    f"processes, not {self.accelerator.num_processes}; resume it with as many"
                )
            self.accelerator.load_state(str(self.dir / "checkpoint"))
            self.accelerator.print(f"resumed {self.dir} after step {self.state['step']}")
        return self.state

    def stop(self, state: dict, error: str | None = None) -> None:
        """Writes a checkpoint and exits with one line: after SIGTERM / SIGINT with the signal's exit code, after a
        failure (`error`, e.g. a non-finite loss) with `error: ...` and code 1. Every process calls it."""
        path = self.checkpoint(state)
        self.close()
        how = f"continue with the same command and --resume (checkpoint: {path})"
        if error:
            raise SystemExit(f"error: {error}; the weights at that point are in {path}")
        signum = self.signal or signal.SIGTERM
        if self.main:
            print(f"stopped by {signal.Signals(signum).name} after step {state['step']}: {how}", file=sys.stderr)
        raise SystemExit(128 + signum)

    def finish(self, model, tokenizer, budget: dict, prefix: str = "") -> None:
        """The end of a run that completed its budget: model/ (with `--save-model`) written to model.tmp and renamed,
        done.json holding the budget (`total_steps`, `total_episodes`), what was trained (`step`, `episode`: the
        counters of the last row the loop logged) and the command, the checkpoint removed, and where it all went."""
        accelerator, args = self.accelerator, self.args
        if args.save_model:
            if self.main:
                shutil.rmtree(self.dir / "model.tmp", ignore_errors=True)
            accelerator.wait_for_everyone()
            # every process (it gathers shards), in the dtype the model was loaded in: --dtype, whatever the engine
            save_model(model, tokenizer, accelerator, self.dir / "model.tmp", prefix, getattr(torch, args.dtype))
            if self.main:
                replace_dir(self.dir / "model.tmp", self.dir / "model")
        if self.main:
            preset = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in self.presets else None
            if self.reached:  # what was trained: the counters of the loop's last row, whatever the arguments say
                budget = {**budget, "step": self.reached[0], "episode": self.reached[1]}
            done = {**budget, "preset": preset, "argv": sys.argv[1:], "time": round(time.time() - self.start, 3)}
            (self.dir / "done.json.tmp").write_text(json.dumps(done, indent=2) + "\n")
            os.replace(self.dir / "done.json.tmp", self.dir / "done.json")
            shutil.rmtree(self.dir / "checkpoint", ignore_errors=True)  # model/ holds the weights
        self.close()
        accelerator.wait_for_everyone()
        accelerator.print(f"run finished: {self.dir}" + (f" (model: {self.dir / 'model'})" if args.save_model else ""))

    def close(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the run is over: the signals act as usual again
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        ownership.release_lock(self.dir)  # the run is over: the directory may have another owner


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


def cli(presets: dict, args: list[str] | None = None, prog: str | None = None):
    """The `Args` of a command line: a preset first, then flags that override it (`python sft.py tiny-tldr
    --learning-rate 3e-4`; `tyro.extras.overridable_config_cli`). A command without a preset, with flags before it,
    or with a preset the script does not have is a one-line error listing the presets (tyro would report the flags
    as "Unrecognized options"). `prog`: the script named in the message (default: the one started)."""
    argv = list(sys.argv[1:] if args is None else args)
    prog, names = prog or Path(sys.argv[0]).name, ", ".join(presets)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        later = next((a for a in argv if a in presets), None)
        moved = f" ({later} is a preset: put it first)" if later else ""
        raise SystemExit(f"error: {prog} needs a preset first: python {prog} PRESET [flags]{moved}; presets: {names}")
    if not argv[0].startswith("-") and argv[0] not in presets:
        raise SystemExit(f"error: {prog} has no preset {argv[0]!r}: python {prog} PRESET [flags]; presets: {names}")
    return tyro.extras.overridable_config_cli(presets, args=argv)


def check_args(args, zero_means_none: tuple[str, ...] = ()) -> None:
    """The flags every script shares, checked before anything loads: a one-line error naming the flag. Counts must be at
    least 1, except those where 0 means none (`zero_means_none`, the script's own, and the ones below); then every
    field's declared range (`args.check_ranges`)."""
    from clean_rlhf_utils.args import check_ranges  # args.py imports this module

    for f in dataclasses.fields(args):
        value, flag = getattr(args, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise SystemExit(f"error: {flag} is {value}; give a finite number")
        positive = f.name.endswith(
            ("batch_size", "_steps", "_epochs", "_length", "_every", "_examples", "_samples", "_episodes", "_k")
        ) or f.name.startswith("num_")
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if positive and is_int and value < 1 and f.name not in ("save_every", "warmup_steps", *zero_means_none):
            raise SystemExit(f"error: {flag} is {value}; it must be at least 1")
    if not args.learning_rate > 0:
        raise SystemExit(f"error: --learning-rate is {args.learning_rate}; it must be above 0")
    if getattr(args, "warmup_ratio", 0.0) < 0 or getattr(args, "warmup_ratio", 0.0) >= 1:
        raise SystemExit(f"error: --warmup-ratio is {args.warmup_ratio}; it must be in [0, 1)")
    if getattr(args, "temperature", 1.0) <= 0:
        raise SystemExit(f"error: --temperature is {args.temperature}; sampling needs a temperature above 0")
    if args.save_every < 0:
        raise SystemExit(f"error: --save-every is {args.save_every}; 0 turns periodic checkpoints off")
    if args.resume and args.overwrite:
        raise SystemExit("error: --resume continues the run in place and --overwrite deletes it; pass one of them")
    if getattr(args, "lora_r", None) is not None and args.lora_r < 1:  # add_lora reads 0 as no LoRA: a silent full run
        raise SystemExit(
            f"error: --lora-r is {args.lora_r}; a LoRA rank must be at least 1 (leave --lora-r out to "
            "train every weight)"
        )
    if not getattr(args, "lora_alpha", 1.0) > 0:
        raise SystemExit(f"error: --lora-alpha is {args.lora_alpha}; it must be above 0 (the adapters' scale)")
    if getattr(args, "dtype", None) == "float16" and not torch.cuda.is_available():  # CPU float16 training diverges
        raise SystemExit("error: --dtype float16 needs a GPU; on CPU use float32 (or bfloat16)")
    check_ranges(args)


def start_run(
    args, presets: dict, sync_with_dataloader: bool = True, zero_means_none: tuple[str, ...] = (), check=None
) -> tuple[Accelerator, Run]:
    """The start of every run, before anything loads: the default run name `{exp_name}__{seed}`, the argument checks
    (`check_args`, then the script's own `check(args)`, if given), the accelerator (`make_accelerator`), one BLAS pool
    per process on CPU (or the processes fight over the cores) and the `Run`, which refuses a used run directory now."""
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}"
    check_args(args, zero_means_none)
    if check is not None:
        check(args)
    accelerator = make_accelerator(args.gradient_accumulation_steps, sync_with_dataloader=sync_with_dataloader)
    if accelerator.device.type == "cpu":
        torch.set_num_threads(args.num_threads or cpu_threads(accelerator.num_processes))
    return accelerator, Run(args, accelerator, presets)


def loop_state(
    step: int, n_running: int, n_micro: int, n_steps: int, running: list | dict, metrics: dict, batch_episodes: int
) -> dict:
    """What a training loop carries between steps, for a checkpoint after `step`: the counters, the last evaluation, and
    every process's running statistics since the last log (`running`: a list of scalar tensors, or a dict of such
    lists or dicts; the first `n_running` of each list), gathered so the main process saves them. Every process calls
    it."""

    def first(values):
        if isinstance(values, dict):
            return {k: first(v) for k, v in values.items()}
        return [v.item() for v in values[:n_running]]

    return {
        "step": step,
        "episode": step * batch_episodes,
        "n_micro": n_micro,
        "n_steps": n_steps,
        "metrics": metrics,
        "running": gather_object([first(running)]),
    }


def dpo_loop_state(step: int, drawn: int, metrics: dict, pending: dict | None, args, accelerator: Accelerator) -> dict:
    """dpo.py's loop state after `step` optimizer steps: the batches drawn so far (replayed on resume), the last
    evaluation, and online the batch already sampled for the next step (`pending`, every process's own, with its
    labels and reference logprobs), which the resumed run trains on as the uninterrupted run would."""
    batch_pairs = args.per_device_train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    return {
        "step": step,
        "episode": step * batch_pairs,
        "drawn": drawn,
        "metrics": metrics,
        "pending": gather_object([sampled_pairs_to_json(pending)]) if args.mode == "online" else None,
    }


def stop_dpo_non_finite(run: Run, what: str, step: int, drawn: int, metrics: dict, data, pending, args) -> None:
    """A non-finite value in dpo.py's step `step`: a checkpoint of the state before it (online: with this step's batch
    `data`, which the resumed run trains on; `pending`: the async generator's next batch, in flight), and out."""
    if pending is not None:
        pending.result()  # the generator thread has drawn and is sampling the next batch: let it finish
    # not replayed: offline this step's micro-batches; async the next step's prompts, drawn already
    before = drawn - (int(pending is not None) if args.mode == "online" else args.gradient_accumulation_steps)
    run.stop(
        dpo_loop_state(step - 1, before, metrics, data, args, run.accelerator),
        f"non-finite {what} at step {step}: lower --learning-rate (now {args.learning_rate:g}) or check the data",
    )


def stop_unless_finite(run: Run, value, state: dict, error: str) -> None:
    """The non-finite guard of a loss or a gradient norm: a checkpoint of `state` and the one-line `error` (`run.stop`)
    when `value` is not finite on some process. A collective: every process calls it at the same point."""
    if not run.all_finite(value):
        run.stop(state, error)


def non_finite_policy(update: int, args) -> str:
    """The error line of a policy whose logits are no longer finite, met by sampling (torch's "probability tensor
    contains either inf, nan or element < 0"): the update before moved the weights too far in one step whose loss and
    gradient were finite (Adam moves each weight by about the learning rate), so the checks before the optimizer step
    could not see it."""
    if update == 1:
        return f"the logits of --sft-model-path {args.sft_model_path} are not finite (inf or nan); nothing to sample"
    return (
        f"the policy's logits are not finite at update {update} (sampling met inf or nan): update {update - 1} "
        f"moved the weights too far; lower --learning-rate (now {args.learning_rate:g}) and start over with "
        "--overwrite"
    )


def sample_or_stop(run: Run, state: dict, error: str, sample, *args, **kwargs):
    """`sample(*args, **kwargs)` (a sampler returning (tokens, logprobs, ...)), or, when the policy's logits are not
    finite on some process (torch.multinomial's "probability tensor contains either inf, nan or element < 0", or
    non-finite logprobs), a checkpoint of `state` and the one-line `error` (`non_finite_policy`). Every process calls
    it."""
    sampled = None
    try:
        sampled = sample(*args, **kwargs)
    except RuntimeError as e:
        if "probability tensor" not in str(e):
            raise
    stop_unless_finite(run, sampled[1] if sampled else torch.tensor(float("nan")), state, error)
    return sampled


def updates_in_budget(args, num_processes: int) -> tuple[int, int]:
    """(the batch over all processes, the updates `--total-episodes` pays for); less than one batch is an error."""
    batch_size = args.per_device_batch_size * num_processes
    num_updates = args.total_episodes // batch_size
    if num_updates == 0:
        raise SystemExit(
            f"error: --total-episodes {args.total_episodes} is less than one batch of {batch_size} "
            f"(--per-device-batch-size {args.per_device_batch_size} x {num_processes} "
            "processes)"
        )
    return batch_size, num_updates


def non_finite_error(what: str, update: int, learning_rate: float, hint: str = "") -> str:
    """The error line of a non-finite loss or gradient norm, for `stop_unless_finite`."""
    return f"non-finite {what} at update {update}: lower --learning-rate (now {learning_rate:g}){hint}"


def batch_sizes(args, accelerator: Accelerator) -> tuple[int, int, int, int, bool]:
    """(minibatch, micro-batch, batch of all processes, updates, separate_backward), or a one-line error."""
    mini_batch_size = args.per_device_batch_size // args.num_mini_batches
    micro_batch_size = mini_batch_size // args.gradient_accumulation_steps
    if micro_batch_size * args.gradient_accumulation_steps * args.num_mini_batches != args.per_device_batch_size:
        raise SystemExit(
            f"error: --per-device-batch-size {args.per_device_batch_size} does not split into "
            f"--num-mini-batches {args.num_mini_batches} x --gradient-accumulation-steps "
            f"{args.gradient_accumulation_steps} equal micro-batches"
        )
    batch_size, num_updates = updates_in_budget(args, accelerator.num_processes)
    separate_backward = (
        args.separate_backward
        if args.separate_backward is not None
        else accelerator.distributed_type == DistributedType.NO
    )
    if separate_backward and accelerator.distributed_type != DistributedType.NO:
        raise SystemExit(
            f"error: --separate-backward needs a plain single process; under {accelerator.distributed_type.value} the "
            "policy and value model are one engine that takes one backward pass per step (leave --separate-backward "
            "unset)"
        )
    return mini_batch_size, micro_batch_size, batch_size, num_updates, separate_backward


def resume(run: Run, kl_ctl, iterator) -> tuple[int, dict | None]:
    """With `--resume`: the checkpoint's weights, optimizer and RNGs loaded (`Run.resume`), the adaptive KL coefficient
    restored and the prompts the finished updates drew replayed; returns (updates done, last evaluation). A new run:
    (0, None)."""
    state = run.resume()
    if not state:
        return 0, None
    if kl_ctl and state["kl_coef"] is not None:  # None: checkpointed without --adaptive-kl
        kl_ctl.value = state["kl_coef"]
    for _ in range(state["step"]):  # the loader's own generator, no compute
        next(iterator)
    return state["step"], state["metrics"]
