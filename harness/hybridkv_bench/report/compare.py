"""`hybridkv report --compare RUN RUN...`: every case of every run side by side, per case and path, with each
figure's change against the first run, and which changes are regressions beyond noise.

The comparison a team makes most is a run against its predecessor: the same scenario, the same paths. So no
case stands for another: each (workload, case) gets one bar per run. Whether a change is a regression is
`report.regression`'s rule, on the figure computed on each measured repeat alone (`gate.repeat_metrics`): enough
repeats, a rank test and a minimum effect, so that two runs of one commit flag nothing.
Writes compare.png, compare.md and a self-contained compare.html.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hybridkv_bench.gate.checks import metric_values, repeat_metrics, spread_of
from hybridkv_bench.report import plots
from hybridkv_bench.report.html import write_html
from hybridkv_bench.report.markdown import case_table
from hybridkv_bench.report.regression import Verdict, judge, rule_text
from hybridkv_bench.report.tables import fmt, markdown_table
from hybridkv_bench.results.folder import Run, RunFolderError, load_run

Direction = Literal["lower", "higher"]
# (metric, header, which way is better): the figures compared, in this order
FIGURES: tuple[tuple[str, str, Direction], ...] = (
    ("ttft_warm_s", "warm TTFT s", "lower"), ("ttft_cold_s", "cold TTFT s", "lower"),
    ("lookup_s", "lookup s", "lower"), ("store_gbps", "store GB/s", "higher"), ("load_gbps", "load GB/s", "higher"),
    ("store_ceiling_ratio", "store / peak", "higher"), ("load_ceiling_ratio", "load / peak", "higher"),
    ("server_vram_mib", "server VRAM MiB", "lower"))
PLOTTED = ("ttft_warm_s", "store_gbps", "load_gbps")
# Shown, never judged: a ratio to a ceiling measured once per run carries that one measurement's noise, which the
# run's repeats cannot show (two runs of one commit on a loaded machine can give ratios far apart with tight
# repeats and the rates themselves within noise). The measured figures they divide are judged.
UNJUDGED = ("store_ceiling_ratio", "load_ceiling_ratio")


@dataclass(frozen=True, slots=True)
class Figure:
    """One figure of one case, in every run (None where a run lacks the case or did not measure it)."""

    workload: str
    case: str
    path: str                       # the case's wire format
    metric: str
    values: tuple[float | None, ...]
    repeats: tuple[tuple[float, ...], ...]   # the figure on each measured repeat alone, per run
    typical: tuple[float, ...] = ()  # the metric's median repeat spread over each run's cases (report.regression)

    @property
    def spreads(self) -> tuple[float | None, ...]:
        """(max - min) / median of each run's repeats."""
        return tuple(spread_of(list(r)) for r in self.repeats)

    def delta(self, i: int) -> float | None:
        """Run i's relative change against the first run."""
        a, b = self.values[0], self.values[i]
        if a is None or b is None or a == 0:
            return None
        return (b - a) / abs(a)

    def verdict(self, i: int) -> Verdict:
        """Whether run i's repeats moved beyond noise against the first run's (report.regression)."""
        if i == 0:
            return "baseline"
        if self.delta(i) is None or self.metric in UNJUDGED:
            return "n/a"
        return self._judged(i)[0]

    def median_change(self, i: int) -> float | None:
        return self._judged(i)[1]

    def _judged(self, i: int) -> tuple[Verdict, float | None]:
        typical = max(self.typical[0], self.typical[i]) if self.typical else 0.0
        return judge(list(self.repeats[0]), list(self.repeats[i]), DIRECTIONS[self.metric] == "lower", typical)


DIRECTIONS: dict[str, Direction] = {m: d for m, _, d in FIGURES}


