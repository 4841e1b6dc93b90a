"""`hybridkv gate --write-baseline`: a baseline's TOML text from a run that passes its invariants."""

from __future__ import annotations

import fnmatch
from typing import Literal

import msgspec

from hybridkv_bench.gate.baseline import BaselineError
from hybridkv_bench.gate.checks import invariant_checks
from hybridkv_bench.results.folder import Run

# --write-baseline gates counts exactly, orderings inside the run, and timing ratios against a floor with the
# case's own repeat spread as tolerance; never absolute times (CI machines differ, and so does their load).
COUNT_METRICS = ("hit_tokens", "shared_tokens", "hit_share", "verified_chunks", "bytes_stored", "bytes_loaded")
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
