"""Issue 67 item 7: numbers a run logs or a table counts that were right for the usual run and wrong for an odd one.
sft.py's `episode` at an epoch's short last step (fewer micro-batches than an accumulation step), and a negative
`eval/kl` (an estimate) that benchmark/frontier.py counts within every KL budget."""

from __future__ import annotations

import json

import pytest

import sft
from benchmark import frontier


def _sft_rows(assets, tmp_path, name: str, batch: int, accumulation: int) -> tuple[list[tuple[int, int]], dict]:
    """(step, episode) of every training row of a short sft.py run on 6 rows, and its done.json."""
    args = sft.Args(
        model_name_or_path=str(assets / "models" / "tiny-neox"),
        dataset_name_or_path=str(assets / "tiny-tldr" / "sft"),
        max_prompt_length=96,
        max_response_length=48,
        output_dir=str(tmp_path),
        run_name=name,
        max_train_samples=6,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        num_eval_examples=1,
        eval_every=100,
        log_every=1,
        num_threads=1,
        save_model=False,
    )
    sft.main(args)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    done = json.loads((tmp_path / name / "done.json").read_text())
    return [(r["step"], r["episode"]) for r in rows if "train/loss" in r], done


def test_sft_counts_the_rows_a_short_last_step_trains(assets, tmp_path):
    """6 rows in micro-batches of 2 with accumulation 2: a step of 4 rows, then the epoch's last step of 2 (1
    micro-batch). Its `episode` was 8 (every step counted a full batch of 4); it is the 6 rows trained, in the logged
    rows and done.json. With accumulation 1 every step is full: the count is step x batch, as before (the presets)."""
    steps, done = _sft_rows(assets, tmp_path, "short", batch=2, accumulation=2)
    assert steps == [(1, 4), (2, 6)]
    assert (done["step"], done["episode"], done["total_steps"], done["total_episodes"]) == (2, 6, 2, 6)
    steps, done = _sft_rows(assets, tmp_path, "full", batch=2, accumulation=1)
    assert steps == [(1, 2), (2, 4), (3, 6)] == [(s, s * 2) for s in (1, 2, 3)]
    assert (done["episode"], done["total_episodes"]) == (6, 6)


def test_a_negative_eval_kl_is_within_every_budget_with_a_warning_naming_the_run(tmp_path, capsys):
    """`eval/kl` is a sampled estimate: near the reference it can fall below 0, and KL <= budget holds for it at every
    budget. The frontier keeps the point (it is no error) and says so in one line naming the run and the value."""
    dirs = []
    for seed, kl in ((1, -0.03), (2, 0.1)):
        run = tmp_path / f"rloo_tiny-tldr-noisy__{seed}"
        run.mkdir()
        rows = [
            {"step": 0, "episode": 0, "eval/kl": 0.0, "eval/gold_reward": 0.5},
            {"step": 4, "episode": 64, "eval/kl": kl, "eval/gold_reward": 0.8},
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "done.json").write_text("{}")
        dirs.append(str(run))
    out = tmp_path / "f"
    assert frontier.main([*dirs, "--budgets", "0", "1", "--out", str(out), "--proxy", "none"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: rloo_tiny-tldr-noisy__1: 1 of its 2 evaluations have a negative eval/kl (lowest -0.03, step 4): an "
        "estimate below 0, the least a KL can be, counted as within every KL budget"
    ]
    md = out.with_suffix(".md").read_text()
    assert "| rloo_tiny-tldr-noisy | - | 0.650 [0.500, 0.800] (2) | 0.800 [0.800, 0.800] (2) |" in md, md


@pytest.mark.parametrize("kl", [0.0, 0.2])
def test_a_kl_of_0_or_more_says_nothing(tmp_path, capsys, kl):
    run = tmp_path / "rloo_tiny-tldr-noisy__1"
    run.mkdir()
    row = {"step": 1, "episode": 64, "eval/kl": kl, "eval/gold_reward": 0.8}
    (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    (run / "done.json").write_text("{}")
    assert frontier.main([str(run), "--out", str(tmp_path / "f"), "--proxy", "none"]) == 0
    assert "negative eval/kl" not in capsys.readouterr().err
