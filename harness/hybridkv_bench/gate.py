"""`hybridkv gate`: compare a run with a baseline; fail on a regression or a broken invariant.

Baseline file (TOML, kept under results/baselines/<scenario>.toml):

    scenario = "smoke"            # must equal the run's scenario name
    scale = 1.0                   # optional; must equal the run's scale (a --quick run is another run)
    scenario_sha256 = "..."       # optional; a different scenario file is reported, not failed

    [[check]]
    workload = "*"                # glob over workload names (default "*")
    case = "shm-*"                # glob over case names (default "*")
    metric = "load_ceiling_ratio" # a name from hybridkv_bench.metrics.METRICS
    direction = "higher"          # higher: pass if actual >= value * (1 - tolerance)
    tolerance = 0.3               # lower:  pass if actual <= value * (1 + tolerance)
    value = 0.8

Every check must match at least one case of the run; one that matches none fails (the run lost a
case the baseline expects). Invariants hold whatever the baseline says: the run is complete, no case
failed, no chunk came back corrupt, a real model's logits oracle passed wherever it ran, the server
held no VRAM and mapped no CUDA library. The last two
are relaxed only where the wire format needs it (scenario.SERVER_HOLDS_CUDA_CONTEXT,
scenario.SERVER_IMPORTS_TORCH): such cases show the figure as `info`.
"""

from __future__ import annotations

import fnmatch
import math
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from .metrics import METRICS
from .results import Run
from .scenario import SERVER_HOLDS_CUDA_CONTEXT, SERVER_IMPORTS_TORCH

# --write-baseline gates ratios and counts, never absolute times: CI machines differ, a ratio to a
# ceiling measured in the same run does not.
BASELINE_METRICS: dict[str, tuple[str, float]] = {
    "store_ceiling_ratio": ("higher", 0.3),
    "load_ceiling_ratio": ("higher", 0.3),
    "ttft_speedup": ("higher", 0.3),
    "hit_tokens": ("higher", 0.0),
    "verified_chunks": ("higher", 0.0),
}

Status = Literal["pass", "FAIL", "info"]


class BaselineError(ValueError):
    """A baseline file that cannot be used with this run (bad file, other scenario, other scale)."""


class BaselineCheck(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    metric: str
    direction: Literal["higher", "lower"]
    tolerance: float
    value: float
    case: str = "*"
    workload: str = "*"

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}")
        if not 0 <= self.tolerance < 10:
            raise ValueError(f"tolerance must lie in [0, 10), got {self.tolerance}")
        if not math.isfinite(self.value):
            raise ValueError(f"value must be finite, got {self.value}")

    def limit(self) -> float:
        f = 1 - self.tolerance if self.direction == "higher" else 1 + self.tolerance
        return self.value * f

    def passes(self, actual: float) -> bool:
        return actual >= self.limit() if self.direction == "higher" else actual <= self.limit()


