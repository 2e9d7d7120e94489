"""Durable runs: the run directory (`runs/<run_name>/`: config.json, metrics.jsonl, samples.jsonl, checkpoint/,
model/, done.json), checkpoints that resume exactly, SIGTERM / SIGINT, the end-of-run marker and the argument checks
every script shares (docs/faults.md; tests/test_faults*.py). Nothing here changes a number: it records and resumes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, gather_object

from clean_rlhf_utils import datafiles, ownership, storage
from clean_rlhf_utils.engines import cpu_threads, make_accelerator, save_model
from clean_rlhf_utils.generation import sampled_pairs_to_json
from clean_rlhf_utils.processes import one_error_line  # noqa: F401 (the scripts' `@runs.one_error_line`)
from clean_rlhf_utils.storage import replace_dir
from clean_rlhf_utils.tracking import exp_name, record_provenance, script_path, script_record, start_wandb


class Run:
    """runs/<run_name>/: config.json, metrics.jsonl (every row carries `step`, `episode` and `time`, the seconds since
    the start, pauses excluded), samples.jsonl, checkpoint/ (and checkpoint.prev/, the one before), model/ and done.json
    (the budget completed); the metrics go to wandb too with `--track`.

    The main process checks `--output-dir` and locks the directory for the life of the run (`ownership.take_lock`: a
    second run of the same directory is refused while the first lives). A directory that holds a run is refused unless
    `--resume` (continue from its newest complete checkpoint, with the arguments it was started with) or `--overwrite`
    (delete it, if it holds only a run's files, and start over; neither when a path the run reads lies inside it). On
    resume `state` is the loop's state at the checkpoint, and the rows logged after it (by a run killed before its next
    checkpoint) are dropped, so the files read as one run. SIGTERM and SIGINT only set a flag: the loop finishes its
    step, checkpoints and exits (`stop_requested`, `stop`); a second SIGINT stops at once. A write that fails (a full
    disk) ends the run in one line naming the checkpoint to resume from."""

    def __init__(self, args, accelerator: Accelerator, presets: dict):
        self.args, self.accelerator, self.main = args, accelerator, accelerator.is_main_process
        datafiles.forget_reads()  # one file read as two splits is refused within a run, not across runs in a process
        self.presets = presets  # the script's PRESETS: done.json names the one the command chose
        self.dir = Path(args.output_dir) / args.run_name
        self.state, self.signal, self.wandb, self.file, self.rows, self.last_step = None, None, None, None, {}, None
        self.previous = None  # a finished run that --overwrite set aside until this one finishes
        error = None
        if self.main:  # where the run writes, checked before anything loads; then one owner for the whole run
            error = (
                storage.output_dir_problem(Path(args.output_dir))
                or storage.run_dir_problem(self.dir)
                or ownership.take_lock(self.dir)
            )
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
        """The used-directory check, under the lock: a used directory needs `--resume` (same arguments, this run's
        checkpoint) or `--overwrite` (a run's files only), and neither may write over a path the run reads."""
        args, accelerator = self.args, self.accelerator
        if self.main and (self.dir / "model.old").exists() and not (self.dir / "model").exists():
            (self.dir / "model.old").rename(self.dir / "model")  # a kill between replace_dir's two renames
        accelerator.wait_for_everyone()
        self.held = self.dir.is_dir() and any(self.dir.iterdir())
        if args.resume:
            if problem := storage.resume_dir_problem(self.dir):  # a finished run, or a run file replaced or unreadable
                raise SystemExit(problem)
            self.resume_from, passed = storage.checkpoint_to_resume(self.dir)
            if self.resume_from is None:
                why = f" ({'; '.join(passed)})" if passed else ""
                raise SystemExit(
                    f"error: --resume: {self.dir} holds no complete checkpoint{why}; start the run without --resume "
                    "(with --overwrite if the directory is in use)"
                )
            if passed and self.main:
                print(f"note: --resume passes over {'; '.join(passed)}: resuming {self.resume_from}", file=sys.stderr)
            ownership.check_resume_args(args, self.dir)
            self.state = storage.read_state(self.resume_from)
            # before anything loads: the state describes this checkpoint, of this run, whose files are whole
            problem = storage.state_problem(self.resume_from, self.state)
            problem = problem or ownership.checkpoint_owner_problem(args, self.resume_from, self.state)
            problem = problem or storage.checkpoint_file_problem(self.resume_from)
            if problem:
                raise SystemExit(problem)
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
                self.previous = storage.set_aside(self.dir)
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.state and self.resume_from.name != "checkpoint":  # the newest complete one goes in its place
                shutil.rmtree(self.dir / "checkpoint", ignore_errors=True)
                self.resume_from.rename(self.dir / "checkpoint")
            shutil.rmtree(self.dir / "checkpoint.tmp", ignore_errors=True)
            (self.dir / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=2) + "\n")
            record_provenance(self.dir, resumed=self.state is not None, script=script_path(args))
            for name in ("metrics.jsonl", "samples.jsonl"):  # the rows up to the checkpoint; none on a new run
                rows = storage.read_rows(self.dir / name) if self.state else []
                if self.state and name in self.state.get("rows", {}):  # the rows written when it was checkpointed
                    rows = rows[: self.state["rows"][name]]
                else:  # a checkpoint that predates the count: the rows of its step or before
                    rows = [r for r in rows if json.loads(r)["step"] <= self.state["step"]] if self.state else []
                (self.dir / name).write_text("".join(rows))
                self.rows[name] = len(rows)
            self.file = open(self.dir / "metrics.jsonl", "a")
            if args.track:
                try:
                    self.wandb = start_wandb(args, self.dir)
                except SystemExit:
                    if not args.resume:  # a new run that never started: no directory left to refuse the next try
                        self.file.close()
                        shutil.rmtree(self.dir)
                        if self.previous is not None:  # and the finished run it was to replace goes back
                            self.previous.rename(self.dir)
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
        self.write(lambda: (self.file.write(json.dumps(row) + "\n"), self.file.flush()), "metrics.jsonl")
        self.rows["metrics.jsonl"] += 1
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def log_samples(self, records: list[dict], step: int) -> None:
        if self.main:

            def append():
                with open(self.dir / "samples.jsonl", "a") as f:
                    f.writelines(json.dumps({"step": step, **r}) + "\n" for r in records)

            self.write(append, "samples.jsonl")
            self.rows["samples.jsonl"] += len(records)

    def write(self, write, what: str, partial: Path | None = None) -> None:
        """`write()`, or on a failed write (a full disk, a lost mount) one line naming the checkpoint to resume from;
        `partial`, what the write left half done, is removed to give the space back."""
        try:
            write()
        except storage.WRITE_ERRORS as e:
            if partial is not None and self.main:
                shutil.rmtree(partial, ignore_errors=True)
            raise SystemExit(
                f"error: writing {self.dir / what} failed ({storage.write_error(e)}); {self.retry()}"
            ) from None

    def retry(self) -> str:
        """How to go on after a failed write: the newest complete checkpoint and `--resume`, or none."""
        path, _ = storage.checkpoint_to_resume(self.dir)
        if path is None:
            return "no checkpoint was written (--save-every 0): free space, then start over with --overwrite"
        step = storage.read_state(path)["step"]
        return f"free space, then continue from {path} (after step {step}) with the same command and --resume"

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

    def checkpoint_due(self, step: int, last: int) -> bool:
        """Every `--save-every` steps, and after the last one (with `--save-model`), so that a final save of model/
        that fails (a full disk) leaves the finished run resumable: `finish` removes that checkpoint once model/ and
        done.json are written."""
        every, self.last_step = self.args.save_every, last
        return bool(every and step % every == 0) or (step == last and self.args.save_model)

    def checkpoint(self, state: dict) -> Path | None:
        """checkpoint/: accelerate's state (weights, optimizer, scheduler, every process's RNG) and the loop's `state`
        (step, episode, data position, the rows logged so far, ...), written to checkpoint.tmp and renamed; the one
        it replaces is kept as checkpoint.prev. A failed write (a full disk) ends in one line naming the checkpoint
        before, except after the last step, where model/ may still fit: then None, and `finish` goes on. Every
        process calls it."""
        tmp, final = self.dir / "checkpoint.tmp", self.dir / "checkpoint"
        if self.main:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(self.dir / "checkpoint.prev", ignore_errors=True)  # two on disk at most, as before
        self.accelerator.wait_for_everyone()
        error = None
        try:
            storage.save_state_without_pickles(self.accelerator, tmp)
            if self.main:
                rows, n, run = dict(self.rows), self.accelerator.num_processes, ownership.run_identity(self.args)
                state = {**state, "time": time.time() - self.start, "num_processes": n, "rows": rows, "run": run}
                state["digest"] = storage.state_digest(tmp, state)  # ties state.json to this checkpoint
                # last: state.json marks the checkpoint complete
                storage.write_synced(tmp / "state.json", json.dumps(state) + "\n")
        except storage.WRITE_ERRORS as e:
            error = storage.write_error(e)
        if self.any_process(error is not None):
            if self.main:
                shutil.rmtree(tmp, ignore_errors=True)
            failed = f"writing the checkpoint after step {state['step']} failed ({error or 'on another process'})"
            if state["step"] == self.last_step:  # the budget is trained: model/ is what counts, and is smaller
                self.accelerator.print(f"note: {failed}; writing model/ all the same")
                return None
            raise SystemExit(f"error: {failed}; {self.retry()}")
        if self.main:
            replace_dir(tmp, final, keep_old_as=self.dir / "checkpoint.prev")
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
            storage.load_state_safely(self.accelerator, self.dir / "checkpoint")
            self.accelerator.print(f"resumed {self.dir} after step {self.state['step']}")
        return self.state

    def stop(self, state: dict) -> None:
        """After SIGTERM / SIGINT: writes a checkpoint and exits with the signal's exit code and one line saying how to
        continue. Every process calls it."""
        path = self.checkpoint(state)
        self.close()
        signum = self.signal or signal.SIGTERM
        if path is None:  # stopped after the last step, whose checkpoint failed
            raise SystemExit(f"error: stopped by {signal.Signals(signum).name}; {self.retry()}")
        if self.main:
            print(
                f"stopped by {signal.Signals(signum).name} after step {state['step']}: continue with the same command "
                f"and --resume (checkpoint: {path})",
                file=sys.stderr,
            )
        raise SystemExit(128 + signum)

    def fail(self, error: str) -> None:
        """A failure of the training itself (`error`: a non-finite loss, gradient norm or logits): one line, exit code 1
        and no new checkpoint, since the weights may already be wrecked (an update moved them too far); the last
        checkpoint stays as it was, and the advice is a new run. Every process calls it."""
        self.close()
        path, _ = storage.checkpoint_to_resume(self.dir)
        kept = f"; the last checkpoint, after step {storage.read_state(path)['step']}, stays in {path}" if path else ""
        raise SystemExit(f"error: {error}, then start over with --overwrite (--resume would repeat the steps){kept}")

    def finish(self, model, tokenizer, budget: dict, prefix: str = "") -> None:
        """The end of a run that completed its budget: model/ (with `--save-model`) written to model.tmp and renamed,
        done.json holding the budget (`total_steps`, `total_episodes`), what was trained (`step`, `episode`: the
        counters of the last row the loop logged) and the command, the checkpoints removed, and where it all went. A
        write that fails leaves the checkpoint of the last step and says how to retry (`--resume` writes model/)."""
        accelerator, args = self.accelerator, self.args
        if args.save_model:
            if self.main:
                shutil.rmtree(self.dir / "model.tmp", ignore_errors=True)
            accelerator.wait_for_everyone()
            # every process (it gathers shards), in the dtype the model was loaded in: --dtype, whatever the engine
            to = self.dir / "model.tmp"
            dtype = getattr(torch, args.dtype)
            self.write(lambda: save_model(model, tokenizer, accelerator, to, prefix, dtype), to.name, partial=to)
            if self.main:
                replace_dir(self.dir / "model.tmp", self.dir / "model")
        if self.main:
            preset = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in self.presets else None
            if self.reached:  # what was trained: the counters of the loop's last row, whatever the arguments say
                budget = {**budget, "step": self.reached[0], "episode": self.reached[1]}
            done = {**budget, "preset": preset, "argv": sys.argv[1:], "time": round(time.time() - self.start, 3)}
            done["script"] = script_record(script_path(args))  # which file ran: path, sha256, tracked or not
            self.write(lambda: (self.dir / "done.json.tmp").write_text(json.dumps(done, indent=2) + "\n"), "done.json")
            os.replace(self.dir / "done.json.tmp", self.dir / "done.json")
            for name in storage.CHECKPOINTS:  # model/ holds the weights
                shutil.rmtree(self.dir / name, ignore_errors=True)
            # this run replaces the finished one --overwrite set aside (also when a resume finishes it)
            storage.remove_previous(self.dir)
        self.close()
        accelerator.wait_for_everyone()
        accelerator.print(f"run finished: {self.dir}" + (f" (model: {self.dir / 'model'})" if args.save_model else ""))

    def close(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the run is over: the signals act as usual again
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.file is not None:
            try:
                self.file.close()
            except OSError:  # its last write failed already (a full disk): that error is the one to report
                pass
            self.file = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        ownership.release_lock(self.dir)  # the run is over: the directory may have another owner


def cli(presets: dict, args: list[str] | None = None, prog: str | None = None):
    """The `Args` of a command line: a preset, then flags over it (`python sft.py tiny-tldr --learning-rate 3e-4`;
    `tyro.extras.overridable_config_cli`). No preset, flags before it, or a preset the script lacks: a one-line error
    listing the presets (tyro: "Unrecognized options"). `prog`: the script named in it (default: the one started)."""
    for stream in (sys.stdout, sys.stderr):  # an ASCII-only terminal prints a run name's é as \xe9, no traceback
        getattr(stream, "reconfigure", lambda **_: None)(errors="backslashreplace")
    argv = list(sys.argv[1:] if args is None else args)
    prog, names = prog or Path(sys.argv[0]).name, ", ".join(presets)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        later = next((a for a in argv if a in presets), None)
        moved = f" ({later} is a preset: put it first)" if later else ""
        raise SystemExit(f"error: {prog} needs a preset first: python {prog} PRESET [flags]{moved}; presets: {names}")
    if not argv[0].startswith("-") and argv[0] not in presets:
        raise SystemExit(f"error: {prog} has no preset {argv[0]!r}: python {prog} PRESET [flags]; presets: {names}")
    args = tyro.extras.overridable_config_cli(presets, args=argv)
    args.exp_name = args.exp_name or exp_name(script_path(args), argv[0])  # --exp-name overrides
    return args


def name_run(args) -> None:
    """The run's names, where not given: `--exp-name` (`exp_name`; `cli` fills it from the preset), `--run-name`."""
    args.exp_name = args.exp_name or exp_name(script_path(args), None)
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}"