def _number(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None if v is None else float(v)
    v = float(v)
    return None if math.isnan(v) else v


def labels_of(runs: list[Run]) -> list[str]:
    """A short, distinct label per run: its folder's name, with its parent's where two names repeat."""
    names = [r.folder.name for r in runs]
    out = [f"{r.folder.parent.name}/{r.folder.name}" if names.count(r.folder.name) > 1 else r.folder.name
           for r in runs]
    return [f"{lab} ({i + 1})" if out.count(lab) > 1 else lab for i, lab in enumerate(out)]


def compare_figures(runs: list[Run]) -> list[Figure]:
    """Every FIGURES metric of every (workload, case) found in any run, in the order the runs hold them."""
    if len(runs) < 2:
        raise RunFolderError(f"--compare needs two run folders or more, got {len(runs)}")
    tables = []
    for run in runs:
        df, _ = case_table(run)
        ok = {(r["workload"], r["case"]): r for r in df[df.status == "ok"].to_dict("records")}
        results = {(c.workload, c.name): c for c in run.cases if c.status == "ok"}
        tables.append((run, ok, results))
    keys = list(dict.fromkeys(k for _, ok, _ in tables for k in ok))
    if not keys:
        raise RunFolderError("the runs hold no finished case to compare")
    out = []
    for key in keys:
        path = next(str(ok[key]["wire_format"]) for _, ok, _ in tables if key in ok)
        # each repeat's metrics once per case, every figure read from them (a figure at a time recomputed them all)
        per_repeat = [repeat_metrics(run, results[key]) if key in results else [] for run, _, results in tables]
        for metric, _, _ in FIGURES:
            values, repeats = [], []
            for (_, ok, _), mine in zip(tables, per_repeat, strict=True):
                row = ok.get(key)
                values.append(_number(row.get(metric)) if row is not None else None)
                repeats.append(tuple(metric_values(mine, metric)))
            out.append(Figure(key[0], key[1], path, metric, tuple(values), tuple(repeats)))
    return with_typical_spreads(out, len(runs))


def with_typical_spreads(figures: list[Figure], n_runs: int) -> list[Figure]:
    """Each figure with its metric's median repeat spread over each run's cases."""
    typical: dict[str, tuple[float, ...]] = {}
    for metric in dict.fromkeys(f.metric for f in figures):
        per_run = []
        for i in range(n_runs):
            spreads = [s for f in figures if f.metric == metric and (s := f.spreads[i]) is not None]
            per_run.append(statistics.median(spreads) if spreads else 0.0)
        typical[metric] = tuple(per_run)
    return [dataclasses.replace(f, typical=typical[f.metric]) for f in figures]


def regressions(figures: list[Figure], labels: list[str]) -> list[str]:
    """One line per figure that regressed beyond noise, in any run after the first."""
    lines = []
    for f in figures:
        for i in range(1, len(labels)):
            if f.verdict(i) == "regressed":
                d = f.delta(i)
                assert d is not None
                m = f.median_change(i)
                assert m is not None
                lines.append(f"{f.workload} / {f.case}: {f.metric} {fmt(f.values[0])} -> {fmt(f.values[i])} "
                             f"({d:+.1%}; median of {len(f.repeats[i])} repeats {m:+.1%}, repeat spreads "
                             f"{_spread(f.spreads[0])} and {_spread(f.spreads[i])}) in {labels[i]}")
    return lines


def _cell(f: Figure, i: int) -> str:
    v = fmt(f.values[i])
    if i == 0:
        return v
    d = f.delta(i)
    return v if d is None else f"{v} ({d:+.1%})"


def _spread(s: float | None) -> str:
    return "n/a" if s is None else f"{s:.1%}"


def render_markdown(runs: list[Run], labels: list[str], figures: list[Figure], picture: Path | None) -> str:
    """compare.md: the runs, the regressions, then per workload every case's figures side by side."""
    headers = {m: h for m, h, _ in FIGURES}
    lines = ["# hybridkv runs compared", ""]
    lines += [markdown_table(["run", "folder", "scenario", "git sha", "device", "started"], [
        [lab, str(r.folder), r.scenario_name, str(r.record.context.get("git_sha", "?"))[:12],
         str(r.record.calibration.get("device", "?")), r.record.context.get("started_at", "?")]
        for lab, r in zip(labels, runs, strict=True)]), ""]
    lines += [f"> **{lab}: planted slowdown {r.record.context['planted_slowdown']:g}** (a test of this rule: each "
              "timed store and load waited that fraction of its own time more)\n"
              for lab, r in zip(labels, runs, strict=True) if r.record.context.get("planted_slowdown")]
    tested = sum(1 for f in figures for i in range(1, len(labels)) if f.verdict(i) not in ("n/a", "too few repeats"))
    lines += [f"Changes are against **{labels[0]}**. {rule_text()} *Repeat spread*: (max - min) / median over each "
              f"run's repeats. {tested} figures had enough repeats for a verdict.", ""]
    found = regressions(figures, labels)
    lines += ["## Regressions beyond noise", ""]
    lines += [f"- {line}" for line in found] if found else ["None."]
    lines += [""]
    if picture is not None:
        lines += [f"![compare]({picture.name})", ""]
    for workload in dict.fromkeys(f.workload for f in figures):
        lines += [f"## {workload}", ""]
        rows = []
        for f in (f for f in figures if f.workload == workload):
            if all(v is None for v in f.values):
                continue
            verdicts = [f.verdict(i) for i in range(1, len(labels))]
            rows.append([f.case, plots.WIRE_LABELS.get(f.path, f.path), headers[f.metric],
                         *(_cell(f, i) for i in range(len(labels))),
                         " / ".join(_spread(s) for s in f.spreads), ", ".join(verdicts)])
        lines += [markdown_table(["case", "path", "figure", *labels, "repeat spread", "verdict"], rows,
                                 "lll" + "r" * len(labels) + "rl"), ""]
    return "\n".join(lines)


def plot_runs(figures: list[Figure], labels: list[str], path: Path, workload: str) -> Path | None:
    """Per case of `workload`, one bar per run for each PLOTTED figure; the change against the first run on
    the later runs' bars, hatched where it is a regression beyond noise."""
    by_metric = {m: [f for f in figures if f.workload == workload and f.metric == m] for m in PLOTTED}
    cases = [f for f in by_metric[PLOTTED[0]]]
    if not cases:
        return None
    plt = plots._pyplot()
    n, width = len(labels), 0.8 / len(labels)
    fig, axes = plt.subplots(len(PLOTTED), 1, figsize=(max(8.0, 1.1 * len(cases) * n + 2), 3.6 * len(PLOTTED)))
    headers = {m: h for m, h, _ in FIGURES}
    for ax, metric in zip(axes, PLOTTED, strict=True):
        rows = by_metric[metric]
        for i, lab in enumerate(labels):
            xs = [c + (i - (n - 1) / 2) * width for c in range(len(rows))]
            vals = [f.values[i] if f.values[i] is not None else float("nan") for f in rows]
            bars = ax.bar(xs, vals, width, label=lab)
            for bar, f in zip(bars, rows, strict=True):
                if i and f.verdict(i) == "regressed":
                    bar.set_hatch("//")
                    bar.set_edgecolor("crimson")
            if i:
                ax.bar_label(bars, labels=[f"{d:+.0%}" if (d := f.delta(i)) is not None else "" for f in rows],
                             fontsize=7, padding=2)
        plots.log_if_wide(ax, [v for f in rows for v in f.values])
        better = "lower" if DIRECTIONS[metric] == "lower" else "higher"
        ax.set_title(f"{headers[metric]} ({better} is better; later runs' bars: change against {labels[0]}, "
                     "hatched: regressed beyond noise)", fontsize=9)
        ax.set_xticks(range(len(rows)), [f"{f.case}\n{plots.WIRE_LABELS.get(f.path, f.path)}" for f in rows],
                      fontsize=7)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{workload}: every case of every run side by side", fontsize=10)
    plots._save(plt, fig, path)
    return path


def compare(folders: list[str], out: str | Path, workload: str | None = None) -> tuple[list[Path], list[str]]:
    """Load the run folders and write compare.png, compare.md and compare.html into `out`; returns their paths
    and the regression lines."""
    runs = [load_run(f) for f in folders]
    labels = labels_of(runs)
    figures = compare_figures(runs)
    workloads = list(dict.fromkeys(f.workload for f in figures))
    if workload is not None and workload not in workloads:
        raise RunFolderError(f"no run holds finished cases of workload {workload!r} (they hold {workloads})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    picture = plot_runs(figures, labels, out / "compare.png", workload or workloads[0])
    md = out / "compare.md"
    md.write_text(render_markdown(runs, labels, figures, picture))
    html = write_html(md, out / "compare.html", "hybridkv runs compared")
    return [p for p in (md, html, picture) if p is not None], regressions(figures, labels)
