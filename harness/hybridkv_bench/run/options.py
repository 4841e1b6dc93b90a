"""What a run is asked (`BenchOptions`), what it gives back (`RunOutcome`), and `BenchError`, a run that
cannot start as asked."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

if TYPE_CHECKING:
    from hybridkv.engine.transfer import Hit
    from hybridkv.server.front.launch import ServerProcess


class BenchError(Exception):
    """A run that cannot start as asked (bad device, endpoint, case filter, run folder)."""


def torch_device(device: str) -> torch.device:
    """The scenario's device as torch's: `auto` is the current CUDA device when torch sees one, else the CPU."""
    if device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if device == "cuda":
        raise BenchError("device 'cuda' asked for, but torch sees no CUDA device")
    return torch.device("cpu")



@dataclass(slots=True)
class BenchOptions:
    out: Path | None = None          # default: results/runs/<scenario>-<UTC time>
    server: str | None = None        # an already running server: server probes are not measured
    cases: str | None = None         # glob over case names or workload/case
    device: str | None = None        # overrides the scenario's device
    heartbeat_s: float = 30.0        # a long case prints that it is alive this often
    progress: TextIO = field(default_factory=lambda: sys.stderr)
    # Test hook, run between lookup and retrieve with the hit and the case's server (None: --server).
    before_retrieve: Callable[[Hit, ServerProcess | None], None] | None = None
    # A test of `report --compare` only: each timed store and retrieve of the sim engine waits this fraction of its
    # own time more inside its timing (0.25: the transfer rates at 1/1.25, a 20% slowdown). run.json's context
    # records it, and `report` says so on its first line.
    planted_slowdown: float = 0.0


@dataclass(slots=True)
class RunOutcome:
    folder: Path
    cases: int
    failed: list[str]
