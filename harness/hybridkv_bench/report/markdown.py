"""`hybridkv report`: a run folder in, report.md, report.html (self-contained) and PNG figures out.

Request-derived metrics are recomputed from requests.csv with the same `case_metrics` the runner
uses; a case whose run.json figures differ from the recomputation is listed under "Integrity".
Server metrics and the calibration, which no CSV row holds, come from run.json.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pandas as pd

from hybridkv_bench.metrics import RATIO_METRICS, REQUEST_METRICS, SERVER_METRICS, case_metrics
from hybridkv_bench.report import plots
from hybridkv_bench.report.model import model_section
from hybridkv_bench.report.tables import fmt, markdown_table
from hybridkv_bench.report.verdict import verdict_lines
from hybridkv_bench.results.folder import CaseResult, Run, load_run
from hybridkv_bench.scenario.spec import AXES

REPORT_MD = "report.md"
REPORT_HTML = "report.html"  # the same, one self-contained file (pictures inline) to attach to a pull request
MIB = 1 << 20


# ---- the case table -------------------------------------------------------------------------------

def _differs(a, b) -> bool:
    if a is None or b is None:
        return (a is None) != (b is None)
    return not math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)


ARENA_COLUMNS = ("arena_used_mib", "arena_capacity_mib")


def _arena(c: CaseResult) -> dict[str, float | None]:
    """The server's L1 arena after the case (its counters), in MiB; None where the run did not record them."""
    counters = c.details.get("server_counters") or {}
    used, cap = counters.get("l1_bytes_used"), counters.get("l1_capacity_bytes")
    return {"arena_used_mib": used / MIB if isinstance(used, int | float) else None,
            "arena_capacity_mib": cap / MIB if isinstance(cap, int | float) else None}


def case_table(run: Run) -> tuple[pd.DataFrame, list[str]]:
    """One row per case entry with metrics recomputed from the CSV, and the integrity findings."""
    records, findings = [], []
    calibration = run.record.calibration
    for c in run.cases:
        rows = run.rows_of(c)
        server = {k: c.metrics.get(k) for k in SERVER_METRICS}
        m = case_metrics(rows, calibration, server)
        if c.status == "ok":
            if not rows:
                findings.append(f"{c.key}: status ok but requests.csv holds no rows for it")
            for k in (*REQUEST_METRICS, *RATIO_METRICS):
                if k in c.metrics and _differs(c.metrics[k], m[k]):
                    findings.append(f"{c.key}: run.json {k} = {fmt(c.metrics[k], 8)}, "
                                    f"requests.csv gives {fmt(m[k], 8)}")
        records.append({"workload": c.workload, "case": c.name, "status": c.status, "error": c.error,
                        **{a: c.axes.get(a, "?") for a in AXES}, **m, **_arena(c), "rows": len(rows)})
    columns = ["workload", "case", "status", "error", *AXES, *case_metrics([]).keys(), *ARENA_COLUMNS, "rows"]
    return pd.DataFrame.from_records(records, columns=columns), findings


# ---- report.md ----------------------------------------------------------------------------------

def _prefill_text(prefill: dict) -> str:
    if prefill.get("kind") == "roofline":
        return (f"roofline, {prefill.get('device_tflops')} TFLOP/s x efficiency {prefill.get('efficiency')}: "
                "(2 x active params x new tokens + causal attention FLOPs) / tp / rate "
                "(hybridkv_bench.prefill)")
    if prefill.get("kind") == "tokens_per_s":
        return f"{prefill.get('rate')} uncached tokens per second"
    return f"unknown prefill model {prefill}"


def _composition(run: Run, df: pd.DataFrame) -> str:
    """Mean of each TTFT component per case and phase, and the measured remainder."""
    req = pd.DataFrame([msgspec.structs.asdict(r) for r in run.requests if r.repeat >= 0])
    if req.empty:
        return "_No measured requests._"
    other = req.ttft_s - req.lookup_s - req.load_s - req.prefill_s
    req["other_s"] = other.where(other.abs() > 1e-9 * req.ttft_s, 0.0)  # float noise is not time
    g = req.groupby(["workload", "case", "phase"], sort=False)[
        ["ttft_s", "lookup_s", "load_s", "prefill_s", "other_s"]].mean().reset_index()
    rows = [[r.workload, r.case, r.phase, r.ttft_s, r.lookup_s, r.load_s, r.prefill_s, r.other_s,
             f"{100 * r.prefill_s / r.ttft_s:.0f}%" if r.ttft_s > 0 else "n/a"]
            for r in g.itertuples(index=False)]
    return markdown_table(["workload", "case", "phase", "TTFT (s)", "lookup (measured)", "load (measured)",
                           "prefill (modeled)", "other (measured remainder)", "modeled share"],
                          rows, "lllrrrrrr")


