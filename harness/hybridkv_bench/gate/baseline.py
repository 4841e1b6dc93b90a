"""A gate baseline: its TOML file, decoded strictly (an unknown key or metric is an error naming it).

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
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from hybridkv_bench.metrics import METRICS
from hybridkv_bench.scenario.load import toml_error


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
