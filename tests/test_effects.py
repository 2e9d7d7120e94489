"""benchmark.effects (issue 68): the papers' effects, each a row whose scripts, track, quantity and direction are fixed
before its comparison runs. Tested here: every row's edit still applies to its library script and makes the change
its row names (and nothing else), each quantity is read as its docstring says, and the verdict against hand-made
seeds; the rows' results are measurements (docs/effects.md)."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark import curves, effects, study

REPO = Path(__file__).resolve().parent.parent
FORKS = {s.name: s for e in effects.EFFECTS for s in (e.base, e.variant) if isinstance(s, effects.Fork)}


@pytest.mark.parametrize("name", sorted(FORKS))
def test_each_forks_edit_applies_to_its_library_script_and_changes_only_its_lines(name):
    """An edit that no longer matches its parent (a renamed field, a moved line) is caught here, not after a study's
    SFT models were built. The fork differs from its parent by its edits' lines only, parses, and is of its parent's
    family by the study's reading of its content."""
    fork = FORKS[name]
    text, parent = fork.text(), (REPO / f"{fork.parent}.py").read_text()
    ast.parse(text)
    changed = [
        line
        for line in difflib.unified_diff(parent.splitlines(), text.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    edited = sum(len(new.splitlines()) for _, new in fork.edits) + sum(len(old.splitlines()) for old, _ in fork.edits)
    assert 1 <= len(changed) <= edited, changed


PRESET_EDITS = {  # fork: its preset, and the field and value its row names
    "grpo_dr": ("tiny", "loss_type", "dr_grpo"),
    "grpo_dapo": ("tiny", "loss_type", "dapo"),
    "grpo_cispo": ("tiny", "loss_type", "cispo"),
    "grpo_clip_higher": ("tiny", "epsilon_high", 0.28),
    "grpo_dynamic": ("tiny", "dynamic_sampling", True),
    "grpo_gspo": ("tiny", "importance_sampling_level", "sequence"),
    "grpo_reinforce_pp": ("tiny", "advantage_estimator", "reinforce_pp_baseline"),
    "grpo_async": ("tiny", "async_generation", True),
    "dpo_ipo": ("tiny-tldr", "loss_type", "ipo"),
    "ppo_clip_delta": ("tiny-math", "prm_refine", "clip_delta"),
    "ppo_kl0": ("tiny-tldr-noisy", "kl_coef", 0.0),
    "grpo_bf16_sampler": ("tiny", "sampler_correction", "none"),
    "grpo_bf16_sampler_tis": ("tiny", "sampler_correction", "token_truncate"),
    "grpo_beta04": ("tiny", "beta", 0.4),
    "grpo_kl_k1_beta04": ("tiny", "beta", 0.4),
}


@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n in FORKS
        if n not in ("rloo_nobaseline", "remax_nobaseline", "grpo_kl_k1", "grpo_kl_cov_7b", "grpo_sft_teacher")
    ),
)
def test_each_preset_forks_edit_lands_in_the_preset_its_study_runs(name, tmp_path, monkeypatch):
    """The edit lands in the preset the study runs (not another preset, not a comment), and only there."""
    path = tmp_path / f"{name}.py"
    path.write_text(FORKS[name].text())
    assert study.family_of(path)[0] == FORKS[name].parent
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    preset, key, want = PRESET_EDITS[name]
    assert getattr(module.PRESETS[preset][1], key) == want
    parent = importlib.import_module(FORKS[name].parent)
    for other in parent.PRESETS:
        if other != preset:
            assert dataclasses.asdict(module.PRESETS[other][1]) == dataclasses.asdict(parent.PRESETS[other][1]), other
    if name == "dpo_ipo":  # the paper's sequence log-ratios: the two margins in one unit
        assert module.PRESETS[preset][1].ipo_average is False


def test_an_edit_that_no_longer_applies_is_one_error_line():
    fork = effects.Fork("x", "rloo", (("a line rloo.py does not hold\n", "b\n"),))
    with pytest.raises(SystemExit, match=r"^error: the edit of x finds 0 copies of 'a line rloo.py does not hold'"):
        fork.text()


def test_every_row_names_a_track_its_scripts_family_has_and_a_known_direction():
    for e in effects.EFFECTS:
        for s, track in e.sides():
            family = study.family_of(REPO / f"{s.parent if isinstance(s, effects.Fork) else s}.py")[0]
            assert track in {t.track for t in study.family_tracks(family, [track])}
        assert e.sides()[0] != e.sides()[1], e.key  # two runs of one script on one track compare nothing
        for q in (e.quantity, *e.also):
            assert q.measure in ("final", "mean", "drop", "auc") and q.direction in ("higher", "lower", "equal"), e.key
            assert q.direction != "equal" or q.tolerance > 0, e.key


