"""`hybridkv gate`: judge a run against a baseline (`gate.baseline`); fail on a regression or a broken invariant.

The repeat spread of a case is (max - min) / median of the metric computed over each measured repeat
alone: a run on a noisy machine widens its own tolerances, a quiet one tightens them. Every check must
match at least one case; one that matches none fails (the run lost a case the baseline expects).
Invariants hold whatever the baseline says (CASE_INVARIANTS): the run is complete, no case failed, a
real model's logits oracle passed wherever it ran, no chunk came back corrupt, the server held no VRAM
and mapped no CUDA library. The last two are relaxed only where the wire format needs it
(scenario.spec.SERVER_HOLDS_CUDA_CONTEXT, scenario.spec.SERVER_IMPORTS_TORCH): such cases show the figure as `info`.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from collections.abc import Callable
from typing import Literal

import msgspec

from hybridkv_bench.gate.baseline import Baseline, BaselineCheck, BaselineError, OrderCheck
from hybridkv_bench.metrics import Number, case_metrics
from hybridkv_bench.results.folder import CaseResult, Run
from hybridkv_bench.scenario.spec import SERVER_HOLDS_CUDA_CONTEXT, SERVER_IMPORTS_TORCH

Status = Literal["pass", "FAIL", "info"]
GATE_TXT = "gate.txt"  # the whole table, written into the run folder by `hybridkv gate`



class GateCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One line of the gate's table."""

    workload: str
    case: str
    check: str
    actual: str
    expected: str
    status: Status


class GateResult(msgspec.Struct, frozen=True, kw_only=True):
    checks: list[GateCheck]
    notes: list[str]

    @property
    def failed(self) -> list[GateCheck]:
        return [c for c in self.checks if c.status == "FAIL"]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def verdict(self) -> str:
        """One line: pass or FAIL, and how many checks of which kind failed."""
        n = len(self.failed)
        return f"gate: {'FAIL' if n else 'pass'} ({n} of {len(self.checks)} checks failed)"


def _num(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v).lower()
    return f"{v:.6g}" if isinstance(v, float) else str(v)


# ---- invariants: one function per invariant, each turning a finished case into gate lines -------------

def _row(c: CaseResult, check: str, actual: str, expected: str, status: Status) -> GateCheck:
    return GateCheck(workload=c.workload, case=c.name, check=check, actual=actual, expected=expected,
                     status=status)


def _no_corrupt_chunks(c: CaseResult) -> list[GateCheck]:
    corrupt = c.metrics.get("corrupt_chunks")
    return [_row(c, "corrupt_chunks", _num(corrupt), "0", "pass" if corrupt == 0 else "FAIL")]


def _oracle_passed(c: CaseResult) -> list[GateCheck]:
    """A real model's warm requests: a wrong continuation fails the case (absent for simulated engines)."""
    oracle = c.metrics.get("oracle_pass")
    if oracle is None:
        return []
    return [_row(c, "oracle_pass", _num(oracle), "true", "pass" if oracle is True else "FAIL")]


def _no_server_vram(c: CaseResult) -> list[GateCheck]:
    wire = c.wire_format
    vram = c.metrics.get("server_vram_mib")
    if vram is None:
        return [_row(c, "server_vram_mib", "not measurable", "0", "info")]
    if vram > 0 and wire in SERVER_HOLDS_CUDA_CONTEXT:
        return [_row(c, "server_vram_mib", _num(vram), f"any ({wire}: server holds a CUDA context)", "info")]
    return [_row(c, "server_vram_mib", _num(vram), "0", "pass" if vram == 0 else "FAIL")]


def _no_server_cuda(c: CaseResult) -> list[GateCheck]:
    wire = c.wire_format
    mapped = c.metrics.get("server_cuda_mapped")
    if mapped is True and wire in SERVER_IMPORTS_TORCH:
        return [_row(c, "server_cuda_mapped", "true", f"any ({wire}: server imports torch)", "info")]
    return [_row(c, "server_cuda_mapped", "not measured" if mapped is None else _num(mapped), "false",
                 "pass" if mapped is False else "FAIL")]


# Every finished case passes each of these, whatever the baseline. Add new invariants here (a metric that
# must hold for a case to count, e.g. an oracle): one function per invariant, returning gate lines.
CASE_INVARIANTS: tuple[Callable[[CaseResult], list[GateCheck]], ...] = (
    _oracle_passed, _no_corrupt_chunks, _no_server_vram, _no_server_cuda)


def invariant_checks(run: Run) -> list[GateCheck]:
    """The checks no baseline can waive."""
    out = []
    if not run.complete:
        out.append(GateCheck(workload="*", case="*", check="run complete", actual="no",
                             expected="yes", status="FAIL"))
    for c in run.cases:
        if c.status == "failed":
            out.append(_row(c, "case ran", f"failed: {c.error}", "ok", "FAIL"))
            continue
        for invariant in CASE_INVARIANTS:
            out += invariant(c)
    return out


# ---- baseline checks ---------------------------------------------------------------------------------

def repeat_metrics(run: Run, case: CaseResult) -> list[dict[str, Number]]:
    """Every metric computed on each measured repeat of `case` alone, in repeat order."""
    rows = [r for r in run.rows_of(case) if r.repeat >= 0]
    return [case_metrics([r for r in rows if r.repeat == rep], run.record.calibration, case.metrics)
            for rep in sorted({r.repeat for r in rows})]


def metric_values(per_repeat: list[dict[str, Number]], metric: str) -> list[float]:
    """`metric` of each repeat's metrics (`repeat_metrics`), repeats where it is not a number left out."""
    values = []
    for m in per_repeat:
        v = m.get(metric)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            values.append(float(v))
    return values


