"""The report's figures, drawn from the case table that `report.case_table` builds from the CSV.

Each function writes one PNG and returns its path, or None when the run holds nothing to draw.
Where several cases share an x position (say every shm case), a bar is their median and the whisker
spans their minimum to maximum, so a spread is shown, not hidden. Axes turn logarithmic when the values
on them span more than LOG_SPAN; a panel whose figure was not measured is left out and the figure says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from hybridkv.wire.wire_formats import FORMATS, TRAITS

AXIS_ORDER: dict[str, list[str]] = {
    "wire_format": list(FORMATS),
    "copy_engine": ["kernel", "dma"],
    "streams": ["single", "per_group"],
    "retrieve_policy": ["boundary", "all"],
    "store_policy": ["boundary", "all"],
}
WIRE_LABELS: dict[str, str] = {f: t.label for f, t in TRAITS.items()}
LOG_SPAN = 10.0  # max/min above which an axis is drawn logarithmic
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Setting:
    """What the figures must say about where the run was taken."""

    gpu: bool                 # the engine's pages were on a GPU (else: CPU tensors, no PCIe involved)
    device: str               # as calibrated, e.g. "NVIDIA H200" or "cpu"
    d2h_peak: float | None    # the same-run copy ceilings, GB/s
    h2d_peak: float | None

    @classmethod
    def of(cls, calibration: dict) -> Setting:
        gpu = str(calibration.get("method", "")).startswith("cuda")
        return cls(gpu=gpu, device=str(calibration.get("device", "cpu" if not gpu else "GPU")),
                   d2h_peak=calibration.get("d2h_peak_gbps"), h2d_peak=calibration.get("h2d_peak_gbps"))

    @property
    def store_path(self) -> str:
        return "GPU -> server arena (D2H)" if self.gpu else "engine pool -> server arena (CPU memcpy, no GPU)"

    @property
    def load_path(self) -> str:
        return "server arena -> GPU (H2D)" if self.gpu else "server arena -> engine pool (CPU memcpy, no GPU)"

    @property
    def ceiling(self) -> str:
        return "pinned-copy ceiling" if self.gpu else "memcpy ceiling"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Write a figure as PNG and release it (pyplot keeps every open figure alive)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ordered(values, axis: str) -> list:
    known = AXIS_ORDER.get(axis, [])
    present = list(dict.fromkeys(values))
    return [v for v in known if v in present] + sorted(v for v in present if v not in known)


def _clean(samples) -> list[float]:
    return [float(s) for s in samples if s is not None and s == s]


def log_if_wide(ax, values, axis: str = "y") -> bool:
    """Log scale when the positive values span more than LOG_SPAN; returns whether it did."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    pos = [v for v in _clean(values) if v > 0]
    wide = bool(pos) and max(pos) / min(pos) > LOG_SPAN
    if wide:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
        # bars start well below the smallest one, so that it still shows as a bar; plain numbers on the ticks
        (ax.set_ylim if axis == "y" else ax.set_xlim)(min(pos) / 4, max(pos) * 2.5)
        target = ax.yaxis if axis == "y" else ax.xaxis
        target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        target.set_minor_formatter(NullFormatter())
    return wide


def byte_unit(largest: float) -> tuple[float, str]:
    """The divisor and name of a readable unit (1e3 steps) for byte counts up to `largest`."""
    for div, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if largest >= div:
            return div, name
    return 1.0, "B"


def _label(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _bars(ax, groups: list[str], series: dict[str, list], ylabel: str, annotate: bool = False) -> list[float]:
    """Grouped bars: one group per x label, one bar per series; each value a list of samples. Returns the
    medians drawn (for the caller's axis choice)."""
    n = len(series)
    width = 0.8 / max(n, 1)
    drawn = []
    for i, (label, per_group) in enumerate(series.items()):
        meds, lo, hi, xs = [], [], [], []
        for j, raw in enumerate(per_group):
            samples = _clean(raw)
            if not samples:
                continue
            med = float(pd.Series(samples).median())
            xs.append(j - 0.4 + width * (i + 0.5))
            meds.append(med)
            lo.append(med - min(samples))
            hi.append(max(samples) - med)
        if xs:
            bars = ax.bar(xs, meds, width, label=label, yerr=[lo, hi], capsize=3)
            if annotate:
                ax.bar_label(bars, labels=[_label(m) for m in meds], fontsize=8, padding=2)
            drawn += meds
    ax.set_xticks(range(len(groups)), groups, rotation=20 if max(map(len, groups), default=0) > 8 else 0,
                  ha="right" if max(map(len, groups), default=0) > 8 else "center")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3, which="both")
    return drawn


