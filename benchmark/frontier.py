"""The KL frontier (issue 22): how much gold reward each algorithm buys per unit of KL from its reference, and where
optimising an imperfect proxy starts to lower the gold reward (Gao et al. 2022, "Scaling Laws for Reward Model
Overoptimization", arXiv:2210.10760).

`python -m benchmark.frontier RUN_DIR... [--metric eval/gold_reward] [--proxy eval/score] [--budgets 0.25 0.5 1]`
draws it for any runs evaluated with `--eval-kl`: each group is the run name without its `__<seed>` (as
`benchmark.compare` groups), whatever the name. `benchmark.results` draws it for the frontier suites
(`benchmark/suites.py` FRONTIER_TLDR: `<algo>-<kl|beta><value>_<track>__<seed>`), where one algorithm's settings are one
row. Finished runs only; from every evaluation row it takes `eval/kl` (the same estimator in every script:
`sampled_kl`), the gold metric and the proxy (`eval/score`, the reward model the policy optimises). Writes:

* the frontier table: for each algorithm and KL budget, the best gold reward of any of its evaluations (any penalty
  value, any step) whose KL is within the budget, per seed, then mean [95% bootstrap CI] over seeds; below it, the
  pairs of algorithms whose intervals do not overlap at some budget (or a line saying none do);
* the over-optimisation table: per algorithm and penalty, the seeds in which the gold reward falls by at least
  OVEROPT_DROP from its peak while the proxy score ends at or above its value at that peak;
* a plot: gold reward against KL (left) and the proxy score against KL (right), one line per algorithm and penalty
  (mean over seeds of each evaluation), a star where the mean gold reward peaks on a curve that over-optimises in
  most seeds.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmark.curves import (
    MIN_SEEDS_FOR_CI,
    Colours,
    Run,
    bootstrap_ci,
    finished_runs,
    outputs,
    read_runs,
    select_runs,
    warn_problems,
)

NAME = re.compile(r"^(?P<algo>.+)-(?P<penalty>kl|beta)(?P<value>[0-9.]+)_(?P<track>[^_]+)__(?P<seed>\d+)$")
OVEROPT_DROP = 0.1
"""gold reward lost after its peak, with the proxy not lower than at the peak, that counts as over-optimisation"""
TRACKS = {  # track: (gold metric, proxy metric or None, KL budgets of the table)
    "tiny-tldr-noisy": ("eval/gold_reward", "eval/score", [0.25, 0.5, 1.0, 2.0, 4.0]),
    "tiny-math-kl": ("eval/accuracy", None, [0.1, 0.25, 0.5, 1.0, 2.0]),  # RLOO stays within KL 0.2 here
}
BUDGETS = [0.25, 0.5, 1.0, 2.0, 4.0]
"""the KL budgets of the table when the command names none"""


@dataclass
class Curve:
    algo: str
    penalty: str
    """`kl0.005` or `beta0.1` (a frontier suite's run name); empty for a group named in full"""
    seed: int
    kl: np.ndarray
    gold: np.ndarray
    proxy: np.ndarray | None


def read_curves(source, track: str) -> list[Curve]:
    """The curves of a frontier suite's runs of `track` (a runs directory, or runs already read: `select_runs`), one
    algorithm's settings apart by the name's `-kl<v>` / `-beta<v>`."""
    gold_m, proxy_m, _ = TRACKS[track]
    runs = [r for r in select_runs(source, f"*_{track}__*") if NAME.match(r.name)]

    def name(run: Run) -> tuple[str, str, int]:
        m = NAME.match(run.name)
        return m["algo"], f"{m['penalty']}{m['value']}", int(m["seed"])

    return curves_of(finished_runs(runs), gold_m, proxy_m, name)


def by_full_name(run: Run) -> tuple[str, str, int]:
    """A group named in full: the run name without `__<seed>`, no setting; the seed from the name (1 without one)."""
    m = re.search(r"__(\d+)$", run.name)
    return run.group, "", int(m[1]) if m else 1


def curves_of(runs: list[Run], gold_m: str, proxy_m: str | None, name=by_full_name) -> list[Curve]:
    """A curve per run from its evaluations that hold `eval/kl` and `gold_m` (and `proxy_m`, when every evaluation has
    it); `name(run)` gives its (group, setting, seed). Non-finite evaluations are left out with a warning; a negative
    `eval/kl` (an estimate can fall below 0) is kept, within every budget, with a warning naming the run."""
    curves = []
    for run in runs:
        rows = [r for r in run.rows if "eval/kl" in r and gold_m in r]
        finite = [r for r in rows if all(np.isfinite(float(r.get(k, 0.0))) for k in ("eval/kl", gold_m, proxy_m or ""))]
        if len(finite) < len(rows):  # a point of the frontier is a finite evaluation; a diverged run keeps its earlier
            print(
                f"warning: {run.name}: {len(rows) - len(finite)} of its {len(rows)} evaluations are not finite "
                "(diverged?); left out of the frontier",
                file=sys.stderr,
            )
        rows = finite
        if below := [r for r in rows if float(r["eval/kl"]) < 0]:  # `sampled_kl` estimates: near the reference, < 0
            low = min(below, key=lambda r: float(r["eval/kl"]))
            print(
                f"warning: {run.name}: {len(below)} of its {len(rows)} evaluations have a negative eval/kl (lowest "
                f"{float(low['eval/kl']):.4g}, step {low.get('step', '?')}): an estimate below 0, the least a KL can "
                "be, counted as within every KL budget",
                file=sys.stderr,
            )
        if not rows:
            continue
        algo, penalty, seed = name(run)
        curves.append(
            Curve(
                algo,
                penalty,
                seed,
                np.array([r["eval/kl"] for r in rows], float),
                np.array([r[gold_m] for r in rows], float),
                np.array([r[proxy_m] for r in rows], float) if proxy_m and all(proxy_m in r for r in rows) else None,
            )
        )
    return curves


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% bootstrap interval over seeds (the values' range with fewer than MIN_SEEDS_FOR_CI)."""
    v = np.asarray(values, float)
    low, high = bootstrap_ci(v) if len(v) >= MIN_SEEDS_FOR_CI else (float(v.min()), float(v.max()))
    return float(v.mean()), low, high


def best_within(curves: list[Curve], budget: float) -> dict[int, float]:
    """Per seed: the best gold reward among the evaluations (of any of these curves) with KL <= budget."""
    best: dict[int, float] = {}
    for c in curves:
        inside = c.gold[c.kl <= budget]
        if len(inside):
            best[c.seed] = max(best.get(c.seed, -np.inf), float(inside.max()))
    return best


def overoptimised(c: Curve) -> bool:
    """Gold falls by OVEROPT_DROP or more after its peak while the proxy ends at or above its value at the peak."""
    if c.proxy is None:
        return False
    peak = int(np.argmax(c.gold))
    return bool(c.gold[peak] - c.gold[peak:].min() >= OVEROPT_DROP and c.proxy[-1] >= c.proxy[peak])


def frontier_tables(curves: list[Curve], budgets: list[float], metric: str = "eval/gold_reward") -> str:
    by_algo: dict[str, list[Curve]] = defaultdict(list)
    for c in curves:
        by_algo[c.algo].append(c)
    cells: dict[str, dict[float, tuple[float, float, float, int]]] = defaultdict(dict)
    lines = [
        "| algorithm | settings | " + " | ".join(f"KL <= {b:g}" for b in budgets) + " |",
        "|" + " --- |" * (len(budgets) + 2),
    ]
    for algo in sorted(by_algo):
        row = []
        for b in budgets:
            best = best_within(by_algo[algo], b)
            if not best:
                row.append("-")
                continue
            mean, low, high = interval(list(best.values()))
            cells[algo][b] = (mean, low, high, len(best))
            row.append(
                f"{mean:.3f} ({len(best)})" if len(best) == 1 else f"{mean:.3f} [{low:.3f}, {high:.3f}] ({len(best)})"
            )
        settings = ", ".join(sorted({c.penalty for c in by_algo[algo]})) or "-"
        lines.append(f"| {algo} | {settings} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append(
        f"Each cell: the best `{metric}` reached with `eval/kl` within the budget (any setting, any evaluation), mean "
        "[95% bootstrap interval] over seeds (their range with 2, the value alone with 1), (seeds)."
    )
    separated = []
    for b in budgets:
        algos = [a for a in sorted(cells) if b in cells[a] and cells[a][b][3] >= MIN_SEEDS_FOR_CI]
        for i, a in enumerate(algos):
            for other in algos[i + 1 :]:
                (ma, la, ha, _), (mo, lo, ho, _) = cells[a][b], cells[other][b]
                if ha < lo or ho < la:
                    hi_name, lo_name = (a, other) if ma > mo else (other, a)
                    separated.append(f"KL <= {b:g}: {hi_name} > {lo_name}")
    lines.append("")
    lines.append(
        "Separated (non-overlapping 95% intervals over 3 or more seeds): "
        + ("; ".join(separated) if separated else "none")
        + "."
    )
    few = [
        (
            b,
            sorted(
                ((cells[a][b][0], a) for a in cells if b in cells[a] and cells[a][b][3] < MIN_SEEDS_FOR_CI),
                reverse=True,
            ),
        )
        for b in budgets
    ]
    few = [(b, order) for b, order in few if len(order) > 1]
    if few:  # one or two seeds (the main job): no interval to test, but the measured order and gaps say something
        lines += [
            "",
            f"With fewer than {MIN_SEEDS_FOR_CI} seeds there is no interval: the order at each budget, a measured gap "
            "and not a tested separation: "
            + "; ".join(f"KL <= {b:g}: " + " > ".join(f"{a} {m:.3f}" for m, a in order) for b, order in few)
            + ".",
        ]
    lines += [
        "",
        f"Over-optimisation (gold falls by {OVEROPT_DROP} or more after its peak while the proxy score ends at or "
        "above its value at the peak):",
        "",
        "| algorithm | setting | seeds over-optimised | gold: peak (KL) -> end (KL) | proxy: at peak -> end |",
        "| --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple[str, str], list[Curve]] = defaultdict(list)
    for c in curves:
        groups[(c.algo, c.penalty)].append(c)
    for (algo, penalty), cs in sorted(groups.items()):
        flagged = sum(overoptimised(c) for c in cs)
        peaks = [int(np.argmax(c.gold)) for c in cs]
        gold_peak = np.mean([c.gold[p] for c, p in zip(cs, peaks)])
        kl_peak = np.mean([c.kl[p] for c, p in zip(cs, peaks)])
        gold_end, kl_end = np.mean([c.gold[-1] for c in cs]), np.mean([c.kl[-1] for c in cs])
        proxy = "-"
        if all(c.proxy is not None for c in cs):
            proxy = (
                f"{np.mean([c.proxy[p] for c, p in zip(cs, peaks)]):.2f} -> {np.mean([c.proxy[-1] for c in cs]):.2f}"
            )
        lines.append(
            f"| {algo} | {penalty or '-'} | {flagged} of {len(cs)} | {gold_peak:.3f} ({kl_peak:.2f}) -> {gold_end:.3f} "
            f"({kl_end:.2f}) | {proxy} |"
        )
    return "\n".join(lines) + "\n"


def mean_curves(curves: list[Curve]) -> dict[tuple[str, str], dict]:
    """Per algorithm and setting, the mean over seeds of each evaluation (the seeds evaluate at the same episodes)."""
    groups: dict[tuple[str, str], list[Curve]] = defaultdict(list)
    for c in curves:
        groups[(c.algo, c.penalty)].append(c)
    out = {}
    for key, cs in sorted(groups.items()):
        n = min(len(c.kl) for c in cs)
        mean = {f: np.mean([getattr(c, f)[:n] for c in cs], axis=0) for f in ("kl", "gold")}
        mean["proxy"] = np.mean([c.proxy[:n] for c in cs], axis=0) if all(c.proxy is not None for c in cs) else None
        mean["seeds"] = len(cs)
        mean["overoptimised"] = sum(overoptimised(c) for c in cs)
        out[key] = mean
    return out


def _setting_order(penalty: str) -> float:
    """The strongest penalty first (`kl0.05` before `kl0.005`); a group without a setting is one line."""
    value = re.sub(r"[a-z]", "", penalty)
    try:
        return -float(value)
    except ValueError:
        return 0.0


def plot_frontier(
    curves: list[Curve],
    track: str | None,
    out_png: Path,
    colours: Colours | None = None,
    metrics: tuple[str, str | None, list[float]] | None = None,
) -> None:
    """Gold (and proxy) against KL, a line per group and setting, one colour per group (`colours`, shared with the
    other figures of a command), a line style per setting. `metrics`: (gold, proxy, budgets), by default
    `TRACKS[track]`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gold_m, proxy_m, budgets = metrics or TRACKS[track]
    means = mean_curves(curves)
    algos = sorted({a for a, _ in means})
    colours = colours if colours is not None else Colours(algos)
    styles = ["-", "--", ":", "-."]
    panels = [("gold", gold_m)] + ([("proxy", proxy_m)] if proxy_m else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (field, label) in zip(axes[0], panels):
        for (algo, penalty), m in means.items():
            if m[field] is None:
                continue
            settings = sorted({p for a, p in means if a == algo}, key=_setting_order)
            color, style = colours[algo], styles[settings.index(penalty) % len(styles)]
            seeds = "1 seed" if m["seeds"] == 1 else f"mean of {m['seeds']} seeds"
            ax.plot(
                m["kl"],
                m[field],
                style,
                marker=".",
                color=color,
                label=f"{algo} {penalty} ({seeds})".replace("  ", " "),
            )
            if 2 * m["overoptimised"] > m["seeds"] and m["proxy"] is not None:  # most seeds over-optimise
                peak = int(np.argmax(m["gold"]))
                ax.plot(m["kl"][peak], m[field][peak], "*", color=color, markersize=14, markeredgecolor="black")
        for budget in budgets:  # the table's KL budgets
            ax.axvline(budget, color="grey", linestyle=":", linewidth=0.8)
        # linear below 0.1, logarithmic above: the algorithms that stay near their reference are apart, not stacked
        ax.set_xscale("symlog", linthresh=0.1, linscale=0.5)
        lowest = min(float(m["kl"].min()) for m in means.values())
        ax.set_xlim(left=min(lowest, 0.0) - 0.01)  # k1 estimates near 0 can be slightly negative
        ax.set_xlabel("eval/kl: KL(policy || reference), nats per response (symlog axis)")
        ax.set_ylabel(label + (" (proxy: the reward model optimised)" if field == "proxy" else ""))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    title = f"{track or 'frontier'}: {gold_m} against KL; dotted: the table's KL budgets" + (
        "; star: the gold peak before over-optimisation" if proxy_m else ""
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def write_frontier(source, track: str, out_dir: Path | None = None, colours: Colours | None = None) -> str | None:
    """Writes OUT_DIR/frontier_<track>.md and .png (OUT_DIR: the runs directory `source`, unless given); returns the
    table, or None when the track has no frontier runs."""
    curves = read_curves(source, track)
    if not curves:
        return None
    out_dir = Path(out_dir if out_dir is not None else source)
    md = frontier_tables(curves, TRACKS[track][2], TRACKS[track][0])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"frontier_{track}.md").write_text(md)
    plot_frontier(curves, track, out_dir / f"frontier_{track}.png", colours)
    return md


def kl_budget(text: str) -> float:
    """A KL budget of the table: a number >= 0 (`nan` and `inf` would make a column no run can fill, or every one)."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a KL budget (a finite number >= 0, in nats per response)")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories evaluated with --eval-kl (each with a metrics.jsonl)")
    parser.add_argument("--metric", default="eval/gold_reward", help="the gold metric (y-axis of the frontier)")
    parser.add_argument(
        "--proxy", default="eval/score", help="the proxy the policy optimises (right panel; left out if not logged)"
    )
    parser.add_argument("--budgets", type=kl_budget, nargs="+", default=BUDGETS, help="KL budgets of the table")
    parser.add_argument("--out", default="runs/frontier", help="output prefix: writes OUT.png and OUT.md")
    a = parser.parse_args(argv)
    runs = read_runs([Path(p) for p in a.runs])  # damage (benchmark/runfiles.py) ends here in one `error:` line
    warn_problems(runs)
    runs = finished_runs(runs)
    proxy = a.proxy if any(a.proxy in row for r in runs for row in r.rows) else None
    curves = curves_of(runs, a.metric, proxy)
    if not curves:
        have = [r for r in runs if any(a.metric in row for row in r.rows)]
        why = (
            "none logs eval/kl (run the scripts with --eval-kl)"
            if have
            else f"none logs {a.metric} (choose the gold metric with --metric)"
        )
        print(f"error: no finished run of the {len(runs)} read has a point of the frontier: {why}", file=sys.stderr)
        return 1
    for r in runs:
        if not any(c.algo == r.group for c in curves):
            print(f"warning: {r.name} has no evaluation with eval/kl and {a.metric}; left out", file=sys.stderr)
    md = frontier_tables(curves, a.budgets, a.metric)
    out_png, out_md = outputs(Path(a.out))  # a dotted name kept whole
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(md)
    plot_frontier(curves, None, out_png, metrics=(a.metric, proxy, a.budgets))
    print(md)
    print(f"wrote {out_png} and {out_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