def check_args(args, zero_means_none: tuple[str, ...] = ()) -> None:
    """The flags every script shares, checked before anything loads: a one-line error naming the flag. Counts must be at
    least 1, except those where 0 means none (`zero_means_none`, the script's own, and the ones below); then every
    field's declared range, and the rest of `args.check_flags`."""
    from clean_rlhf_utils.args import check_flags  # args.py imports this module

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
    args.output_dir = os.path.expanduser(args.output_dir)  # a quoted '~/x' no shell expanded: the home's x, not ./~
    if getattr(args, "run_name", None) is not None and storage.run_name_problem(args.run_name):
        raise SystemExit(storage.run_name_problem(args.run_name))
    if getattr(args, "lora_r", None) is not None and args.lora_r < 1:  # add_lora reads 0 as no LoRA: a silent full run
        raise SystemExit(
            f"error: --lora-r is {args.lora_r}; a LoRA rank must be at least 1 (leave --lora-r out to "
            "train every weight)"
        )
    if not getattr(args, "lora_alpha", 1.0) > 0:
        raise SystemExit(f"error: --lora-alpha is {args.lora_alpha}; it must be above 0 (the adapters' scale)")
    if getattr(args, "dtype", None) == "float16" and not torch.cuda.is_available():  # CPU float16 training diverges
        raise SystemExit("error: --dtype float16 needs a GPU; on CPU use float32 (or bfloat16)")
    check_flags(args)  # the ranges, the flags that act only with another, the model directories, vLLM