def _samples(df: pd.DataFrame, by: list[str], keys: list[tuple], metric: str) -> list[list]:
    out = []
    for key in keys:
        mask = pd.Series(True, index=df.index)
        for col, val in zip(by, key, strict=True):
            mask &= df[col] == val
        out.append(df.loc[mask, metric].dropna().tolist())
    return out


def fastest_cases(df: pd.DataFrame) -> dict[str, list[dict]]:
    """Per workload, per wire format (in AXIS_ORDER), its case with the lowest warm TTFT: what the report's
    headline and ttft.png both show, so that they rank the paths alike."""
    ok = df[(df.status == "ok") & df.ttft_warm_s.notna()]
    out: dict[str, list[dict]] = {}
    for wl, sub in ok.groupby("workload", sort=False):
        out[str(wl)] = [sub[sub.wire_format == wire].sort_values("ttft_warm_s").iloc[0].to_dict()
                        for wire in _ordered(sub.wire_format, "wire_format")]
    return out


def plot_ttft(df: pd.DataFrame, path: Path, setting: Setting) -> Path | None:
    """Cold vs warm TTFT (p50) of each wire format's fastest case (fastest_cases, as in the headline), one panel
    per workload, log axis when they span decades."""
    fastest = fastest_cases(df)
    if not fastest:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(fastest), 1, figsize=(8.5, 3.8 * len(fastest)), squeeze=False)
    for ax, (wl, rows) in zip(axes[:, 0], fastest.items(), strict=True):
        drawn = _bars(ax, [WIRE_LABELS.get(r["wire_format"], r["wire_format"]) for r in rows],
                      {"cold (miss: prefill of the whole prompt)": [[r["ttft_cold_s"]] for r in rows],
                       "warm (hit: lookup + load + prefill of the tail)": [[r["ttft_warm_s"]] for r in rows]},
                      "TTFT p50 (seconds)", annotate=True)
        wide = log_if_wide(ax, drawn)
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * (4 if wide else 1.35))  # headroom: the legend sits above the bars
        ax.set_title(f"{wl}: time to first token, {setting.device}\n(each path's case with the lowest warm TTFT, "
                     f"as in report.md's headline; {'log' if wide else 'linear'} scale)", fontsize=10)
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.text(0.01, 0.005, "prefill is modeled, lookup and load measured (report.md: how each TTFT is composed)",
             fontsize=7, color="dimgray")
    return _save(plt, fig, path)


