"""The report's figures, drawn from the case table that `report.case_table` builds from the CSV.

Each function writes one PNG and returns its path, or None when the run holds nothing to draw.
Where several cases share an x position (say every shm case), a bar is their median and the whisker
spans their minimum to maximum, so a spread is shown, not hidden.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

AXIS_ORDER = {
    "wire_format": ["shm", "raw", "pickle", "torch_save", "cuda_ipc"],
    "copy_engine": ["kernel", "dma"],
    "streams": ["single", "per_group"],
    "retrieve_policy": ["boundary", "all"],
    "store_policy": ["boundary", "all"],
}


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


def _bars(ax, groups: list[str], series: dict[str, pd.Series | list], ylabel: str) -> None:
    """Grouped bars: one group per x label, one bar per series; each value a list of samples."""
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (label, per_group) in enumerate(series.items()):
        meds, lo, hi, xs = [], [], [], []
        for j, samples in enumerate(per_group):
            samples = [s for s in samples if s is not None and s == s]
            if not samples:
                continue
            med = float(pd.Series(samples).median())
            xs.append(j - 0.4 + width * (i + 0.5))
            meds.append(med)
            lo.append(med - min(samples))
            hi.append(max(samples) - med)
        if xs:
            ax.bar(xs, meds, width, label=label, yerr=[lo, hi], capsize=3)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def _samples(df: pd.DataFrame, by: list[str], keys: list[tuple], metric: str) -> list[list]:
    out = []
    for key in keys:
        mask = pd.Series(True, index=df.index)
        for col, val in zip(by, key, strict=True):
            mask &= df[col] == val
        out.append(df.loc[mask, metric].dropna().tolist())
    return out


def plot_ttft(df: pd.DataFrame, path: Path) -> Path | None:
    """Cold vs warm TTFT (p50) per wire format, one panel per workload."""
    ok = df[df.status == "ok"]
    if ok.empty or ok[["ttft_cold_s", "ttft_warm_s"]].isna().all().all():
        return None
    plt = _pyplot()
    workloads = list(dict.fromkeys(ok.workload))
    fig, axes = plt.subplots(len(workloads), 1, figsize=(8, 3.6 * len(workloads)), squeeze=False)
    for ax, wl in zip(axes[:, 0], workloads, strict=True):
        sub = ok[ok.workload == wl]
        formats = _ordered(sub.wire_format, "wire_format")
        keys = [(f,) for f in formats]
        _bars(ax, formats, {"cold": _samples(sub, ["wire_format"], keys, "ttft_cold_s"),
                            "warm": _samples(sub, ["wire_format"], keys, "ttft_warm_s")}, "TTFT p50 (s)")
        ax.set_title(f"{wl}: TTFT per wire format (bar: median over cases, whisker: min-max)")
        ax.legend()
    return _save(plt, fig, path)


def plot_throughput(df: pd.DataFrame, path: Path, d2h_peak: float | None,
                    h2d_peak: float | None) -> Path | None:
    """Store and load GB/s per wire format / copy engine / streams, with the calibrated ceiling."""
    ok = df[df.status == "ok"]
    if ok.empty or ok[["store_gbps", "load_gbps"]].isna().all().all():
        return None
    plt = _pyplot()
    by = ["wire_format", "copy_engine", "streams"]
    keys = sorted({tuple(r) for r in ok[by].itertuples(index=False)},
                  key=lambda k: tuple(_ordered(ok[a], a).index(v) for a, v in zip(by, k, strict=True)))
    labels = ["/".join(k) for k in keys]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(keys) + 3), 8))
    for ax, metric, peak, what in ((axes[0], "store_gbps", d2h_peak, "store (GPU -> cache), D2H"),
                                   (axes[1], "load_gbps", h2d_peak, "load (cache -> GPU), H2D")):
        _bars(ax, labels, {metric: _samples(ok, by, keys, metric)}, "GB/s (1e9 B/s)")
        if peak:
            ax.axhline(peak, color="crimson", linestyle="--", label=f"calibrated peak {peak:.1f} GB/s")
        ax.set_title(f"{what}: payload rate per wire format / copy engine / streams")
        ax.legend()
    return _save(plt, fig, path)


def plot_server(df: pd.DataFrame, path: Path) -> Path | None:
    """Server VRAM and resident memory per wire format (the transfer mode decides both)."""
    ok = df[df.status == "ok"]
    if ok.empty:
        return None
    plt = _pyplot()
    formats = _ordered(ok.wire_format, "wire_format")
    keys = [(f,) for f in formats]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    vram = _samples(ok, ["wire_format"], keys, "server_vram_mib")
    if any(vram):
        _bars(axes[0], formats, {"VRAM": vram}, "MiB")
    else:
        axes[0].text(0.5, 0.5, "not measurable\n(NVML unavailable or blind to the server's PID)",
                     ha="center", va="center", transform=axes[0].transAxes)
        axes[0].set_xticks([])
    axes[0].set_title("server VRAM (NVML, by process id; 0 expected)")
    _bars(axes[1], formats, {"RSS": _samples(ok, ["wire_format"], keys, "server_rss_mib")}, "MiB")
    axes[1].set_title("server resident memory")
    return _save(plt, fig, path)


def plot_policies(df: pd.DataFrame, path: Path) -> Path | None:
    """Hit tokens and bytes loaded per retrieve policy; bytes stored per store policy."""
    ok = df[df.status == "ok"]
    if ok.empty:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, axis, metric, scale, ylabel in (
        (axes[0], "retrieve_policy", "hit_tokens", 1, "tokens"),
        (axes[1], "retrieve_policy", "bytes_loaded", 1e9, "GB"),
        (axes[2], "store_policy", "bytes_stored", 1e9, "GB"),
    ):
        values = _ordered(ok[axis], axis)
        samples = [[v / scale for v in s] for s in _samples(ok, [axis], [(v,) for v in values], metric)]
        _bars(ax, values, {metric: samples}, ylabel)
        ax.set_title(f"{metric} per {axis}")
    return _save(plt, fig, path)
