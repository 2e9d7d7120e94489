"""One error, one line, under several processes: a script's `main` decorated with `one_error_line` ends a job whose
process failed in one line from the main process (docs/faults.md). Nothing here changes a number."""

from __future__ import annotations

import functools
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from clean_rlhf_utils import ownership

EXIT_AFTER_MAIN = False
"""Set by `generation.VLLMSampler` (vLLM on the CPU): a script run as `python X.py` then ends, once `main` returns or
fails, with `os._exit` after the exit handlers, not through the interpreter's teardown, where vLLM 0.32's threads abort
a finished run now and then ("terminate called without an active exception", exit 134; docs/vllm.md)."""


def one_error_line(main):
    """`main` of a script, decorated so that under several processes (`accelerate launch`) an error or a crash on
    any of them ends the job in one line from the main process naming the process and the cause, and the others exit
    quietly (before, a data check failing on process 1 alone printed 67 lines: process 0's traceback from the broken
    gloo connection, the launcher's report, with the one `error:` line buried; a crash on one process three
    tracebacks). How: a process that fails writes its message (a crash: its traceback to a file, named in the message)
    to `.<run_name>.failed-<launch>/<rank>` (in the temporary folder when the processes share one host, else in the
    output directory), leaves the process group (so the others' collectives fail at
    once instead of waiting for the timeout) and waits for the main process to acknowledge; the main process, failing
    itself or seeing its collective break, prints the lowest rank's message and exits 1. One process: `main` as it is.
    The launcher (torchrun) still prints its own summary of the exit codes."""

    @functools.wraps(main)
    def wrapper(args):
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            try:
                result = main(args)
            except SystemExit as e:
                _exit_now_if_asked(main, e.code)
                raise
            except BaseException:
                _exit_now_if_asked(main, traceback.format_exc())
                raise
            _exit_now_if_asked(main, 0)
            return result
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
        # where the processes leave their notes, named after this launch: on one host, a local folder named after the
        # launcher's process (their common parent); across hosts, the output directory and the rendezvous
        one_host = os.environ.get("LOCAL_WORLD_SIZE", "") == str(world)
        launch = (
            str(os.getppid())
            if one_host
            else f"{os.environ.get('TORCHELASTIC_RUN_ID')}-{os.environ.get('MASTER_PORT')}"
        )
        root = Path(tempfile.gettempdir()) if one_host else Path(args.output_dir)
        notes = root / f".{args.run_name or args.exp_name}.failed-{launch}"

        def on_sigterm(signum, frame):  # the launcher stops the others when one process exits: name that one
            found = _first_note(notes, world, wait=2.0)
            if found and rank == 0:
                _end(notes, f"error: process {found[0]} of {world}: {found[1].removeprefix('error: ')}", rank)
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)  # until `Run.begin` installs the run's own handler
        try:
            return main(args)
        except SystemExit as e:
            if not (isinstance(e.code, str) and e.code.startswith("error:")):
                raise
            message = e.code
        except KeyboardInterrupt:  # a second Ctrl-C: every process got it, stop at once
            raise
        except BaseException as e:  # a crash here, or a collective that another process's exit broke
            if rank == 0 and (found := _first_note(notes, world, wait=5.0)):
                _end(notes, f"error: process {found[0]} of {world}: {found[1].removeprefix('error: ')}", rank)
            if rank != 0 and _first_note(notes, world, wait=1.0):
                _end(notes, None, rank)  # another process failed first: it is the one to name
            trace = Path(args.output_dir) / f".{args.run_name or args.exp_name}.rank{rank}.traceback"
            trace.parent.mkdir(parents=True, exist_ok=True)
            trace.write_text(traceback.format_exc())
            message = f"error: crashed: {type(e).__name__}: {' '.join(str(e).split())[:200]} (traceback: {trace})"
            if rank == 0:
                raise
        _end(notes, message if rank == 0 else f"error: {message.removeprefix('error: ')}", rank)

    return wrapper


def _exit_now_if_asked(main, code) -> None:
    """(`EXIT_AFTER_MAIN`, a script run as `python X.py`) exit with `code` (a message: printed, exit 1) now, after the
    exit handlers (`atexit`: the vLLM engine's shutdown among them) and with the output flushed."""
    if not (EXIT_AFTER_MAIN and main.__module__ == "__main__"):
        return
    if isinstance(code, str):
        print(code.rstrip("\n"), file=sys.stderr)
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def _first_note(notes: Path, world: int, wait: float) -> tuple[int, str] | None:
    """(rank, message) of the lowest-ranked process that noted a failure, waiting up to `wait` seconds for one."""
    deadline = time.time() + wait
    while True:
        found = [(r, (notes / str(r)).read_text()) for r in range(world) if (notes / str(r)).is_file()]
        if found or time.time() > deadline:
            return min(found) if found else None
        time.sleep(0.05)


def _end(notes: Path, message: str | None, rank: int) -> None:
    """The end of a failed process: the main one prints `message` once and acknowledges; the others note theirs,
    leave the process group and wait (up to 10 s) for the acknowledgement, so the launcher does not stop the main
    process before it has printed. Exits 1 without the interpreter's teardown (no gloo traces)."""
    notes.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
        (notes / "ack").write_text("")
    else:
        if message is not None and not (notes / str(rank)).exists():
            (notes / f"{rank}.tmp").write_text(message)
            os.replace(notes / f"{rank}.tmp", notes / str(rank))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # the group is already broken: leaving it is all that was wanted
                pass
        deadline = time.time() + 10.0
        while not (notes / "ack").exists() and time.time() < deadline:
            time.sleep(0.05)
        (notes / str(rank)).unlink(missing_ok=True)
    ownership.release_all()  # os._exit skips the atexit handler that would
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
