"""The opening of report.md: the gate's verdict, the headline figures beside their ceilings, what was modeled.

The headline shows, per workload, the fastest case (lowest warm TTFT) of each wire format, the cases ttft.png
draws, with the share of each TTFT that is modeled; the lines above it say what is modeled and what measured. Its
columns are HEADLINE_COLUMNS: add a (header, cell function) pair there to put another figure in the headline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from hybridkv_bench.gate.baseline import Baseline, load_baseline
from hybridkv_bench.gate.checks import GateResult, gate
from hybridkv_bench.report.plots import WIRE_LABELS, fastest_cases
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


def _shares(r: dict) -> str:
    cold, warm = r.get("cold_modeled"), r.get("warm_modeled")
    return f"{_pct(cold)} / {_pct(warm)}"


def _pct(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.0f}%"


HEADLINE_COLUMNS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("warm TTFT s", lambda r: _num(r.get("ttft_warm_s"))),
    ("cold TTFT s", lambda r: _num(r.get("ttft_cold_s"))),
    ("cold / warm", lambda r: f"{_num(r.get('ttft_speedup'))}x"),
    ("store GB/s", _rate("store_gbps", "store_ceiling_ratio")),
    ("load GB/s", _rate("load_gbps", "load_ceiling_ratio")),
    ("server VRAM", _vram),
    ("TTFT modeled cold / warm", _shares),
)


def _span(shares: list[float]) -> str:
    """12%-96%, or 100% where they all round alike."""
    if not shares:
        return "n/a"
    lo, hi = _pct(min(shares)), _pct(max(shares))
    return lo if lo == hi else f"{lo}-{hi}"


def modeled_shares(run: Run) -> dict[tuple[str, str, str], float]:
    """(workload, case, phase) -> the share of its measured requests' TTFT that is modeled prefill."""
    sums: dict[tuple[str, str, str], list[float]] = {}
    for r in run.requests:
        if r.repeat >= 0:
            acc = sums.setdefault((r.workload, r.case, r.phase), [0.0, 0.0])
            acc[0] += r.prefill_s
            acc[1] += r.ttft_s
    return {k: p / t for k, (p, t) in sums.items() if t > 0}


def headline_rows(df: pd.DataFrame, shares: dict[tuple[str, str, str], float] | None = None
                  ) -> dict[str, list[list[str]]]:
    """Per workload: one row per wire format, its case with the lowest warm TTFT (plots.fastest_cases, the cases
    ttft.png draws), with the modeled share of its TTFT."""
    shares = shares or {}
    out: dict[str, list[list[str]]] = {}
    for wl, rows in fastest_cases(df).items():
        out[wl] = []
        for best in rows:
            best = {**best, "cold_modeled": shares.get((wl, best["case"], "cold")),
                    "warm_modeled": shares.get((wl, best["case"], "warm"))}
            wire = best["wire_format"]
            out[wl].append([f"{WIRE_LABELS.get(wire, wire)}: {best['case']}",
                            *(f(best) for _, f in HEADLINE_COLUMNS)])
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
    shares = modeled_shares(run)
    cold = [v for (_, _, phase), v in shares.items() if phase == "cold"]
    warm = [v for (_, _, phase), v in shares.items() if phase == "warm"]
    lines += ["", "**Modeled:** prefill time (" + (
        f"{prefill.get('rate')} uncached tokens/s" if prefill.get("kind") == "tokens_per_s" else
        "roofline of the model's FLOPs" if prefill.get("kind") == "roofline" else str(prefill.get("kind"))) +
        f"), inside every TTFT: **{_span(cold)} of cold TTFT and {_span(warm)} of warm TTFT** over the cases "
        "(each row below says its own). **Measured:** lookup, load, store, copy rates, server memory and VRAM; "
        "every GB/s."]
    formats = [WIRE_LABELS.get(w, w) for w in dict.fromkeys(df[df.status == "ok"].wire_format)]
    if formats:
        lines += ["", f"Paths compared: {', '.join(formats)}: hybridkv's own wire formats and the baselines it "
                      "carries; no other cache system ran in this run."]
    if not str(cal.get("method", "")).startswith("cuda"):
        lines += ["", "No GPU in this run: pages moved between CPU tensors and the server's arena, so rates "
                      "are memcpy and round-trip figures, not PCIe ones."]
    for wl, rows in headline_rows(df, shares).items():
        lines += ["", f"Headline, {wl} (per wire format, its case with the lowest warm TTFT; ttft.png draws the "
                      "same cases):", "",
                  markdown_table(["path: case", *(h for h, _ in HEADLINE_COLUMNS)], rows,
                                 "l" + "r" * len(HEADLINE_COLUMNS))]
    return lines + [""]
