"""Scenario files: a model, a server, a prefill model, workloads and a matrix of transfer axes.

A scenario is TOML decoded strictly (`scenario.load`) into the structs below, the tables it shares with the
engines (`model_shape.ModelSpec`, `prefill.PrefillModel`, `server_spec.ServerSpec`) and the workload kinds of
`workloads.registry` (an unknown or misspelt key is an error naming the key path and the file), then
checked against the model's layout (`scenario.sizes.validate`: chunk size against the block sizes, L1
against one request, every workload's working set against L1 + L2). `expand_matrix` turns the matrix
(`scenario.matrix`, made from the engine's `TransferAxes`) into the list of cases a runner executes;
`scenario.sizes.scaled` shrinks a scenario for quick CPU runs.
"""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING, Literal

import msgspec
from hybridkv.engine.config import CommitMode, TransferAxes, TransferConfig
from hybridkv.wire.wire_formats import TRAITS

from hybridkv_bench.engines.hf.spec import TransformersSpec
from hybridkv_bench.engines.registry import engine_kind
from hybridkv_bench.model_shape import ModelSpec
from hybridkv_bench.prefill import PrefillModel
from hybridkv_bench.scenario.matrix import AXES, Matrix
from hybridkv_bench.server_spec import ServerSpec
from hybridkv_bench.strict import Strict
from hybridkv_bench.workloads import registry as workload_registry

if TYPE_CHECKING:
    # what a decoded scenario's workloads are: instances of the registered kinds
    from hybridkv_bench.workloads.base import WorkloadKind as Workload
else:
    # what msgspec sees: a non-struct type, decoded by the registry's hook (`convert`)
    from hybridkv_bench.workloads.base import WorkloadTable as Workload

Device = Literal["auto", "cpu", "cuda"]
# How the engines of a workload that runs several at once run: threads of the runner's process, or a
# process each (as vLLM runs its TP ranks); auto: processes for the sim engine on CUDA (see engines_in_processes)
EnginesAs = Literal["auto", "threads", "processes"]

# What a wire format needs inside the cache server (hybridkv.wire.wire_formats' traits): the gate reads these two
# sets; nothing else may decide which invariant applies to which format.
SERVER_IMPORTS_TORCH: frozenset[str] = frozenset(f for f, t in TRAITS.items() if t.server_imports_torch)
SERVER_HOLDS_CUDA_CONTEXT: frozenset[str] = frozenset(f for f, t in TRAITS.items() if t.server_holds_cuda)

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


class ScenarioError(ValueError):
    """A scenario file that cannot be run as written; the message names the file and the value."""


class Scenario(Strict, frozen=True):
    """One scenario file, decoded. Build with `load_scenario` or `decode_scenario`, which validate it."""

    name: str
    model: ModelSpec
    server: ServerSpec
    prefill: PrefillModel
    workloads: tuple[Workload, ...]
    description: str = ""
    seed: int = 0
    repeats: int = 1
    warmup: int = 0
    device: Device = "auto"
    matrix: Matrix = Matrix()
    engine: str = "sim"  # a kind of engines.registry
    transformers: TransformersSpec = TransformersSpec()  # read when engine = "transformers"
    engines_as: EnginesAs = "auto"
    commit: CommitMode = "fenced"  # every case's stores' commit (TransferConfig.commit)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"name must match {_NAME_RE.pattern}, got {self.name!r}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not self.workloads:
            raise ValueError("a scenario needs at least one workload")
        labels = [w.label for w in self.workloads]
        if len(set(labels)) != len(labels):
            raise ValueError(f"workload names must be unique (set `name` to tell them apart): {labels}")
        kind = engine_kind(self.engine)  # ValueError naming the known kinds
        if self.engines_as == "processes" and not kind.processes:
            raise ValueError(f"engines_as = 'processes' runs engines of the sim kind only; engine = {self.engine!r} "
                             "runs its engines in threads (set engines_as = 'threads' or 'auto')")

    def engines_in_processes(self, device_type: str, engines: int) -> bool:
        """Whether each of a workload's `engines` engines runs in a process of its own on `device_type`.

        One engine runs in the runner's process. Several: as `engines_as` says; `auto` gives processes to
        the sim engine on CUDA (vLLM runs its TP ranks as processes: in threads of one process the engines
        serialise on its GIL, and their aggregate rate is the GIL's) and threads elsewhere (CPU runs, the
        transformers and vllm engines), which start in no time."""
        if engines < 2:
            return False
        if self.engines_as != "auto":
            return self.engines_as == "processes"
        return engine_kind(self.engine).processes and device_type == "cuda"


def convert(data: object) -> Scenario:
    """A scenario from plain data (a TOML table, run.json's record), decoded strictly: each workload table by its
    kind's registered class. Raises msgspec.ValidationError."""
    return msgspec.convert(data, type=Scenario, dec_hook=workload_registry.dec_hook)


class Case(msgspec.Struct, frozen=True, kw_only=True):
    """One point of the matrix: a stable name and its transfer settings."""

    name: str
    settings: TransferAxes  # the matrix's axes and the scenario's commit

    @property
    def transfer(self) -> TransferConfig:
        """The case's `TransferConfig` (rank, chunk, salt and name at their defaults: each engine sets its own)."""
        return TransferConfig(**self.settings.axes())

    @property
    def axes(self) -> dict[str, str]:
        """The settings by axis name, in AXES order: what run.json, requests.csv and the report's tables show."""
        return {a: str(getattr(self.settings, a)) for a in AXES}


def expand_matrix(scenario: Scenario) -> list[Case]:
    """Every combination of the matrix's axes, in file order, minus the excluded ones."""
    m = scenario.matrix
    cases = []
    used = [False] * len(m.exclude)
    for values in itertools.product(*(m.values(a) for a in AXES)):
        axes = TransferAxes(**dict(zip(AXES, values, strict=True)), commit=scenario.commit)
        hits = [i for i, ex in enumerate(m.exclude) if ex.matches(axes)]
        for i in hits:
            used[i] = True
        if not hits:
            cases.append(Case(name="-".join(values), settings=axes))
    for i, u in enumerate(used):
        if not u:
            raise ScenarioError(f"{scenario.name}: exclude entry {msgspec.to_builtins(m.exclude[i])} "
                                "matches no case of the matrix")
    if not cases:
        raise ScenarioError(f"{scenario.name}: the exclude list removes every case of the matrix")
    return cases
