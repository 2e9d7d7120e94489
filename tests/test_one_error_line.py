"""Under several processes, an error or a crash on one of them ends the job in one line from the main process naming
the process and the cause; the others exit quietly (issue 51 item 11; `runs.one_error_line`). Before, a data check
failing on process 1 alone printed process 0's gloo traceback ("Connection closed by peer") around the one `error:`
line, and a crash on one process three tracebacks. The launcher's own summary of exit codes is torchrun's and stays."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.faults import REPO, env
from tests.launch import launch_cmd

WRAPPER = """
import os, sys
sys.path.insert(0, {repo!r})
import sft
real = sft.load_train_and_eval_rows
def rows(*a, **k):  # the data check of process 1 alone fails (a bad shard, a path missing on one node) or crashes
    if os.environ.get("RANK") == "1":
        if {crash!r}:
            raise ValueError("a bug on this process only")
        raise SystemExit("error: --dataset-name-or-path data/train.jsonl row 7: field 'query' is missing")
    return real(*a, **k)
sft.load_train_and_eval_rows = rows
sft.main(sft.cli(sft.PRESETS))
"""


@pytest.mark.parametrize("crash", [False, True])
def test_a_failure_on_one_process_is_one_line_from_the_main_process(assets, tmp_path, crash):
    script = tmp_path / "failing_on_process_1.py"
    script.write_text(WRAPPER.format(repo=str(REPO), crash=crash))
    flags = ["tiny-tldr", "--model-name-or-path", str(assets / "models" / "tiny-neox"), "--dataset-name-or-path"]
    flags += [str(assets / "tiny-tldr" / "sft"), "--max-train-samples", "32", "--num-eval-examples", "2"]
    flags += ["--num-threads", "1", "--output-dir", str(tmp_path / "runs"), "--run-name", "r"]
    out = subprocess.run(launch_cmd(script, *flags), capture_output=True, text=True, timeout=300, cwd=REPO, env=env())
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    errors = re.findall(r"error: [^\r\n]*", text)
    assert len(errors) == 1, text[-3000:]
    assert errors[0].startswith("error: process 1 of 2: "), errors[0]
    assert "[rank" not in text and "Connection closed by peer" not in text, text[-3000:]  # the others were quiet
    if crash:
        assert "crashed: ValueError: a bug on this process only" in errors[0]
        trace = tmp_path / "runs" / ".r.rank1.traceback"
        assert str(trace) in errors[0] and "ValueError" in trace.read_text()
    else:
        assert errors[0].endswith("row 7: field 'query' is missing")
    assert not (tmp_path / "runs" / ".r.lock").exists()  # the lock is let go on the way out
