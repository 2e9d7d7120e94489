"""A variant study in one command: `python -m benchmark.run study --scripts rloo_batchmean.py rloo.py --seeds 1 2 3`.

Each script is a script of the library's shape (a `.py` file with a module-level `PRESETS` dict) of a known family:
the library script it was forked from, said by a module-level `PARENT = "rloo"` line when it has one, else found from
its content (the library script that has its presets and shares the most of its lines). The study runs every script,
for every seed, on its family's STUDY tracks: the tracks of the tiny world whose reward leaves room to tell variants
apart (tiny-tldr-noisy's imperfect reward model, tiny-math's verifiable reward; not tiny-tldr, where every algorithm
reaches the gold judge's ceiling), at budgets that keep an RL family's study within about 30 minutes on a 2-core CPU,
with an evaluation at every update for a curve of about 9 points. The SFT and reward models they start from are the
quick suite's (built first when missing, skipped when `python -m benchmark.run quick` made them). A run is named
`<script name>_<track>-study__<seed>` (`rloo_batchmean_tiny-math-study__1`): the study's budgets are not the presets',
so its runs never take the name, or the directory, of a suite's run of the same script.

Then, per track, `benchmark.compare`'s table (final value, AUC and episodes to a threshold, each with its 95% bootstrap
interval over seeds), the ranking and which scripts separate and which do not, and the figure are printed and written
to `runs/study_<name>_<track>.md|png` (name: `--name`, else the scripts' names joined by `-vs-`, so a second study
never overwrites the first's); on a track evaluated with `--eval-kl`, the KL frontier too
(`runs/study_<name>_<track>_kl.md|png`). The end lists every study the runs directory holds.
"""

from __future__ import annotations

import ast
import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from benchmark import curves, frontier, launch, runfiles
from benchmark.launch import decide, run_suite
from benchmark.suites import TLDR_RM_QUICK, Stage, frontier_tldr_stages, rm_stage, seed_flag, sft_stage, starts

REPO = Path(__file__).resolve().parent.parent
LIBRARY = ["sft", "reward_model", "ppo_rlhf", "rloo", "remax", "grpo_math", "dpo"]
"""the library's own scripts: the families a study script can belong to"""


@dataclass(frozen=True)
class Track:
    track: str
    """the tiny-world track, the run name's middle part"""
    preset: str
    """the script's preset that runs on it"""
    flags: tuple[str, ...]
    """the study's budget and evaluation flags (after the preset)"""
    metric: str
    """what the table ranks"""
    models: tuple[str, ...]
    """the quick suite's SFT policy and reward model the preset reads, as run names before `__` (`sft_tiny-tldr`): the
    policy first; each seed's own (`__<seed>`), or seed 1's for every seed with `--shared-starts`"""
    model_flags: tuple[tuple[str, str], ...] = ()
    """more models of `models` the preset does not point at: (flag, run name before `__`), passed as
    `flag runs/<name>__<seed>/model` (a process reward model: `--prm-path`)"""

    def needs(self, seed: int) -> list[str]:
        """The model stages a run of this track at `seed` starts from (the start's seed: see `start_seed`)."""
        return [f"{m}__{seed}" for m in self.models]


