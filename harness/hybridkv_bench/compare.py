"""`hybridkv report --compare RUN...`: one picture of hybridkv's shm path against CUDA-IPC and the seed's
pickle / torch.save, from the cases of several runs: warm TTFT (log axis), store and load rate as a
fraction of each run's own copy ceiling, and the cache server's VRAM.

Per wire format the case with the lowest warm TTFT on the chosen workload stands for it; the picture
names that case and its run, so nothing is hidden behind a label.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from . import plots
from .report import case_table, markdown_table
from .results import Run, RunFolderError, load_run

# The paths the picture compares, in this order; formats a run does not hold are left out.
COMPARED = ("shm", "cuda_ipc", "pickle", "torch_save")


@dataclass(frozen=True, slots=True)
class Entry:
    """One wire format's representative: its best case and the run it came from."""

    wire: str
    run: str
    case: dict


def _rows(runs: list[Run]) -> pd.DataFrame:
    frames = []
    for run in runs:
        df, _ = case_table(run)
        df["run"] = run.folder.name
        df["device"] = str(run.record.calibration.get("device", "?"))
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def pick(runs: list[Run], workload: str | None = None) -> tuple[str, list[Entry]]:
    """The workload compared (default: the first one every run holds) and one entry per wire format."""
    if not runs:
        raise RunFolderError("--compare needs at least one run folder")
    df = _rows(runs)
    ok = df[(df.status == "ok") & df.ttft_warm_s.notna()]
    names = [list(dict.fromkeys(ok[ok.run == r.folder.name].workload)) for r in runs]
    common = [w for w in names[0] if all(w in n for n in names[1:])]
    if workload is None:
        if not common:
            raise RunFolderError(f"the runs share no workload with measured cases: {names}")
        workload = common[0]
    elif workload not in set(ok.workload):
        raise RunFolderError(f"no run holds measured cases of workload {workload!r} "
                             f"(they hold {sorted(set(ok.workload))})")
    sub = ok[ok.workload == workload]
    entries = []
    for wire in COMPARED:
        cases = sub[sub.wire_format == wire].sort_values("ttft_warm_s")
        if not cases.empty:
            best = cases.iloc[0].to_dict()
            entries.append(Entry(wire=wire, run=str(best["run"]), case=best))
    if not entries:
        raise RunFolderError(f"no case of {', '.join(COMPARED)} measured on {workload!r}")
    return workload, entries


def _value(entry: Entry, metric: str) -> float | None:
    v = entry.case.get(metric)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _gbps(e: Entry) -> str:
    """Store / load GB/s under a bar of the ratio panel."""
    st, ld = _value(e, "store_gbps"), _value(e, "load_gbps")
    return f"{'n/a' if st is None else f'{st:.3g}'} / {'n/a' if ld is None else f'{ld:.3g}'} GB/s"


def plot_compare(runs: list[Run], path: Path, workload: str | None = None) -> tuple[Path, str]:
    """Draw the comparison; returns the PNG's path and a Markdown table of the same figures."""
    workload, entries = pick(runs, workload)
    plt = plots._pyplot()
    labels = [plots.WIRE_LABELS.get(e.wire, e.wire) for e in entries]
    ticks = [lab.replace(" ", "\n", 1) for lab in labels]  # two short lines fit under a bar
    xs = range(len(entries))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))

    warm = [_value(e, "ttft_warm_s") or float("nan") for e in entries]
    ax = axes[0]
    bars = ax.bar(xs, warm, color="tab:orange")
    ax.bar_label(bars, labels=[f"{w:.3g} s" for w in warm], fontsize=8, padding=2)
    cold = [c for e in entries if (c := _value(e, "ttft_cold_s")) is not None]
    if cold:
        ax.axhline(float(pd.Series(cold).median()), color="tab:blue", linestyle="--",
                   label=f"cold TTFT (no cache) {pd.Series(cold).median():.3g} s")
        ax.legend(fontsize=8, loc="upper left")
    plots.log_if_wide(ax, [*warm, *cold])
    ax.set_yscale("log")  # warm TTFTs of these paths differ by orders of magnitude: always log
    ax.set_ylabel("seconds (log scale)")
    ax.set_title("warm TTFT (lower is better)", fontsize=10)

    ax = axes[1]
    width = 0.4
    for i, (metric, name) in enumerate((("store_ceiling_ratio", "store"), ("load_ceiling_ratio", "load"))):
        ratios = [_value(e, metric) or float("nan") for e in entries]
        b = ax.bar([x - 0.2 + i * width for x in xs], ratios, width, label=name)
        ax.bar_label(b, labels=[f"{r:.2g}" if r == r else "n/a" for r in ratios], fontsize=8, padding=2)
    ax.axhline(1.0, color="crimson", linestyle="--", label="copy ceiling measured in the same run")
    if not plots.log_if_wide(ax, [*(_value(e, "store_ceiling_ratio") for e in entries),
                                  *(_value(e, "load_ceiling_ratio") for e in entries), 1.0]):
        ax.set_ylim(0, 1.25)
    ax.set_ylabel("fraction of the ceiling")
    ax.set_title("store / load rate as a fraction of the ceiling (higher is better)", fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    rate_ticks = [f"{t}\n{_gbps(e)}" for t, e in zip(ticks, entries, strict=True)]

    ax = axes[2]
    vram = [_value(e, "server_vram_mib") for e in entries]
    b = ax.bar(xs, [v or 0.0 for v in vram], color="tab:gray")
    ax.bar_label(b, labels=["not measured" if v is None else f"{v:,.0f} MiB" for v in vram], fontsize=8, padding=2)
    ax.set_ylim(0, max([v or 0.0 for v in vram] + [1.0]) * 1.2)
    ax.set_ylabel("MiB")
    ax.set_title("cache server VRAM (NVML, by process id)", fontsize=10)

    for a in axes:
        a.set_xticks(list(xs), rate_ticks if a is axes[1] else ticks, fontsize=8)
        a.grid(axis="y", alpha=0.3, which="both")
    devices = sorted({str(e.case["device"]) for e in entries})
    model = runs[0].record.scenario.get("model", {})
    fig.suptitle(f"{model.get('preset')} tp={model.get('tp')}, {workload}, on {' / '.join(devices)}: "
                 "each path's fastest case (warm TTFT = lookup + load measured + prefill of the tail modeled)",
                 fontsize=10)
    fig.text(0.01, 0.005, "cases: " + "; ".join(f"{lab} = {e.run}/{e.case['case']}"
                                               for lab, e in zip(labels, entries, strict=True)),
             fontsize=7, color="dimgray")
    plots._save(plt, fig, path)
    table = markdown_table(
        ["path", "case (run)", "warm TTFT s", "store GB/s (of ceiling)", "load GB/s (of ceiling)", "server VRAM MiB"],
        [[lab, f"{e.case['case']} ({e.run})", _value(e, "ttft_warm_s"),
          f"{plots._label(_value(e, 'store_gbps') or math.nan)} ({_value(e, 'store_ceiling_ratio') or math.nan:.2g})",
          f"{plots._label(_value(e, 'load_gbps') or math.nan)} ({_value(e, 'load_ceiling_ratio') or math.nan:.2g})",
          _value(e, "server_vram_mib")] for lab, e in zip(labels, entries, strict=True)], "llrrrr")
    return path, table


def compare(folders: list[str], out: str | Path, workload: str | None = None) -> tuple[Path, str]:
    """Load the run folders and write compare.png into `out`."""
    runs = [load_run(f) for f in folders]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return plot_compare(runs, out / "compare.png", workload)
