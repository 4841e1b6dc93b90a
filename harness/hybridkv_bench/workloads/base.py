"""What every workload kind is: a `[[workloads]]` table of a scenario (a strict struct tagged by `kind`) that
says which requests it runs (`plan`), the longest prefix one request expects cached (`prefix_tokens`), the
bytes it stores (`working_set`), how `--quick` shrinks it (`shrink`), what it cannot measure as written
(`problem`), how a `--quick` copy fits the scaled tiers (`least_l1_gib`, `refit`, `l2_holds`)
and where its engines run on CUDA (`placement`). One kind per module of this package; `registry`
registers them.

A `Plan` is which engines run (TP rank of each) and the requests each runs, in phases separated by a
barrier (engines run one phase at once). Token ids are drawn from a generator seeded by the scenario seed
and the workload's name, so every repeat and every case of a run replays the same prompts. Prompts that
must part ways differ at their first own token.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Self

import numpy as np

from hybridkv_bench.strict import Strict

if TYPE_CHECKING:
    from hybridkv.model.layout import ModelLayout

    from hybridkv_bench.server_spec import ServerSpec

GIB = 1 << 30
VOCAB = 151_936  # Qwen3.5/3.6's vocabulary; token ids only feed chunk keys


@dataclass(frozen=True, slots=True)
class Request:
    name: str
    tokens: np.ndarray
    phase: Literal["cold", "warm"]  # cold: the first time its prefix is asked for in a repeat
    engine: int = 0
    # "load" / "store": this request's lookup+load (its store) starts together with the other aligned
    # requests of its phase, so their transfers overlap; "": no alignment
    align: Literal["", "load", "store"] = ""
    # multi_turn: where the warm prefix is meant to come from (`l1`, `l2`, `l2_prefetch`; "": not compared),
    # the user's think time before the request arrives, and the tokens known when it starts (the
    # conversation so far) that a prefetch hint names (0: no hint)
    tier: str = ""
    think_s: float = 0.0
    hint_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """Engines (their TP ranks) and their requests. Within a phase each engine runs its requests in
    order, all engines at once; a barrier separates phases."""

    ranks: tuple[int, ...]
    phases: tuple[tuple[Request, ...], ...]

    @property
    def requests(self) -> list[Request]:
        return [r for phase in self.phases for r in phase]

    def max_tokens(self, engine: int) -> int:
        return max((len(r.tokens) for r in self.requests if r.engine == engine), default=0)


def stream(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` random token ids."""
    return rng.integers(0, VOCAB, n, dtype=np.int64)


def tails(rng: np.random.Generator, n: int, count: int) -> list[np.ndarray]:
    """`count` token tails of length n whose first tokens all differ."""
    out = rng.integers(0, VOCAB, (count, n), dtype=np.int64)
    out[:, 0] = rng.choice(VOCAB, count, replace=False)
    return list(out)


def cat(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts)


@dataclass(frozen=True, slots=True)
class Shrink:
    """How `--quick` shrinks token and request counts (`scenario.sizes.scaled` builds it for a factor):
    `prefix` for prompts and system prefixes, `step` for what a turn adds, `tail` for questions and user
    tails, `count(n, least)` for counts that keep at least `least`."""

    prefix: Callable[[int], int]
    step: Callable[[int], int]
    tail: Callable[[int], int]
    count: Callable[[int, int], int]


@dataclass(frozen=True, slots=True)
class Sizing:
    """What a workload's checks know of the scenario: its server, whether its engine kind sends prefetch hints,
    its layout and chunk, and the bytes of a prefix under the smallest store policy (`prefix_bytes(tokens)`)."""

    server: ServerSpec
    sends_prefetch: bool
    layout: ModelLayout
    chunk: int
    prefix_bytes: Callable[[int], int]


class WorkloadTable:
    """What a scenario's `workloads` field holds to msgspec: not a struct, so msgspec hands each table to
    `workloads.registry.dec_hook`, which decodes it by its kind's registered class (every kind is one)."""

    __slots__ = ()


class WorkloadKind(Strict, WorkloadTable, frozen=True, tag_field="kind"):
    """The base of every workload kind (see the module doc)."""

    name: str = ""  # "" : the kind; names must be unique within a scenario

    engine_count: ClassVar[int] = 1  # engines that run the workload at once
    spills: ClassVar[bool] = False   # it is meant to overflow L1 into L2 (the working-set check allows it)

    @property
    def label(self) -> str:
        return self.name or self.kind

    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)

    def plan(self, rng: np.random.Generator, chunk_tokens: int, tp: int) -> Plan:
        raise NotImplementedError

    def prefix_tokens(self) -> int:
        """Tokens of the longest prefix one request of the workload expects to find cached."""
        raise NotImplementedError

    def working_set(self, one: Callable[[int], int]) -> int:
        """Bytes the workload stores into the cache (all documents, conversations, branches, ranks), where
        `one(tokens)` is the bytes of one prefix of `tokens` tokens."""
        raise NotImplementedError

    def shrink(self, s: Shrink) -> Self:
        raise NotImplementedError

    def least_l1_gib(self, one: Callable[[int], int]) -> float:
        """The L1 (GiB) a `--quick` copy needs at least, `one(tokens)` the bytes of a prefix: one request's."""
        return one(self.prefix_tokens()) / GIB

    def refit(self, l1_gib: float, one: Callable[[int], int]) -> Self:
        """A `--quick` copy refitted to the scaled L1 (GiB), where what the kind measures depends on it."""
        return self

    def l2_holds(self, fitted_before: bool) -> bool:
        """Whether the scaled L2 must hold this `--quick` copy's working set (`fitted_before`: the full
        workload's fitted the full L2)."""
        return False

    def problem(self, sizing: Sizing) -> str:
        """Why the workload cannot measure what it is for in this scenario ("" when it can)."""
        return ""

    def placement(self, visible: int) -> list[int]:
        """The CUDA device index of each engine when `visible` GPUs are visible."""
        return [0] * self.engine_count


def build_plan(w: WorkloadKind, chunk_tokens: int, seed: int, tp: int = 1) -> Plan:
    """The requests of workload `w` (see harness/README.md for what each kind measures)."""
    return w.plan(np.random.default_rng([seed, zlib.crc32(w.label.encode())]), chunk_tokens, tp)


def engine_gpus(w: WorkloadKind, visible: int) -> list[int]:
    """The CUDA device index of each engine of `w` when `visible` GPUs are visible (see MultiEngine)."""
    if visible < 1:
        raise ValueError(f"no CUDA device is visible to place the engines of {w.label} on")
    return w.placement(visible)