def start_run(
    args, presets: dict, sync_with_dataloader: bool = True, zero_means_none: tuple[str, ...] = (), check=None
) -> tuple[Accelerator, Run]:
    """The start of every run, before anything loads: the default run name (`name_run`), the argument checks
    (`check_args`, then the script's own `check(args)`, if given), the accelerator (`make_accelerator`), one BLAS pool
    per process on CPU (or the processes fight over the cores) and the `Run`, which refuses a used run directory now."""
    name_run(args)
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


def stop_unless_finite(run: Run, value, error: str) -> None:
    """The non-finite guard of a loss or a gradient norm: the one-line `error` (`run.fail`) when `value` is not finite
    on some process. A collective: every process calls it at the same point."""
    if not run.all_finite(value):
        run.fail(error)


def non_finite_policy(update: int, args) -> str:
    """The error line of a policy whose logits are no longer finite, met by sampling (torch's "probability tensor
    contains either inf, nan or element < 0"): the update before moved the weights too far in one step whose loss and
    gradient were finite (Adam moves each weight by about the learning rate), so the checks before the optimizer step
    could not see it."""
    if update == 1:
        return f"the logits of --sft-model-path {args.sft_model_path} are not finite (inf or nan); nothing to sample"
    return (
        f"the policy's logits are not finite at update {update} (sampling met inf or nan): update {update - 1} "
        f"moved the weights too far; lower --learning-rate (now {args.learning_rate:g})"
    )


def sample_or_stop(run: Run, error: str, sample, *args, **kwargs):
    """`sample(*args, **kwargs)` (a sampler returning (tokens, logprobs, ...)), or, when the policy's logits are not
    finite on some process (torch.multinomial's "probability tensor contains either inf, nan or element < 0", or
    non-finite logprobs), the one-line `error` (`non_finite_policy`, `run.fail`). Every process calls it."""
    sampled = None
    try:
        sampled = sample(*args, **kwargs)
    except RuntimeError as e:
        if "probability tensor" not in str(e):
            raise
    stop_unless_finite(run, sampled[1] if sampled else torch.tensor(float("nan")), error)
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