def _run(rows: list[dict]) -> curves.Run:
    return curves.Run("r", "x", rows)


def test_the_quantity_is_the_last_value_the_mean_or_the_area_per_update():
    rows = [{"step": 0, "m": 1.0}, {"step": 1, "other": 5.0}, {"step": 2, "m": 3.0}, {"step": 4, "m": 3.0}]
    run = _run(rows)
    assert effects.value(run, effects.Quantity("m", "final", "higher")) == 3.0
    assert effects.value(run, effects.Quantity("m", "mean", "higher")) == pytest.approx(7 / 3)
    assert effects.value(
        _run([{"step": 0, "m": 0.5}, {"step": 1, "m": 0.9}, {"step": 2, "m": 0.2}]),
        effects.Quantity("m", "drop", "higher"),
    ) == pytest.approx(0.7)
    # trapezoids over steps 0-4: (1 + 3) / 2 * 2 + 3 * 2 = 10, over a span of 4
    assert effects.value(run, effects.Quantity("m", "auc", "higher")) == pytest.approx(2.5)
    assert effects.value(_run([{"step": 1, "m": float("nan")}]), effects.Quantity("m", "final", "higher")) is None
    assert effects.value(_run([{"step": 1, "n": 1.0}]), effects.Quantity("m", "mean", "higher")) is None


@pytest.mark.parametrize(
    "direction, base, variant, want",
    [
        ("higher", [1.0, 1.1, 1.2], [2.0, 2.1, 2.2], "shown"),
        ("lower", [1.0, 1.1, 1.2], [2.0, 2.1, 2.2], "opposite"),
        ("lower", [2.0, 2.1, 2.2], [1.0, 1.1, 1.2], "shown"),
        ("higher", [1.0, 1.5, 2.0], [1.2, 1.7, 2.2], "not shown"),
        ("equal", [1.0, 1.1, 1.2], [1.02, 1.12, 1.22], "shown"),
        ("equal", [1.0, 1.5, 2.0], [1.3, 1.8, 2.3], "not shown"),  # overlapping, but 0.3 apart: beyond 0.05
        ("higher", [1.0, 1.1], [2.0, 2.1], "not measured (fewer than 3 seeds)"),
    ],
)
def test_the_verdict_is_the_studys_separation_in_the_papers_direction(direction, base, variant, want):
    q = effects.Quantity("m", "final", direction, 0.05 if direction == "equal" else 0.0)
    got, smallest = effects.verdict(q, effects.Side("a", base), effects.Side("b", variant))
    assert got == want
    assert (smallest is None) == (len(base) < 3)