# The results tables, each narrow enough to read: (metric, header) per column after the case name.
RESULT_TABLES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("time to first token and hits", (
        ("ttft_cold_s", "cold TTFT s"), ("ttft_warm_s", "warm TTFT s"), ("ttft_warm_s_p99", "warm p99 s"),
        ("ttft_speedup", "speed-up"), ("hit_tokens", "hit tokens"), ("shared_tokens", "shared tokens"),
        ("hit_share", "hit/shared"), ("verified_chunks", "verified"),
        ("corrupt_chunks", "corrupt"))),
    ("transfer", (
        ("store_gbps", "store GB/s"), ("store_ceiling_ratio", "store/peak"), ("store_copy_gbps", "store copy GB/s"),
        ("load_gbps", "load GB/s"), ("load_ceiling_ratio", "load/peak"), ("load_copy_gbps", "load copy GB/s"),
        ("bytes_stored", "GB stored"), ("bytes_loaded", "GB loaded"))),
    ("prefetch from L2 (multi_turn, prefetch = compare)", (
        ("ttft_warm_l1_s", "warm TTFT L1 s"), ("ttft_warm_l2_s", "L2 s"), ("ttft_warm_l2_prefetch_s", "L2+prefetch s"),
        ("prefetch_ttft_ratio", "prefetch/L1"), ("l2_ttft_ratio", "L2/L1"), ("restore_l1_s", "restore L1 s"),
        ("restore_l2_prefetch_s", "restore L2+prefetch s"), ("prefetch_restore_ratio", "restore prefetch/L1"))),
    ("cache server", (
        ("server_vram_mib", "VRAM MiB"), ("server_cuda_mapped", "CUDA libs"), ("server_rss_mib", "RSS MiB"),
        ("arena_used_mib", "arena used MiB"), ("arena_capacity_mib", "arena MiB"), ("server_cpu_s", "CPU s"))),
)


def _cell(r: dict, k: str):
    v = r[k]
    if k.startswith("bytes_") and v is not None:
        v = v / 1e9
    return None if isinstance(v, float) and math.isnan(v) else v


def _results_tables(df: pd.DataFrame) -> str:
    out = []
    for wl, sub in df[df.status == "ok"].groupby("workload", sort=False):
        records = sub.to_dict("records")
        out.append(f"### {wl}")
        for title, cols in RESULT_TABLES:
            rows = [[r["case"], *(_cell(r, k) for k, _ in cols)] for r in records]
            if title.startswith("prefetch") and all(v is None for row in rows for v in row[1:]):
                continue  # only a prefetch comparison fills it
            out.append(f"{title}:\n\n" + markdown_table(["case", *(h for _, h in cols)], rows, "l" + "r" * len(cols)))
    return "\n\n".join(out) or "_No case finished._"


