"""What every engine kind is to the runner: an `Engine` that runs one request and says what it measured in one
`RequestResult`, built from an `EngineSite` (what the runner knows of the case and the engine's place in it)
by the kind's `build` function (`engines.registry` names them)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from hybridkv_bench.engines.registry import engine_kind

if TYPE_CHECKING:
    import numpy as np
    import torch
    from hybridkv.engine.client import CacheClient
    from hybridkv.engine.config import TransferConfig
    from hybridkv.engine.transfer import Hit, KVTransfer
    from hybridkv.model.layout import ModelLayout
    from hybridkv.model.presets.gated_deltanet import HybridModelConfig

    from hybridkv_bench.engines.hf.spec import TransformersSpec
    from hybridkv_bench.engines.pools import EnginePools

CLIENT_TIMEOUT_S = 300.0  # one call may carry a legacy-format payload of GBs through a serializer


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request measured and verified, for every engine kind. Times in seconds; prefill_s is
    modeled. The model fields are a real model's (None: the engine runs none)."""

    hit_tokens: int
    lookup_s: float
    load_s: float
    prefill_s: float
    store_s: float
    store_done_s: float
    store_copy_s: float
    load_copy_s: float
    bytes_stored: int
    bytes_loaded: int
    verified_chunks: int
    corrupt_chunks: int
    load_start: float = 0.0   # perf_counter when the retrieve was submitted (0: no load)
    store_start: float = 0.0  # perf_counter when the store was submitted
    store_span_s: float = 0.0  # prepare submitted -> committed (0: the engine does not record it)
    prefill_measured_s: float | None = None    # the model's forwards
    adapter_s: float | None = None             # transformers cache <-> pages copies (not in any TTFT)
    # A layer-wise warm start: retrieve submitted -> the continuation's end, load and forward overlapped
    warm_span_s: float | None = None
    forward_alone_s: float | None = None       # warm: the same continuation from an in-memory cache (no load)
    logits_max_abs_diff: float | None = None   # warm: |restored - full prefill|
    logits_bitwise_equal: bool | None = None   # warm: restored == in-memory split
    oracle_pass: bool | None = None

    @property
    def ttft_s(self) -> float:
        """lookup + load (measured) + prefill of the uncached tokens (modeled); a miss loads nothing."""
        return self.lookup_s + self.load_s + self.prefill_s

    @property
    def ttft_measured_s(self) -> float | None:
        """Cold: the full prefill; warm: lookup + load + continuation; all measured (None: no model)."""
        if self.prefill_measured_s is None:
            return None
        if not self.hit_tokens:
            return self.prefill_measured_s
        if self.warm_span_s is not None:
            return self.lookup_s + self.warm_span_s
        return self.lookup_s + self.load_s + self.prefill_measured_s

    @property
    def warm_pipeline_ratio(self) -> float | None:
        """Warm: measured TTFT over the longer of its load and its continuation's forward alone (1.0: the two
        fully overlapped; about 2 when they run one after the other and take as long)."""
        ttft, fwd = self.ttft_measured_s, self.forward_alone_s
        if not self.hit_tokens or ttft is None or fwd is None or max(self.load_s, fwd) <= 0:
            return None
        return ttft / max(self.load_s, fwd)


class HitMismatch(RuntimeError):
    """The server's hit differs from what the stored prefixes allow (too short: lost data; too long: unsafe)."""


class Engine(Protocol):
    """One engine rank as the runner drives it."""

    @property
    def kv(self) -> KVTransfer:
        """Its KVTransfer (the runner clears its namespace between repeats)."""
        ...

    @property
    def gpu(self) -> int:
        """The CUDA device index its pages live on; -1 on CPU or without pools of its own."""
        ...

    def run(self, request_id: str, tokens: np.ndarray, gate: Callable[[str], None] | None = None) -> RequestResult:
        """One request. `gate("load")` / `gate("store")` run just before the lookup / the store, to start
        engines' transfers together; a kind that cannot align them refuses a gate."""
        ...

    def close(self) -> None:
        ...


@dataclass(slots=True)
class EngineSite:
    """What the runner knows of one engine of a case: the model, the case's transfer settings, the engine's rank and
    place, and the resources it hands out (`pools()`, `client()`: a new client the runner closes after the case).
    The scenario itself stays with the runner: the engines sit below it."""

    transformers: TransformersSpec  # the scenario's [transformers] table, read by that engine kind
    cfg: HybridModelConfig
    layout: ModelLayout
    chunk: int
    endpoint: str
    transfer: TransferConfig  # the case's (rank, chunk, salt and name: the engine's own are set when it builds)
    salt: str
    name: str
    engine: int
    rank: int
    device: torch.device      # where its pages live
    run_device: torch.device  # the run's device: what a kind builds once per run (a model) lives there
    max_tokens: int
    timeout_s: float
    prefill: Callable[[int, int], float]
    pools: Callable[[], EnginePools]
    client: Callable[[], CacheClient]
    before_retrieve: Callable[[Hit], None] | None = None
    planted_slowdown: float = 0.0  # BenchOptions.planted_slowdown (the sim engine's transfers only)
    shared: dict[str, Any] = field(default_factory=dict)  # per run: what a kind builds once (a model)


def gpu_of(device: torch.device) -> int:
    """The CUDA device index of `device`; -1 on the CPU."""
    return device.index if device.type == "cuda" and device.index is not None else -1


def refuse_gate(kind: str, gate: Callable[[str], None] | None) -> None:
    """Raise for an aligned request on an engine kind that cannot align its transfers."""
    if gate is not None:
        raise ValueError(f"the {kind} engine cannot align its transfers with other engines'")


def builder(kind: str) -> Callable[[EngineSite], Engine]:
    """The build function of engine kind `kind` (`engines.registry`), its module imported now."""
    module, _, name = engine_kind(kind).build.partition(":")
    return cast("Callable[[EngineSite], Engine]", getattr(importlib.import_module(module), name))