def repeat_values(run: Run, case: CaseResult, metric: str) -> list[float]:
    """`metric` computed on each measured repeat of `case` alone (repeats where it is not a number left out)."""
    return metric_values(repeat_metrics(run, case), metric)


def spread_of(values: list[float]) -> float | None:
    """(max - min) / median; None below two values."""
    if len(values) < 2:
        return None
    med = statistics.median(values)
    return (max(values) - min(values)) / abs(med) if med else None


def repeat_spread(run: Run, case: CaseResult, metric: str) -> float | None:
    """(max - min) / median of `metric` computed on each measured repeat of `case` alone; None below two."""
    return spread_of(repeat_values(run, case, metric))


def _matches(c: CaseResult, workload: str, case: str) -> bool:
    return fnmatch.fnmatchcase(c.workload, workload) and fnmatch.fnmatchcase(c.name, case)


def _value_check(run: Run, b: BaselineCheck, c: CaseResult) -> GateCheck:
    actual = c.metrics.get(b.metric)
    rel = repeat_spread(run, c, b.metric) if b.spread else None
    tol = b.tolerance_for(rel)
    op = {"higher": ">=", "lower": "<=", "equal": "=="}[b.direction]
    why = f"{b.value:.6g} {'-' if b.direction == 'higher' else '+'}{tol:.0%}"
    if b.spread:
        why += f": {b.spread:g} x repeat spread {_num(rel)}" if tol > b.tolerance else f": least {b.tolerance:.0%}"
    expected = f"== {b.value:.6g}" if b.direction == "equal" else f"{op} {b.limit(tol):.6g} ({why})"
    if actual is None or isinstance(actual, bool):
        status: Status = "FAIL"
    else:
        status = "pass" if b.passes(float(actual), tol) else "FAIL"
    return GateCheck(workload=c.workload, case=c.name, check=b.metric,
                     actual="not measured" if actual is None else _num(actual), expected=expected, status=status)


def _median_of(cases: list[CaseResult], metric: str) -> float | None:
    values = [float(v) for c in cases if isinstance(v := c.metrics.get(metric), int | float)
              and not isinstance(v, bool)]
    return statistics.median(values) if values else None


def _order_checks(run: Run, o: OrderCheck, ok_cases: list[CaseResult]) -> list[GateCheck]:
    workloads = [w for w in dict.fromkeys(c.workload for c in run.cases) if fnmatch.fnmatchcase(w, o.workload)]
    word = "above" if o.direction == "higher" else "below"
    out = []
    for wl in workloads or [o.workload]:
        better = [c for c in ok_cases if _matches(c, wl, o.better)]
        worse = [c for c in ok_cases if _matches(c, wl, o.worse)]
        b, w = _median_of(better, o.metric), _median_of(worse, o.metric)
        expected = f"median of {o.better} {word} median of {o.worse}"
        if b is None or w is None:
            actual, status = f"no measured {o.better if b is None else o.worse} case", "FAIL"
        else:
            ratio = f" (x{b / w:.3g})" if w else ""
            actual = f"{b:.4g} vs {w:.4g}{ratio}"
            status = "pass" if (b > w if o.direction == "higher" else b < w) else "FAIL"
        out.append(GateCheck(workload=wl, case=f"{o.better} vs {o.worse}", check=o.metric, actual=actual,
                             expected=expected, status=status))  # type: ignore[arg-type]
    return out


def baseline_checks(run: Run, baseline: Baseline) -> list[GateCheck]:
    out = []
    ok_cases = [c for c in run.cases if c.status == "ok"]
    for b in baseline.check:
        matched = [c for c in ok_cases if _matches(c, b.workload, b.case)]
        if not matched:
            out.append(GateCheck(workload=b.workload, case=b.case, check=b.metric, actual="no such case",
                                 expected=f"{b.direction} than {b.value:.6g}", status="FAIL"))
        out += [_value_check(run, b, c) for c in matched]
    for o in baseline.order:
        out += _order_checks(run, o, ok_cases)
    return out


def gate(run: Run, baseline: Baseline | None) -> GateResult:
    """Invariants, then the baseline's checks. Raises BaselineError when they do not belong together."""
    notes = []
    if baseline is not None:
        if baseline.scenario != run.scenario_name:
            raise BaselineError(f"baseline is for scenario {baseline.scenario!r}, the run is of "
                                f"{run.scenario_name!r}")
        run_scale = float(run.record.scenario.get("scale", 1.0))
        if baseline.scale is not None and not math.isclose(baseline.scale, run_scale):
            raise BaselineError(f"baseline was taken at scale {baseline.scale}, "
                                f"the run is at scale {run_scale}")
        sha = run.record.scenario.get("sha256")
        if baseline.scenario_sha256 and sha and baseline.scenario_sha256 != sha:
            notes.append(f"the scenario file changed since the baseline ({baseline.scenario_sha256[:12]} -> "
                         f"{sha[:12]})")
    checks = invariant_checks(run) + (baseline_checks(run, baseline) if baseline else [])
    return GateResult(checks=checks, notes=notes)


HEADERS = ("status", "workload", "case", "check", "actual", "expected")


def format_table(result: GateResult, only_failed: bool = False) -> str:
    """The gate's table: every check, or only the failed ones."""
    checks = result.failed if only_failed else result.checks
    rows = [(c.status, c.workload, c.case, c.check, c.actual, c.expected) for c in checks]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(HEADERS)]
    line = lambda cells: "  ".join(str(x).ljust(w) for x, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(HEADERS), line("-" * w for w in widths), *(line(r) for r in rows)])