def render_markdown(run: Run, df: pd.DataFrame, findings: list[str], figures: list[Path],
                    baseline: str | Path | None = None) -> str:
    sc, ctx, cal = run.record.scenario, run.record.context, run.record.calibration
    lines = [f"# hybridkv run: {run.scenario_name}", ""]
    if not run.complete:
        lines += ["> **INCOMPLETE RUN.** " + run.incomplete_detail() + ". The figures below cover only the "
                  "cases that finished; do not compare them with a complete run.", ""]
    if ctx.get("planted_slowdown"):
        lines += [f"> **PLANTED SLOWDOWN** (a test of `report --compare`): every timed store and load waited "
                  f"{ctx['planted_slowdown']:g} of its own time more. These figures are not the code's.", ""]
    lines += verdict_lines(run, df, baseline)
    lines += ["## Run", ""]
    lines += [f"{sc.get('description', '')}", "",
              markdown_table(["", ""], [
                  ["run folder", str(run.folder)],
                  ["scenario file", f"{sc.get('path')} (sha256 {str(sc.get('sha256'))[:12]})"],
                  ["scale", sc.get("scale", 1.0)],
                  ["model", f"{sc.get('model', {}).get('preset')} tp={sc.get('model', {}).get('tp')} "
                            f"chunk_tokens={sc.get('model', {}).get('chunk_tokens')}"],
                  ["repeats / warm-up / seed",
                   f"{sc.get('repeats')} / {sc.get('warmup')} / {sc.get('seed')}"],
                  ["cases", f"{len(run.cases)} ({int((df.status == 'failed').sum())} failed)"],
              ]), ""]
    lines += ["## Context", "", markdown_table(["key", "value"], [
        [k, ", ".join(map(str, v)) if isinstance(v, list) else
         ("; ".join(f"{a} {b}" for a, b in v.items()) if isinstance(v, dict) else v)]
        for k, v in ctx.items()]), ""]
    lines += ["## Calibration", ""]
    if cal:
        cal_rows = [[k, ", ".join(fmt(x) for x in v) if isinstance(v, list) else v] for k, v in cal.items()]
        lines += [markdown_table(["key", "value"], cal_rows),
                  "", "Every GB/s below is payload bytes / wall seconds, 1 GB = 1e9 B; `/peak` divides it by "
                  "the copy peak above, measured in this run.", ""]
    else:
        lines += ["_No calibration recorded: ceiling ratios are n/a._", ""]
    lines += ["## How each TTFT is composed", "",
              "- cold TTFT = lookup (measured, a miss) + prefill of the whole prompt (**modeled**)",
              "- warm TTFT = lookup (measured) + load of the hit (measured) + prefill of the uncached tail "
              "(**modeled**)",
              f"- prefill model: {_prefill_text(sc.get('prefill', {}))}",
              "- other = TTFT minus the three (measured: anything the runner spent before the first token, "
              "such as a store it had to wait for)", "",
              _composition(run, df), ""]

    lines += model_section(run, df)
    lines += ["## Results", "", _results_tables(df), ""]
    corrupt = df[df.corrupt_chunks.fillna(0) > 0]
    if not corrupt.empty:
        lines += ["## CORRUPT CHUNKS", "", "Bytes read back differed from what was stored:", "",
                  markdown_table(["workload", "case", "corrupt", "verified"],
                                 corrupt[["workload", "case", "corrupt_chunks", "verified_chunks"]]
                                 .values.tolist()), ""]
    failed = df[df.status == "failed"]
    lines += ["## Failed cases", ""]
    failed_rows = failed[["workload", "case", "error"]].values.tolist()
    lines += [markdown_table(["workload", "case", "error"], failed_rows) if failed_rows else "None.", ""]
    lines += ["## Integrity", ""]
    lines += ([f"- {f}" for f in findings] if findings else
              ["Every request-derived metric in run.json matches its recomputation from requests.csv."])
    lines += ["", "## Figures", ""]
    lines += [f"![{p.stem}]({p.name})" for p in figures] or ["_Nothing to draw._"]
    return "\n".join(lines) + "\n"


def write_report(run_folder: str | Path, out: str | Path | None = None,
                 baseline: str | Path | None = None) -> list[Path]:
    """Write report.md and the figures into `out` (default: the run folder); returns their paths. With a
    baseline the verdict at the top is the gate's against it, else the invariants' alone."""
    run = load_run(run_folder)
    out_dir = Path(out) if out is not None else run.folder
    out_dir.mkdir(parents=True, exist_ok=True)
    df, findings = case_table(run)
    setting = plots.Setting.of(run.record.calibration)
    figures = [p for p in (
        plots.plot_ttft(df, out_dir / "ttft.png", setting),
        plots.plot_throughput(df, out_dir / "throughput.png", setting),
        plots.plot_server(df, out_dir / "server.png"),
        plots.plot_policies(df, out_dir / "policies.png"),
    ) if p is not None]
    md = out_dir / REPORT_MD
    md.write_text(render_markdown(run, df, findings, figures, baseline))
    from hybridkv_bench.report.html import write_html  # it imports markdown_it, which only this needs

    page = write_html(md, out_dir / REPORT_HTML, f"hybridkv run: {run.scenario_name}")
    return [md, page, *figures]