def plot_throughput(df: pd.DataFrame, path: Path, setting: Setting) -> Path | None:
    """Store and load rate as a fraction of the same-run copy ceiling, GB/s written on each bar."""
    ok = df[df.status == "ok"]
    if ok.empty or ok[["store_gbps", "load_gbps"]].isna().all().all():
        return None
    plt = _pyplot()
    by = ["wire_format", "copy_engine", "streams"]
    keys = sorted({tuple(r) for r in ok[by].itertuples(index=False)},
                  key=lambda k: tuple(_ordered(ok[a], a).index(v) for a, v in zip(by, k, strict=True)))
    labels = ["/".join(k) for k in keys]
    fig, axes = plt.subplots(2, 1, figsize=(max(8.5, 0.75 * len(keys) + 3), 8))
    for ax, metric, ratio, peak, what in (
            (axes[0], "store_gbps", "store_ceiling_ratio", setting.d2h_peak, f"store: {setting.store_path}"),
            (axes[1], "load_gbps", "load_ceiling_ratio", setting.h2d_peak, f"load: {setting.load_path}")):
        if peak:
            drawn = _bars(ax, labels, {"fraction of the ceiling": _samples(ok, by, keys, ratio)},
                          f"fraction of the {setting.ceiling}", annotate=True)
            wide = log_if_wide(ax, [*drawn, 1.0])  # the ceiling line belongs on the axis too
            if not wide:
                ax.set_ylim(0, max(1.05, max(drawn, default=0) * 1.1))
            ax.axhline(1.0, color="crimson", linestyle="--", label=f"{setting.ceiling} {peak:.3g} GB/s = 1")
            rates = [pd.Series(_clean(s)).median() if _clean(s) else float("nan")
                     for s in _samples(ok, by, keys, metric)]
            ax.set_xticks(range(len(keys)), [f"{lab}\n{r:.3g} GB/s" for lab, r in zip(labels, rates, strict=True)],
                          rotation=20, ha="right", fontsize=8)
            ax.set_title(f"{what}: payload rate / ceiling measured in this run"
                         f"{' (log scale)' if wide else ''}", fontsize=10)
        else:
            drawn = _bars(ax, labels, {metric: _samples(ok, by, keys, metric)}, "GB/s (1e9 B/s)", annotate=True)
            log_if_wide(ax, drawn)
            ax.set_title(f"{what}: payload rate (no ceiling calibrated in this run)", fontsize=10)
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_server(df: pd.DataFrame, path: Path) -> Path | None:
    """What the cache server holds per wire format: resident memory beside its shared-memory arena, and
    VRAM where it could be measured (the panel is left out, with a note, where it could not)."""
    ok = df[df.status == "ok"]
    if ok.empty:
        return None
    plt = _pyplot()
    formats = _ordered(ok.wire_format, "wire_format")
    keys = [(f,) for f in formats]
    labels = [WIRE_LABELS.get(f, f) for f in formats]
    vram = _samples(ok, ["wire_format"], keys, "server_vram_mib")
    measured_vram = any(vram)
    fig, axes = plt.subplots(1, 2 if measured_vram else 1, figsize=(12 if measured_vram else 8, 4.2),
                             squeeze=False)
    mem = axes[0, 0]
    drawn = _bars(mem, labels, {
        "resident (RSS)": _samples(ok, ["wire_format"], keys, "server_rss_mib"),
        "arena in use": _samples(ok, ["wire_format"], keys, "arena_used_mib"),
        "arena size": _samples(ok, ["wire_format"], keys, "arena_capacity_mib"),
    }, "MiB", annotate=True)
    wide = log_if_wide(mem, drawn)
    mem.set_title(f"server host memory: RSS beside its /dev/shm arena{' (log scale)' if wide else ''}", fontsize=10)
    mem.legend(fontsize=8)
    if measured_vram:
        vax = axes[0, 1]
        _bars(vax, labels, {"VRAM": vram}, "MiB", annotate=True)
        vax.set_title("server VRAM (NVML, by process id; 0 expected)", fontsize=10)
    else:
        fig.text(0.01, 0.005, "server VRAM: not measurable here (no NVML or no GPU), panel left out",
                 fontsize=8, color="dimgray")
    return _save(plt, fig, path)


def plot_policies(df: pd.DataFrame, path: Path) -> Path | None:
    """Tokens hit and bytes loaded per retrieve policy; bytes stored per store policy."""
    ok = df[df.status == "ok"]
    if ok.empty:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, axis, metric, title in (
        (axes[0], "retrieve_policy", "hit_tokens", "tokens resumed from the cache, per retrieve policy"),
        (axes[1], "retrieve_policy", "bytes_loaded", "bytes loaded, per retrieve policy"),
        (axes[2], "store_policy", "bytes_stored", "bytes stored, per store policy"),
    ):
        values = _ordered(ok[axis], axis)
        workloads = list(dict.fromkeys(ok.workload))
        per_wl = {wl: _samples(ok[ok.workload == wl], [axis], [(v,) for v in values], metric) for wl in workloads}
        if metric == "hit_tokens":
            div, unit = 1.0, "tokens"
        else:
            div, unit = byte_unit(max((max(_clean(x), default=0) for s in per_wl.values() for x in s), default=0))
        _bars(ax, values, {wl: [[v / div for v in x] for x in s] for wl, s in per_wl.items()}, unit, annotate=True)
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * 1.3)  # headroom: the legend sits above the bars
        ax.set_title(f"{title}\n(all repeats of a case; bar: median over cases)", fontsize=9)
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    return _save(plt, fig, path)
