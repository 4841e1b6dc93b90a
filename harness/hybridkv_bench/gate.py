"""`hybridkv gate`: judge a run against a baseline; fail on a regression or a broken invariant.

Baseline file (TOML, kept under results/baselines/<scenario>.toml):

    scenario = "smoke"            # must equal the run's scenario name
    scale = 1.0                   # optional; must equal the run's scale (a --quick run is another run)
    scenario_sha256 = "..."       # optional; a different scenario file is reported, not failed

    [[check]]                     # one case's figure against a value
    workload = "*"                # glob over workload names (default "*")
    case = "shm-*"                # glob over case names (default "*")
    metric = "ttft_speedup"       # a name from hybridkv_bench.metrics.METRICS
    direction = "higher"          # higher: pass if actual >= value * (1 - tol); lower: <= value * (1 + tol);
    value = 1.0                   # equal: a count that must be exactly value (tolerance must be 0)
    tolerance = 0.0               # the least tolerance
    spread = 3.0                  # optional: tol = max(tolerance, spread x the case's own repeat spread)

    [[order]]                     # an ordering inside the run, judged on medians over the matched cases
    workload = "*"                # per workload matching this glob
    metric = "load_gbps"
    direction = "higher"          # the `better` cases' median must be higher (lower) than the `worse` ones'
    better = "shm-*"
    worse = "pickle-*"

The repeat spread of a case is (max - min) / median of the metric computed over each measured repeat
alone: a run on a noisy machine widens its own tolerances, a quiet one tightens them. Every check must
match at least one case; one that matches none fails (the run lost a case the baseline expects).
Invariants hold whatever the baseline says (CASE_INVARIANTS): the run is complete, no case failed, a
real model's logits oracle passed wherever it ran, no chunk came back corrupt, the server held no VRAM
and mapped no CUDA library. The last two are relaxed only where the wire format needs it
(scenario.SERVER_HOLDS_CUDA_CONTEXT, scenario.SERVER_IMPORTS_TORCH): such cases show the figure as `info`.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

from .metrics import METRICS, case_metrics
from .results import CaseResult, Run
from .scenario import SERVER_HOLDS_CUDA_CONTEXT, SERVER_IMPORTS_TORCH, toml_error

# --write-baseline gates counts exactly, orderings inside the run, and timing ratios against a floor with the
# case's own repeat spread as tolerance; never absolute times (CI machines differ, and so does their load).
COUNT_METRICS = ("hit_tokens", "verified_chunks", "bytes_stored", "bytes_loaded")
# (case glob, metric, floor, x repeat spread): a warm hit of the zero-copy paths must beat a cold prefill.
# The seed's formats are judged by the orderings only: on a loaded CPU their warm path can exceed the
# modeled prefill (as it does on the H200: that is the finding, not a regression).
SPREAD_CHECKS: tuple[tuple[str, str, float, float], ...] = (
    ("shm-*", "ttft_speedup", 1.0, 3.0), ("raw-*", "ttft_speedup", 1.0, 3.0))
# (better, worse) case globs, and the metrics on which the better one must win in every workload: the
# zero-copy path against the seed's serialising formats.
ORDERS: tuple[tuple[str, str], ...] = (("shm-*", "pickle-*"), ("shm-*", "torch_save-*"))
ORDER_METRICS: dict[str, Literal["higher", "lower"]] = {
    "store_gbps": "higher", "load_gbps": "higher", "ttft_warm_s": "lower"}

Status = Literal["pass", "FAIL", "info"]
GATE_TXT = "gate.txt"  # the whole table, written into the run folder by `hybridkv gate`


class BaselineError(ValueError):
    """A baseline file that cannot be used with this run (bad file, other scenario, other scale)."""


class BaselineCheck(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    metric: str
    direction: Literal["higher", "lower", "equal"]
    tolerance: float
    value: float
    case: str = "*"
    workload: str = "*"
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}")
        if not 0 <= self.tolerance < 10:
            raise ValueError(f"tolerance must lie in [0, 10), got {self.tolerance}")
        if not 0 <= self.spread <= 100:
            raise ValueError(f"spread must lie in [0, 100], got {self.spread}")
        if self.direction == "equal" and (self.tolerance or self.spread):
            raise ValueError(f"an equal check is exact: tolerance and spread must be 0, got {self.tolerance}, "
                             f"{self.spread}")
        if not math.isfinite(self.value):
            raise ValueError(f"value must be finite, got {self.value}")

    def tolerance_for(self, rel_spread: float | None) -> float:
        """The tolerance for a case whose own repeats spread by `rel_spread` (capped below 1 for `higher`)."""
        tol = max(self.tolerance, self.spread * (rel_spread or 0.0))
        return min(tol, 0.95) if self.direction == "higher" else tol

    def limit(self, tol: float | None = None) -> float:
        tol = self.tolerance if tol is None else tol
        f = {"higher": 1 - tol, "lower": 1 + tol, "equal": 1.0}[self.direction]
        return self.value * f

    def passes(self, actual: float, tol: float | None = None) -> bool:
        limit = self.limit(tol)
        return {"higher": actual >= limit, "lower": actual <= limit, "equal": actual == limit}[self.direction]


class OrderCheck(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    metric: str
    direction: Literal["higher", "lower"]
    better: str
    worse: str
    workload: str = "*"

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}")


class Baseline(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    scenario: str
    check: tuple[BaselineCheck, ...] = ()
    order: tuple[OrderCheck, ...] = ()
    scale: float | None = None
    scenario_sha256: str | None = None


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


def load_baseline(path: str | Path) -> Baseline:
    path = Path(path)
    try:
        text = path.read_text()
        data = tomllib.loads(text)
    except OSError as e:
        raise BaselineError(f"{path}: cannot read baseline ({e.strerror})") from None
    except UnicodeDecodeError:
        raise BaselineError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise BaselineError(toml_error(str(path), text, e)) from None
    except RecursionError:
        raise BaselineError(f"{path}: nested too deeply to be a baseline") from None
    try:
        return msgspec.convert(data, Baseline)
    except msgspec.ValidationError as e:
        raise BaselineError(f"{path}: {e}") from None


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
    wire = c.axes.get("wire_format", "?")
    vram = c.metrics.get("server_vram_mib")
    if vram is None:
        return [_row(c, "server_vram_mib", "not measurable", "0", "info")]
    if vram > 0 and wire in SERVER_HOLDS_CUDA_CONTEXT:
        return [_row(c, "server_vram_mib", _num(vram), f"any ({wire}: server holds a CUDA context)", "info")]
    return [_row(c, "server_vram_mib", _num(vram), "0", "pass" if vram == 0 else "FAIL")]


def _no_server_cuda(c: CaseResult) -> list[GateCheck]:
    wire = c.axes.get("wire_format", "?")
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

def repeat_values(run: Run, case: CaseResult, metric: str) -> list[float]:
    """`metric` computed on each measured repeat of `case` alone (repeats where it is not a number left out)."""
    rows = [r for r in run.rows_of(case) if r.repeat >= 0]
    values = []
    for rep in sorted({r.repeat for r in rows}):
        v = case_metrics([r for r in rows if r.repeat == rep], run.record.calibration, case.metrics).get(metric)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            values.append(float(v))
    return values


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


def _toml_str(s: str) -> str:
    return msgspec.json.encode(s).decode()  # a JSON string is a valid TOML basic string


def baseline_from_run(run: Run) -> str:
    """TOML text of a baseline from this run: COUNT_METRICS exactly, SPREAD_CHECKS, ORDERS."""
    broken = [c for c in invariant_checks(run) if c.status == "FAIL"]
    if broken:
        first = broken[0]
        raise BaselineError(f"refusing to baseline a run that fails its invariants "
                            f"({len(broken)} failing, first: {first.workload}/{first.case} {first.check} = "
                            f"{first.actual})")
    sc = run.record.scenario
    lines = [f"# Baseline for scenario {sc.get('name')}, written by `hybridkv gate --write-baseline`",
             f"# from {run.folder} (git {run.record.context.get('git_sha')}).",
             "# Counts are exact; timing ratios are held to a floor with the case's own repeat spread as",
             "# tolerance; orderings compare cases of one run. Absolute times are not gated: machines differ.",
             f"scenario = {_toml_str(run.scenario_name)}",
             f"scale = {float(sc.get('scale', 1.0))!r}"]
    if sc.get("sha256"):
        lines.append(f"scenario_sha256 = {_toml_str(sc['sha256'])}")
    for c in run.cases:
        for metric in COUNT_METRICS:
            v = c.metrics.get(metric)
            if v is None or isinstance(v, bool):
                lines += ["", f"# {c.workload}/{c.name} {metric}: not measured in this run, not gated"]
                continue
            lines += ["", "[[check]]", f"workload = {_toml_str(c.workload)}", f"case = {_toml_str(c.name)}",
                      f"metric = {_toml_str(metric)}", 'direction = "equal"', "tolerance = 0.0",
                      f"value = {float(v)!r}"]
    names = [c.name for c in run.cases]
    for glob, metric, floor, spread in SPREAD_CHECKS:
        if fnmatch.filter(names, glob):
            lines += ["", "[[check]]", f"case = {_toml_str(glob)}", f"metric = {_toml_str(metric)}",
                      'direction = "higher"', "tolerance = 0.0", f"value = {floor!r}", f"spread = {spread!r}"]
    for better, worse in ORDERS:
        if not (fnmatch.filter(names, better) and fnmatch.filter(names, worse)):
            continue
        for metric, direction in ORDER_METRICS.items():
            lines += ["", "[[order]]", f"metric = {_toml_str(metric)}", f"direction = {_toml_str(direction)}",
                      f"better = {_toml_str(better)}", f"worse = {_toml_str(worse)}"]
    return "\n".join(lines) + "\n"


HEADERS = ("status", "workload", "case", "check", "actual", "expected")


def format_table(result: GateResult, only_failed: bool = False) -> str:
    """The gate's table: every check, or only the failed ones."""
    checks = result.failed if only_failed else result.checks
    rows = [(c.status, c.workload, c.case, c.check, c.actual, c.expected) for c in checks]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(HEADERS)]
    line = lambda cells: "  ".join(str(x).ljust(w) for x, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(HEADERS), line("-" * w for w in widths), *(line(r) for r in rows)])