def test_the_table_reads_each_regimes_recorded_runs_of_a_row(tmp_path):
    """A row's runs under both regimes, as `run` names them, recorded (the runs are not kept); a run without done.json
    (stopped) is not recorded; a second record keeps the first regime's values."""
    e = effects.BY_KEY["rloo-baseline"]
    for regime, folder in (("native", tmp_path / "runs"), ("default", tmp_path / "rounding-default" / "runs")):
        for script, norm in (("rloo", 1.0), ("rloo_nobaseline", 2.0)):
            for seed in (1, 2, 3):
                d = folder / study.run_name(Path(f"{script}.py"), e.track, seed)
                d.mkdir(parents=True)
                rows = [{"step": s, "episode": s, "time": s, "train/grad_norm": norm + 0.01 * seed} for s in (1, 2)]
                (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                if not (regime == "default" and seed == 3):
                    (d / "done.json").write_text("{}")
    values = tmp_path / "values.json"
    recorded = effects.record(tmp_path, "native", [1, 2, 3], values)
    want = sorted(f"{s}_tiny-math-study__{n}" for s in ("rloo", "rloo_nobaseline") for n in (1, 2, 3))
    assert sorted(recorded) == want
    assert len(effects.record(tmp_path, "default", [1, 2, 3], values)) == 4  # seed 3 stopped: not recorded
    data = json.loads(values.read_text())
    (host,) = data["native"]  # this machine's CPU, capability and BLAS: the runs' own provenance has none here
    assert data["native"][host]["rloo_tiny-math-study__2"]["values"]["train/grad_norm (mean)"] == pytest.approx(1.02)
    lines = [line for line in effects.table([1, 2, 3], values).splitlines() if line.startswith("| rloo-baseline")]
    native, default = lines[0], lines[1 + len(e.also)]
    assert "| native |" in native and "rloo: 1.020 [1.010, 1.030]" in native and native.endswith("| shown |")
    assert "| default |" in default and "(2 seeds)" in default and "not measured" in default
    assert lines[-1].endswith("**shown / not measured (fewer than 3 seeds)** |")
    (line,) = [row for row in effects.brief([1, 2, 3], values).splitlines() if row.startswith("| rloo-baseline")]
    assert "| 1.020 [1.010, 1.030] / 2.020 [2.010, 2.030] (0.020)" in line and "| shown |" in line
    assert line.endswith("| not yet |")


def test_two_hosts_runs_are_never_one_sample_and_an_old_record_is_read_by_its_hosts(tmp_path):
    """A regime's verdict is one host's sample: a seed measured on another CPU does not fill a missing one, and where
    two hosts each hold every seed, each is judged (the regime's verdict is theirs when they agree). A record written
    before hosts were a level (regime -> run name) is read under each entry's host."""
    e = effects.BY_KEY["rloo-baseline"]

    def entry(norm: float, host: str) -> dict:
        return {"values": {"train/grad_norm (mean)": norm}, "host": {"cpu": host}}

    def name(script: str, seed: int) -> str:
        return study.run_name(Path(f"{script}.py"), e.track, seed)

    old = {
        "native": {
            name(s, n): entry(v + 0.01 * n, "cpu A")
            for s, v in (("rloo", 1), ("rloo_nobaseline", 2))
            for n in (1, 2, 3)
        }
    }
    values = tmp_path / "values.json"
    values.write_text(json.dumps(old))  # the old format: run names directly under the regime
    data = effects.load(values)
    data["native"]["cpu B"] = {
        name(s, n): entry(1 + 0.01 * n, "cpu B") for s in ("rloo", "rloo_nobaseline") for n in (1, 2, 3)
    }
    del data["native"]["cpu B"][name("rloo", 3)]
    assert sorted(data["native"]) == ["cpu A", "cpu B"] and len(data["native"]["cpu A"]) == 6
    rs = effects.results(e, e.quantity, data["native"], [1, 2, 3])
    assert [(r.host, r.verdict) for r in rs] == [("cpu A", "shown")]  # cpu B's rloo has 2 seeds: no verdict
    data["native"]["cpu B"][name("rloo", 3)] = entry(1.03, "cpu B")
    rs = effects.results(e, e.quantity, data["native"], [1, 2, 3])
    assert [(r.host, r.verdict) for r in rs] == [("cpu A", "shown"), ("cpu B", "not shown")]
    assert effects.regime_verdict(rs) == "differs by host: cpu A: shown; cpu B: not shown"


def test_seeds_of_two_versions_of_a_script_are_not_one_sample(tmp_path):
    """A side whose seeds' records carry two script hashes (the script edited between its seeds' runs, the older seeds
    left recorded) gets no verdict: its sample would mix two programs. One hash a side, and the row is judged."""
    e = effects.BY_KEY["rloo-baseline"]

    def name(script: str, seed: int) -> str:
        return study.run_name(Path(f"{script}.py"), e.track, seed)

    recorded = {
        name(s, n): {"values": {"train/grad_norm (mean)": v + 0.01 * n}, "script_sha256": f"{s}-v1"}
        for s, v in (("rloo", 1), ("rloo_nobaseline", 2))
        for n in (1, 2, 3)
    }
    (r,) = effects.results(e, e.quantity, {"cpu A": recorded}, [1, 2, 3])
    assert r.verdict == "shown"
    recorded[name("rloo", 3)]["script_sha256"] = "rloo-v2"
    (r,) = effects.results(e, e.quantity, {"cpu A": recorded}, [1, 2, 3])
    assert r.verdict == "not measured (rloo's seeds ran 2 versions of it)" and r.smallest is None


def test_list_and_an_unknown_row():
    proc = subprocess.run([sys.executable, "-m", "benchmark.effects", "list"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and all(f"{e.key}: " in proc.stdout for e in effects.EFFECTS)
    cmd = [sys.executable, "-m", "benchmark.effects", "run", "nope", "--dry-run"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.startswith("error: no row nope; the rows are dr-grpo, ")


def test_a_variant_on_its_own_track_runs_and_is_read_there(tmp_path, capsys):
    """Online against offline DPO: one script, two tracks. `run` studies each side on its own track and the record
    reads the variant's runs by that track's names."""
    e = effects.BY_KEY["online-dpo"]
    assert effects.main(["run", "online-dpo", "--dry-run", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "--run-name dpo_tiny-tldr-long-study__1 " in out and "--run-name dpo_tiny-tldr-online-long-study__3 " in out
    for track, gold in ((e.track, 0.1), (e.variant_track, 0.9)):
        for seed in (1, 2, 3):
            d = tmp_path / "runs" / study.run_name(Path("dpo.py"), track, seed)
            d.mkdir(parents=True)
            rows = [{"step": 1, "episode": 1, "time": 1, "eval/gold_reward": gold + 0.01 * seed}]
            (d / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
            (d / "done.json").write_text("{}")
    values = tmp_path / "values.json"
    assert len(effects.record(tmp_path, "native", [1, 2, 3], values)) == 6
    (line,) = [row for row in effects.brief([1, 2, 3], values).splitlines() if row.startswith("| online-dpo")]
    assert "| 0.120 [0.110, 0.130] / 0.920 [0.910, 0.930] (0.020)" in line and "| shown |" in line


def test_the_sft_on_the_teachers_samples_fork_trains_on_the_teacher_and_evaluates_the_student(
    assets, tmp_path, monkeypatch
):
    """distill-vs-sft's maximum-likelihood side: the teacher samples the training batches, the student is evaluated
    (its first edit set `sampling.policy = teacher`, and the evaluations, which sample through `sampling`, measured
    the teacher: every recorded accuracy was the teacher's, flat over the run). At a learning rate of 1e-15 its greedy
    evaluation samples are the parent's (the student's), not the teacher's; its training samples are the teacher's:
    the mean of log pi_student - log pi_teacher over them is below 0 (-KL(teacher || student)), over the student's
    above (KL(student || teacher))."""
    name = "grpo_sft_teacher"
    path = tmp_path / f"{name}.py"
    path.write_text(FORKS[name].text())
    spec = importlib.util.spec_from_file_location(name, path)
    fork = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, fork)
    spec.loader.exec_module(fork)
    grpo = importlib.import_module("grpo_math")
    common = dict(
        model_name_or_path=str(assets / "models" / "tiny-llama"),
        teacher_model_path=str(assets / "models" / "tiny-neox"),  # another model of the same tokenizer
        dataset_name_or_path=str(assets / "tiny-math" / "gsm8k"),
        dataset_config=None,
        prompt_template="Question: {question}\nAnswer:\n",
        reference_template="{answer}",
        advantage_estimator="distill",
        sampler_logprobs=False,
        max_prompt_length=96,
        questions_per_device=2,
        num_generations=4,
        total_steps=1,
        max_completion_length=12,
        micro_batch_size=8,
        learning_rate=1e-15,  # under a float32 weight's resolution: evaluated after the update as loaded
        eval_every=1,
        num_eval_examples=8,
        pass_k=0,
        save_model=False,
        num_threads=1,
        seed=3,
    )
    rows = {}
    for label, module, teacher in [
        ("fork", fork, "tiny-neox"),
        ("parent", grpo, "tiny-neox"),
        ("teacher", grpo, "tiny-neox"),
    ]:
        kw = dict(common, output_dir=str(tmp_path / "runs"), run_name=label)
        if label == "teacher":  # the teacher itself as the policy: what the broken edit evaluated
            kw["model_name_or_path"] = str(assets / "models" / teacher)
        module.main(module.Args(**kw))
        rows[label] = [json.loads(x) for x in (tmp_path / "runs" / label / "metrics.jsonl").read_text().splitlines()]
    samples = {k: (tmp_path / "runs" / k / "samples.jsonl").read_text() for k in rows}
    assert samples["teacher"] != samples["parent"]  # else this test could not tell the two apart
    assert samples["fork"] == samples["parent"]
    kl = {
        k: next(r for r in rows[k] if "objective/teacher_kl" in r)["objective/teacher_kl"] for k in ("fork", "parent")
    }
    assert kl["fork"] < 0 < kl["parent"], kl


@pytest.mark.parametrize("doc", ["docs/effects.md", "docs/results.md"])
def test_the_docs_results_table_is_the_recorded_values(doc):
    """The results table in the docs is `python -m benchmark.effects table --brief` of benchmark/effects_values.json:
    a value recorded (or dropped) without the table regenerated fails here, so the docs never state an old number."""
    want = effects.brief([1, 2, 3]).splitlines()
    lines = (REPO / doc).read_text().splitlines()
    start = lines.index(want[0])  # the table's header: a doc without the table fails here
    got = lines[start : start + len(want) + 1]
    assert got[: len(want)] == want and (len(got) == len(want) or not got[-1].startswith("|")), (
        f"{doc}: regenerate its table with `python -m benchmark.effects table --brief`"
    )