# offline DPO on tiny-tldr-noisy reads the noisy reward model too: its proxy score (`eval/score`) is evaluated with it
TLDR_NOISY_NEEDS = ("sft_tiny-tldr", "rm_tiny-tldr-noisy")
MATH_NEEDS = ("sft_tiny-math",)
EVERY_UPDATE = ("--eval-every", "1")
STUDY = {  # family: the tracks that can separate its variants, with their budgets
    "rloo": [
        Track(
            "tiny-tldr-noisy",
            "tiny-tldr-noisy",
            ("--total-episodes", "512", *EVERY_UPDATE, "--num-eval-examples", "100"),
            "eval/gold_reward",
            TLDR_NOISY_NEEDS,
        ),
        Track("tiny-math", "tiny-math", ("--total-episodes", "1024", *EVERY_UPDATE), "eval/accuracy", MATH_NEEDS),
    ],
    "remax": [
        Track(
            "tiny-tldr-noisy",
            "tiny-tldr-noisy",
            ("--total-episodes", "512", *EVERY_UPDATE, "--num-eval-examples", "100"),
            "eval/gold_reward",
            TLDR_NOISY_NEEDS,
        ),
        Track("tiny-math", "tiny-math", ("--total-episodes", "512", *EVERY_UPDATE), "eval/accuracy", MATH_NEEDS),
    ],
    # PPO: tiny-tldr-noisy only. On tiny-math at the study's 512 episodes PPO does not learn (3 seeds ended at
    # 0.135-0.175 from the SFT policy's 0.175, issue 58): that track's half of a study bought nothing (its preset's full
    # 2,048 episodes do learn: docs/results.md)
    "ppo_rlhf": [
        Track(
            "tiny-tldr-noisy",
            "tiny-tldr-noisy",
            ("--total-episodes", "512", *EVERY_UPDATE, "--num-eval-examples", "100"),
            "eval/gold_reward",
            TLDR_NOISY_NEEDS,
        )
    ],
    "grpo_math": [
        Track("tiny-math", "tiny", ("--total-steps", "10", "--pass-k", "0", *EVERY_UPDATE), "eval/accuracy", MATH_NEEDS)
    ],
    "dpo": [
        Track(
            "tiny-tldr-noisy",
            "tiny-tldr-noisy",
            ("--num-train-epochs", "1", "--max-train-samples", "384", "--eval-every", "2")
            + ("--num-eval-examples", "100", "--num-eval-pairs", "100"),
            "eval/gold_reward",
            TLDR_NOISY_NEEDS,
        )
    ],
}


# Tracks a study runs only when asked (`--tracks`): longer budgets for the papers' effects (benchmark/effects.py), whose
# designs fixed them before any comparison on them ran
MORE_TRACKS = {
    # the preset's full 40 steps (20 warm-up steps, then 20 at the full learning rate; the study track's 10 are all
    # warm-up), an evaluation every 5, pass@8 at the end
    "grpo_math": [
        Track("tiny-math-long", "tiny", ("--total-steps", "40", "--eval-every", "5"), "eval/accuracy", MATH_NEEDS),
        # the same with two passes over each batch, the second all off-policy: where a ratio's clip acts
        Track(
            "tiny-math-offpolicy",
            "tiny",
            ("--total-steps", "40", "--eval-every", "5", "--num-iterations", "2"),
            "eval/accuracy",
            MATH_NEEDS,
        ),
        # on-policy distillation from each seed's GRPO teacher (`teacher_stage`), tiny-math-long's budget, the old
        # logprobs from a forward pass (the row's other side samples with the teacher, whose logprobs are not the old
        # policy's)
        Track(
            "tiny-math-distill",
            "tiny",
            ("--total-steps", "40", "--eval-every", "5", "--advantage-estimator", "distill")
            + ("--sampler-logprobs", "False"),
            "eval/accuracy",
            ("sft_tiny-math", "teacher_tiny-math"),
            (("--teacher-model-path", "teacher_tiny-math"),),
        ),
        # tiny-math-long with the old policy's logprobs from the trainer's own forward pass, not the sampler's: where
        # a sampler that is not the trainer (vLLM, a bf16 engine) can be corrected for
        Track(
            "tiny-math-sampler",
            "tiny",
            ("--total-steps", "40", "--eval-every", "5", "--sampler-logprobs", "False"),
            "eval/accuracy",
            MATH_NEEDS,
        ),
    ],
    # PPO on tiny-math at the preset's 2,048 episodes with each seed's process reward model added to the success reward
    # (the tiny-math suite's ppo-prm stages: Gao et al. 2024 in miniature), an evaluation every 4 updates
    "ppo_rlhf": [
        Track(
            "tiny-math-prm",
            "tiny-math",
            ("--eval-every", "4"),
            "eval/accuracy",
            ("sft_tiny-math", "prm_tiny-math"),
            (("--prm-path", "prm_tiny-math"),),
        ),
        # the preset's full 1,536 episodes (24 updates), an evaluation every update: the main job's frontier showed the
        # gold reward's fall without a KL penalty past a KL of about 5, which the study track's 512 episodes stop before
        Track(
            "tiny-tldr-noisy-long",
            "tiny-tldr-noisy",
            (*EVERY_UPDATE, "--num-eval-examples", "100"),
            "eval/gold_reward",
            TLDR_NOISY_NEEDS,
        ),
        # PPO on tiny-tldr's gold-labelled pairs (the reward model of the pairs DPO trains on), the preset's 1,024
        # episodes, evaluated on DPO's tiny-tldr-long's 100 prompts with the KL to the reference
        Track(
            "tiny-tldr",
            "tiny-tldr",
            ("--num-eval-examples", "100", "--eval-kl"),
            "eval/gold_reward",
            ("sft_tiny-tldr", "rm_tiny-tldr"),
        ),
    ],
    # tiny-tldr's deterministic (gold-judge) labels, four passes over 1,024 pairs at a constant learning rate of 5e-5
    # (the noisy track's: 1e-5 barely moves the policy), so that each loss nears where it converges
    "dpo": [
        Track(
            "tiny-tldr-long",
            "tiny-tldr",
            ("--max-train-samples", "1024", "--num-train-epochs", "4", "--learning-rate", "5e-5")
            + ("--lr-schedule", "constant", "--eval-every", "16", "--num-eval-examples", "100")
            + ("--num-eval-pairs", "200"),
            "eval/gold_reward",
            ("sft_tiny-tldr",),
        ),
        # online DPO on the same labeller (the gold judge) and the same 128 steps of 32 pairs as tiny-tldr-long: 4,096
        # prompts, each a pair sampled from the policy, at its learning rate and evaluation (the gold-labelled reward
        # model only logs its score)
        Track(
            "tiny-tldr-online-long",
            "tiny-tldr-online",
            ("--judge", "gold", "--total-episodes", "4096", "--learning-rate", "5e-5", "--lr-schedule", "constant")
            + ("--eval-every", "16", "--num-eval-examples", "100", "--num-eval-pairs", "200"),
            "eval/gold_reward",
            ("sft_tiny-tldr", "rm_tiny-tldr"),
        ),
    ],
}