class Baseline(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    scenario: str
    check: tuple[BaselineCheck, ...] = ()
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


def load_baseline(path: str | Path) -> Baseline:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise BaselineError(f"{path}: cannot read baseline ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise BaselineError(f"{path}: invalid TOML: {e}") from None
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


def invariant_checks(run: Run) -> list[GateCheck]:
    """The checks no baseline can waive."""
    out = []
    if not run.complete:
        out.append(GateCheck(workload="*", case="*", check="run complete", actual="no",
                             expected="yes", status="FAIL"))
    for c in run.cases:
        def row(check: str, actual: str, expected: str, status: Status, c=c) -> GateCheck:
            return GateCheck(workload=c.workload, case=c.name, check=check, actual=actual, expected=expected,
                             status=status)

        if c.status == "failed":
            out.append(row("case ran", f"failed: {c.error}", "ok", "FAIL"))
            continue
        wire = c.axes.get("wire_format", "?")
        oracle = c.metrics.get("oracle_pass")
        if oracle is not None:  # a real model's warm requests: a wrong continuation fails the case
            out.append(row("oracle_pass", _num(oracle), "true", "pass" if oracle is True else "FAIL"))
        corrupt = c.metrics.get("corrupt_chunks")
        out.append(row("corrupt_chunks", _num(corrupt), "0",
                       "pass" if corrupt == 0 else "FAIL"))
        vram = c.metrics.get("server_vram_mib")
        if vram is None:
            out.append(row("server_vram_mib", "not measurable", "0", "info"))
        elif vram > 0 and wire in SERVER_HOLDS_CUDA_CONTEXT:
            out.append(row("server_vram_mib", _num(vram), f"any ({wire}: server holds a CUDA context)",
                           "info"))
        else:
            out.append(row("server_vram_mib", _num(vram), "0", "pass" if vram == 0 else "FAIL"))
        mapped = c.metrics.get("server_cuda_mapped")
        if mapped is True and wire in SERVER_IMPORTS_TORCH:
            out.append(row("server_cuda_mapped", "true", f"any ({wire}: server imports torch)", "info"))
        else:
            out.append(row("server_cuda_mapped", "not measured" if mapped is None else _num(mapped), "false",
                           "pass" if mapped is False else "FAIL"))
    return out


def baseline_checks(run: Run, baseline: Baseline) -> list[GateCheck]:
    out = []
    ok_cases = [c for c in run.cases if c.status == "ok"]
    for b in baseline.check:
        matched = [c for c in ok_cases
                   if fnmatch.fnmatchcase(c.workload, b.workload) and fnmatch.fnmatchcase(c.name, b.case)]
        op = ">=" if b.direction == "higher" else "<="
        sign = "-" if b.direction == "higher" else "+"
        expected = f"{op} {b.limit():.6g} ({b.value:.6g} {sign}{b.tolerance:.0%})"
        if not matched:
            out.append(GateCheck(workload=b.workload, case=b.case, check=b.metric, actual="no such case",
                                 expected=expected, status="FAIL"))
        for c in matched:
            actual = c.metrics.get(b.metric)
            if actual is None or isinstance(actual, bool):
                status: Status = "FAIL"
            else:
                status = "pass" if b.passes(float(actual)) else "FAIL"
            out.append(GateCheck(workload=c.workload, case=c.name, check=b.metric,
                                 actual="not measured" if actual is None else _num(actual),
                                 expected=expected, status=status))
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


def baseline_from_run(run: Run, metrics: dict[str, tuple[str, float]] | None = None) -> str:
    """TOML text of a baseline holding each ok case's value of `metrics` (default BASELINE_METRICS)."""
    metrics = metrics or BASELINE_METRICS
    broken = [c for c in invariant_checks(run) if c.status == "FAIL"]
    if broken:
        first = broken[0]
        raise BaselineError(f"refusing to baseline a run that fails its invariants "
                            f"({len(broken)} failing, first: {first.workload}/{first.case} {first.check} = "
                            f"{first.actual})")
    sc = run.record.scenario
    lines = [f"# Baseline for scenario {sc.get('name')}, written by `hybridkv gate --write-baseline`",
             f"# from {run.folder} (git {run.record.context.get('git_sha')}).",
             "# Only ratios and counts are gated: absolute times differ between machines.",
             f"scenario = {_toml_str(run.scenario_name)}",
             f"scale = {float(sc.get('scale', 1.0))!r}"]
    if sc.get("sha256"):
        lines.append(f"scenario_sha256 = {_toml_str(sc['sha256'])}")
    for c in run.cases:
        for metric, (direction, tolerance) in metrics.items():
            v = c.metrics.get(metric)
            if v is None or isinstance(v, bool):
                lines += ["", f"# {c.workload}/{c.name} {metric}: not measured in this run, not gated"]
                continue
            lines += ["", "[[check]]", f"workload = {_toml_str(c.workload)}", f"case = {_toml_str(c.name)}",
                      f"metric = {_toml_str(metric)}", f"direction = {_toml_str(direction)}",
                      f"tolerance = {tolerance!r}", f"value = {float(v)!r}"]
    return "\n".join(lines) + "\n"


def format_table(result: GateResult) -> str:
    headers = ("status", "workload", "case", "check", "actual", "expected")
    rows = [(c.status, c.workload, c.case, c.check, c.actual, c.expected) for c in result.checks]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(x).ljust(w) for x, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line("-" * w for w in widths), *(line(r) for r in rows)])
