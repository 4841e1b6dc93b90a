"""The opening of report.md: the gate's verdict, the headline figures beside their ceilings, what was modeled.

The headline shows, per workload, the fastest case (lowest warm TTFT) of each wire format. Its columns
are HEADLINE_COLUMNS: add a (header, cell function) pair there to put another figure in the headline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from hybridkv_bench.gate.baseline import Baseline, load_baseline
from hybridkv_bench.gate.checks import GateResult, gate
from hybridkv_bench.report.plots import AXIS_ORDER, WIRE_LABELS
from hybridkv_bench.report.tables import markdown_table
from hybridkv_bench.results.folder import Run


def _num(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}g}"


def _rate(gbps_key: str, ratio_key: str) -> Callable[[dict], str]:
    def cell(r: dict) -> str:
        ratio = r.get(ratio_key)
        of = f" ({_num(ratio, 2)} of ceiling)" if ratio is not None and not math.isnan(ratio) else ""
        return f"{_num(r.get(gbps_key))}{of}"
    return cell


def _vram(r: dict) -> str:
    v = r.get("server_vram_mib")
    return "not measurable" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.0f} MiB"


HEADLINE_COLUMNS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("warm TTFT s", lambda r: _num(r.get("ttft_warm_s"))),
    ("cold TTFT s", lambda r: _num(r.get("ttft_cold_s"))),
    ("cold / warm", lambda r: f"{_num(r.get('ttft_speedup'))}x"),
    ("store GB/s", _rate("store_gbps", "store_ceiling_ratio")),
    ("load GB/s", _rate("load_gbps", "load_ceiling_ratio")),
    ("server VRAM", _vram),
)


def headline_rows(df: pd.DataFrame) -> dict[str, list[list[str]]]:
    """Per workload: one row per wire format, its case with the lowest warm TTFT."""
    out: dict[str, list[list[str]]] = {}
    ok = df[(df.status == "ok") & df.ttft_warm_s.notna()]
    order = AXIS_ORDER["wire_format"]
    for wl, sub in ok.groupby("workload", sort=False):
        rows = []
        formats = sorted(set(sub.wire_format), key=lambda f: order.index(f) if f in order else len(order))
        for wire in formats:
            best = sub[sub.wire_format == wire].sort_values("ttft_warm_s").iloc[0].to_dict()
            rows.append([f"{WIRE_LABELS.get(wire, wire)}: {best['case']}", *(f(best) for _, f in HEADLINE_COLUMNS)])
        out[str(wl)] = rows
    return out


def judge(run: Run, baseline_path: str | Path | None) -> tuple[GateResult, str]:
    """Gate the run (invariants only without a baseline) and say against what."""
    baseline: Baseline | None = load_baseline(baseline_path) if baseline_path else None
    against = f"against `{baseline_path}`" if baseline_path else (
        "invariants only (no baseline given: `hybridkv report RUN --baseline FILE` adds one)")
    return gate(run, baseline), against


def verdict_lines(run: Run, df: pd.DataFrame, baseline_path: str | Path | None) -> list[str]:
    """The report's first section."""
    result, against = judge(run, baseline_path)
    failed = result.failed
    lines = ["## Verdict", "", f"**{result.verdict()}**, {against}."]
    if failed:
        lines += ["", markdown_table(["workload", "case", "check", "actual", "expected"],
                                     [[c.workload, c.case, c.check, c.actual, c.expected] for c in failed[:20]])]
        if len(failed) > 20:
            lines.append(f"... and {len(failed) - 20} more (`hybridkv gate RUN --baseline FILE --verbose`).")
    cal = run.record.calibration
    if cal:
        lines += ["", f"Ceilings measured in this run ({cal.get('method')}, {cal.get('device')}): "
                      f"store {_num(cal.get('d2h_peak_gbps'))} GB/s, load {_num(cal.get('h2d_peak_gbps'))} GB/s."]
    prefill = run.record.scenario.get("prefill", {})
    lines += ["", "**Modeled:** prefill time (" + (
        f"{prefill.get('rate')} uncached tokens/s" if prefill.get("kind") == "tokens_per_s" else
        "roofline of the model's FLOPs" if prefill.get("kind") == "roofline" else str(prefill.get("kind"))) +
        "), inside every TTFT. **Measured:** lookup, load, store, copy rates, server memory and VRAM."]
    if not str(cal.get("method", "")).startswith("cuda"):
        lines += ["", "No GPU in this run: pages moved between CPU tensors and the server's arena, so rates "
                      "are memcpy and round-trip figures, not PCIe ones."]
    for wl, rows in headline_rows(df).items():
        lines += ["", f"Headline, {wl} (per wire format, its case with the lowest warm TTFT):", "",
                  markdown_table(["path: case", *(h for h, _ in HEADLINE_COLUMNS)], rows,
                                 "l" + "r" * len(HEADLINE_COLUMNS))]
    return lines + [""]