def family_tracks(family: str, names: list[str] | None) -> list[Track]:
    """The tracks a study runs a script of `family` on: its STUDY tracks, or those of `names` (`--tracks`) among them
    and MORE_TRACKS; StudyError for a name the family has no track of."""
    if names is None:
        return STUDY[family]
    known = {t.track: t for t in [*STUDY[family], *MORE_TRACKS.get(family, [])]}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise StudyError(f"--tracks {' '.join(unknown)}: family {family} has the tracks {', '.join(known)}")
    return [known[n] for n in dict.fromkeys(names)]


class StudyError(Exception):
    """A study script that cannot be studied; its message is the `error:` line."""


def module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    """The module-level `NAME = value` assignments of a script (not executed: a fork is read, never imported)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out[node.target.id] = node.value
    return out


def preset_names(value: ast.expr | None) -> set[str]:
    if not isinstance(value, ast.Dict):
        return set()
    return {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def read_script(path: Path) -> tuple[str, set[str], str | None]:
    """A study script's text, preset names and declared parent (None without a PARENT line); StudyError when it is
    not a script of the library's shape."""
    if path.suffix != ".py":
        raise StudyError(f"{path} is not a Python script (.py): the study runs scripts of the library's shape")
    if not path.is_file():
        raise StudyError(f"{path} does not exist")
    text = path.read_text(errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise StudyError(f"{path} does not parse as Python (line {e.lineno}: {e.msg})") from None
    constants = module_constants(tree)
    presets = preset_names(constants.get("PRESETS"))
    if not presets:
        raise StudyError(
            f"{path} has no module-level PRESETS dict: not a script of the library's shape (CONTRIBUTING.md)"
        )
    parent = constants.get("PARENT")
    declared = parent.value if isinstance(parent, ast.Constant) and isinstance(parent.value, str) else None
    return text, presets, declared


def family_of(path: Path) -> tuple[str, str]:
    """The library script a study script belongs to, and how that was found: its `PARENT = "rloo"` line, else its
    content (among the library scripts that have one of its presets, the one it shares the most lines with)."""
    text, presets, declared = read_script(path)
    if declared is not None:
        name = Path(declared).stem
        if name not in LIBRARY:
            raise StudyError(f"{path}: PARENT = {declared!r} names no library script (one of {', '.join(LIBRARY)})")
        return name, "its PARENT line"
    if path.resolve().parent == REPO and path.stem in LIBRARY:
        return path.stem, "a library script"
    lines = text.splitlines()
    scores = []
    for lib in LIBRARY:
        lib_text = (REPO / f"{lib}.py").read_text()
        if preset_names(module_constants(ast.parse(lib_text)).get("PRESETS")) & presets:
            matcher = difflib.SequenceMatcher(None, lib_text.splitlines(), lines, autojunk=False)
            scores.append((matcher.ratio(), lib))
    if not scores:
        raise StudyError(
            f"{path}: none of its presets ({', '.join(sorted(presets))}) is a library script's, so its family is "
            'unknown; declare it with a module-level line such as PARENT = "rloo"'
        )
    ratio, lib = max(scores)
    if ratio < 0.5:
        raise StudyError(
            f"{path} shares {ratio:.0%} of its lines with the closest library script ({lib}.py): its family is "
            'unknown; declare it with a module-level line such as PARENT = "rloo"'
        )
    return lib, f"its content: {ratio:.1%} of its lines are {lib}.py's"


@dataclass
class Plan:
    scripts: list[tuple[Path, str, str]]
    """(script, its family, how the family was found)"""
    tracks: dict[str, Track]
    """track name: the track (its metric)"""
    by_family: dict[str, list[Track]]
    """family: the tracks its scripts run on"""


def plan(scripts: list[str], track_names: list[str] | None = None) -> Plan:
    """What the study runs for `scripts` (on `track_names`, default each family's STUDY tracks); StudyError for a
    script that cannot be studied."""
    if not scripts:
        raise StudyError("the study needs --scripts: the scripts to compare, e.g. --scripts rloo_batchmean.py rloo.py")
    found, tracks, names, by_family = [], {}, {}, {}
    for s in scripts:
        if not Path(s).exists() and Path(s).name == s and Path(s).stem in LIBRARY:
            s = str(REPO / s)  # `rloo.py` from a folder of forks (~/experiments): the library's script
        path = Path(s).resolve()
        family, how = family_of(Path(s))
        if family not in STUDY:
            raise StudyError(
                f"{s} is of family {family}, which the study does not cover: it compares the RL and preference "
                f"algorithms ({', '.join(sorted(STUDY))})"
            )
        presets = read_script(Path(s))[1]
        by_family[family] = family_tracks(family, track_names)
        missing = [t.preset for t in by_family[family] if t.preset not in presets]
        if missing:
            raise StudyError(f"{s} has no preset {', '.join(missing)}, which the study of family {family} runs")
        if path.stem in names and names[path.stem] != path:
            raise StudyError(
                f"two study scripts are named {path.stem} ({names[path.stem]} and {path}): their runs would share names"
            )
        names[path.stem] = path
        for t in by_family[family]:
            if tracks.setdefault(t.track, t).metric != t.metric:
                raise StudyError(f"the study's track {t.track} has two metrics")  # STUDY is inconsistent
        found.append((path, family, how))
    if len({p for p, _, _ in found}) < len(found):
        raise StudyError("a study script is given twice")
    return Plan(found, tracks, by_family)


def run_name(script: Path, track: str, seed: int) -> str:
    """`rloo_batchmean_tiny-math-study__1`: named after the script; `-study`, not a preset's run of it."""
    return f"{script.stem}_{track}-study__{seed}"


def start_seed(seed: int, shared_starts: bool) -> int:
    """The seed of the SFT policy and reward model a run of `seed` starts from: its own (a seed is the whole pipeline,
    so an interval covers the start's variation too), or seed 1's for every seed with `--shared-starts` (the scripts
    compared from the same starts: a paired design, whose interval leaves the start's variation out)."""
    return 1 if shared_starts else seed


def model_stages(start: int) -> list:
    """The SFT policies and reward models a track can start from (`Track.models`), of one start seed, at the quick
    suite's budgets."""
    prm = rm_stage("prm_tiny-math", "tiny-math-prm", "sft_tiny-math", start)
    rm = rm_stage("rm_tiny-tldr", "tiny-tldr", "sft_tiny-tldr", start, TLDR_RM_QUICK)  # of the gold-labelled pairs
    return [*frontier_tldr_stages([start]), rm, sft_stage("tiny-math", start), prm, teacher_stage(start)]


def teacher_stage(start: int) -> Stage:
    """The distillation tracks' teacher: grpo_math.py's `tiny` preset at its full 40 updates from the seed's own SFT
    policy (tiny-math-long's run, evaluated once), the student's own start trained on."""
    flags = ["--total-steps", "40", "--pass-k", "0", "--eval-every", "40"]
    return Stage(
        f"teacher_tiny-math__{start}",
        "grpo_math.py",
        "tiny",
        [*seed_flag(start), *flags, *starts("grpo_math", start, "sft_tiny-math")],
        needs=[f"sft_tiny-math__{start}"],
    )


def stages(p: Plan, seeds: list[int], shared_starts: bool = False) -> list:
    """The suite's stages: the SFT / reward models the tracks need (the quick suite's, of each start seed), then every
    script on each of its family's tracks for every seed."""

    out, models = [], {}
    for start in dict.fromkeys(start_seed(s, shared_starts) for s in seeds):
        models.update({st.run_name: st for st in model_stages(start)})
        needed = {n for _, family, _ in p.scripts for t in p.by_family[family] for n in t.needs(start)}
        out += [models[n] for n in models if n in needed and models[n] not in out]
    for seed in seeds:
        start = start_seed(seed, shared_starts)
        for path, family, _ in p.scripts:
            for t in p.by_family[family]:
                rm = next((m for m in t.models if m.startswith("rm_")), None)
                out.append(
                    Stage(
                        run_name(path, t.track, seed),
                        str(path),
                        t.preset,
                        ["--seed", str(seed), *t.flags, *starts(family, start, t.models[0], rm)]
                        + [x for flag, m in t.model_flags for x in (flag, f"runs/{m}__{start}/model")],
                        needs=t.needs(start),
                    )
                )
    return out


def design(shared_starts: bool) -> str:
    """The line under each table that says what its interval covers."""
    if shared_starts:
        return (
            "Starts: every seed from seed 1's SFT policy and reward model (--shared-starts, paired): the interval "
            "covers RL's variation only"
        )
    return "Starts: each seed from its own SFT policy and reward model (the whole pipeline): the interval covers both"


def study_name(p: Plan, name: str | None = None) -> str:
    """The name of a study's outputs: `name`, else its scripts' names joined by `-vs-` (`rloo_epochs4-vs-rloo`)."""
    if name is not None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise StudyError(f"--name {name!r}: a study's name is letters, digits, '.', '_' and '-' (it names files)")
        return name
    return "-vs-".join(path.stem for path, _, _ in p.scripts)


def study_files(p: Plan, name: str, runs_dir: Path) -> list[Path]:
    """Every file a study named `name` writes: its summary (the suite's), and per track its table and figure and, with
    --eval-kl, those of its KL frontier."""
    files = [runs_dir / f"study_{name}_summary.md"]
    for track in p.tracks:
        files += [runs_dir / f"study_{name}_{track}{kl}{ext}" for kl in ("", "_kl") for ext in (".md", ".png")]
    return files


def check_name_length(p: Plan, name: str | None, runs_dir: Path) -> None:
    """StudyError for a study name (`--name`, or its scripts' names joined) too long for a file name of the runs
    directory's file system: found before the first stage, not when the report is written after the last."""
    n = study_name(p, name)
    limit = launch.name_max(runs_dir)
    longest = max(study_files(p, n, runs_dir), key=lambda f: len(f.name.encode()))
    size = len(longest.name.encode())
    if size > limit:
        given = "--name" if name is not None else "the study's name (its scripts' names joined by -vs-)"
        raise StudyError(
            f"{given} is {len(n.encode())} bytes long: {runs_dir / launch.short(longest.name)} would be a file name "
            f"of {size} bytes, more than the {limit} its file system takes; give a --name of at most "
            f"{max(1, limit - size + len(n.encode()))} bytes"
        )


def outputs(p: Plan, name: str | None, runs_dir: Path) -> list[launch.Output]:
    """The study's own files, as `launch.check_outputs` checks them with the suite's before the first stage."""
    kinds = {".md": "the study's table", ".png": "the study's figure"}
    return [
        launch.Output(f, False, kinds[f.suffix], "give a shorter --name")
        for f in study_files(p, study_name(p, name), runs_dir)[1:]  # the summary is the suite's
    ]


def past_studies(runs_dir: Path) -> list[str]:
    """The studies whose tables `runs_dir` holds: their names and tracks, one line each."""
    found: dict[str, list[str]] = {}
    for md in sorted(runs_dir.glob("study_*.md")):
        stem = md.name.removesuffix(".md")
        if stem.endswith(("_kl", "_summary")):  # a track's KL table, a study's status table
            continue
        name, _, track = stem.removeprefix("study_").rpartition("_")
        if name:  # `study_<track>.md` of older versions has no name
            found.setdefault(name, []).append(track)
    return [f"  {name}: {', '.join(tracks)}" for name, tracks in found.items()]


def report(
    p: Plan, runs_dir: Path, seeds: list[int], shared_starts: bool = False, name: str | None = None, write: bool = True
) -> list[Path]:
    """Per track: the table, ranking and separation (`benchmark.compare`) of the study's finished runs, and the
    figure, one colour per script in every figure; printed, and written to runs_dir/study_<name>_<track>.md|png
    (printed only, without `write`: a runs directory that cannot be written)."""
    colours = curves.Colours({path.stem for path, _, _ in p.scripts})
    wrote = []
    for track, t in p.tracks.items():
        dirs = [runs_dir / run_name(path, track, s) for path, family, _ in p.scripts for s in seeds]
        runs = curves.finished_runs([curves.read_run(d) for d in dirs if runfiles.is_run_dir(d)])
        runs = [r for r in runs if any(t.metric in row for row in r.rows)]
        print(f"\n## {track}: {t.metric}\n")
        if not runs:
            print(f"no finished run of the study on {track}")
            continue
        md = curves.markdown_table(curves.summarize(runs, t.metric), t.metric)
        md += f"\n{design(shared_starts)}.\n"
        md += "".join(f"\n> warning: {line}\n" for line in curves.provenance_differences(runs))
        out = runs_dir / f"study_{study_name(p, name)}_{track}"
        if write:
            Path(f"{out}.md").write_text(md)
            title = f"study on {track}: {t.metric}, " + ", ".join(path.name for path, _, _ in p.scripts)
            curves.plot(runs, t.metric, Path(f"{out}.png"), title, (), colours, curves.algorithm_of)
            wrote += [Path(f"{out}.md"), Path(f"{out}.png")]
        print(md)
        by_kl = frontier.curves_of(runs, t.metric, "eval/score" if track == "tiny-tldr-noisy" else None)
        if by_kl:  # evaluated with --eval-kl: what each variant buys per unit of KL
            # a curve per script, named as its colour is keyed
            by_kl = [
                frontier.Curve(curves.algorithm_of(c.algo), c.penalty, c.seed, c.kl, c.gold, c.proxy) for c in by_kl
            ]
            kl = runs_dir / f"study_{study_name(p, name)}_{track}_kl"
            table = frontier.frontier_tables(by_kl, frontier.BUDGETS, t.metric)
            if write:
                Path(f"{kl}.md").write_text(table)
                proxy = "eval/score" if all(c.proxy is not None for c in by_kl) else None
                frontier.plot_frontier(by_kl, track, Path(f"{kl}.png"), colours, (t.metric, proxy, frontier.BUDGETS))
                wrote += [Path(f"{kl}.md"), Path(f"{kl}.png")]
            print(f"\n### {track}: {t.metric} against KL\n\n{table}")
    return wrote


# Roughly how long a stage takes on a 2-core EPYC, one thread, beside another job (`--jobs 2`); the sources are the
# main job's log and docs/results.md's variant studies
SECONDS = {
    **{
        "sft_tiny-tldr": 235,
        "sft_tiny-math": 340,
        "rm_tiny-tldr-noisy": 85,
        "rm_tiny-tldr": 97,
        "prm_tiny-math": 260,
        "teacher_tiny-math": 330,
    },
    **{"dpo": 115, "grpo_math": 110},
}
STUDY_RUN_SECONDS = 180
"""an RL study run of the other families (512-1,024 episodes, an evaluation at every update)"""


def announce(p: Plan, todo: list, workdir: Path, jobs: int) -> list[str]:
    """The plan's first lines: the models the study builds first (those not finished with the same command and
    script), how many runs follow, and roughly how long, so that a fresh clone's hour of SFT and reward models is no
    surprise."""

    runs_dir = Path(workdir) / "runs"
    models = [st for st in todo if "-study__" not in st.run_name]
    build = [st for st in models if decide(runs_dir, st.run_name, st.args(True), (), st.file(workdir))[0] != "skip"]
    runs = [st for st in todo if "-study__" in st.run_name]
    family = {str(path): fam for path, fam, _ in p.scripts}
    seconds = sum(SECONDS[st.run_name.rsplit("__", 1)[0]] for st in build)
    seconds += sum(SECONDS.get(family[st.script], STUDY_RUN_SECONDS) for st in runs)
    first = ", ".join(st.run_name for st in build) or "nothing (every model it reads is built)"
    return [
        f"# builds first: {first}",
        f"# then {len(runs)} study runs; roughly {seconds / 60 / max(1, min(jobs, 2)):.0f} min with --jobs {jobs} on a "
        "2-core CPU (the SFT and reward models each track needs: docs/usage.md)",
    ]


def run_study(
    scripts: list[str],
    seeds: list[int],
    workdir: Path = Path("."),
    dry_run: bool = False,
    jobs: int = 1,
    live: bool | None = None,
    launcher: list[str] | None = None,
    shared_starts: bool = False,
    name: str | None = None,
    tracks: list[str] | None = None,
) -> dict[str, str]:
    """`python -m benchmark.run study`: the plan (each script's family and tracks, printed), the suite
    (`benchmark.launch.run_suite`: a rerun skips what finished), then the report. A script that cannot be studied is one
    `error:` line (SystemExit)."""

    runs_dir = Path(workdir) / "runs"
    try:
        p = plan(scripts, tracks)
        study_name(p, name)
        check_name_length(p, name, runs_dir)
    except StudyError as e:
        raise SystemExit(f"error: {e}") from None
    todo = stages(p, seeds, shared_starts)
    title = f"study_{study_name(p, name)}"  # its status table too: runs/study_<name>_summary.md, one per study
    # every place it writes, before it prints its plan: not after every stage ran
    launch.check_outputs(workdir, [*launch.suite_outputs(title, todo, runs_dir), *outputs(p, name, runs_dir)])
    if not dry_run:  # read-only: a stage to run is refused here; a finished study's report is printed only
        launch.check_writable(runs_dir, todo, workdir, quick=True)
    for path, family, how in p.scripts:
        print(f"# {path.name}: family {family} ({how}); tracks {', '.join(t.track for t in p.by_family[family])}")
    # quick: the SFT and reward models at the quick suite's budgets (the study's own stages have no quick flags)
    print(f"# {design(shared_starts)}")
    print("\n".join(announce(p, todo, workdir, jobs)), flush=True)
    status = run_suite(title, seeds, workdir, dry_run, launcher, jobs, quick=True, live=live, stages=todo)
    if not dry_run:
        unwritable = launch.write_problem(runs_dir)  # a finished study rerun on a read-only copy: its report printed
        wrote = report(p, runs_dir, seeds, shared_starts, name, write=not unwritable)
        shown = [f"  nothing: {runs_dir} cannot be written ({unwritable})"] if unwritable else []
        print("\n".join(["", "wrote:", *shown, *(f"  {path}" for path in wrote)]))
        print("\n".join(["", f"studies in {runs_dir}:", *past_studies(runs_dir)]))
    return status
