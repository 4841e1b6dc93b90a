"""The engine kinds a scenario's `engine` may name. A new kind is a module with a `build(site) -> Engine`
function and one entry here; the module is imported only when a scenario asks for its kind (transformers
and vLLM are optional extras)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

if TYPE_CHECKING:
    from hybridkv_bench.engines.base import Engine, EngineSite

EngineKind = Literal["sim", "transformers", "vllm"]  # sim: pages derived from keys; transformers: engines/hf


@dataclass(frozen=True, slots=True)
class KindInfo:
    build: str                   # "module:function" of its build(site) -> Engine
    processes: bool = False      # its engines can run as a process each (engines.procs)
    sends_prefetch: bool = True  # it sends a multi_turn's prefetch hints


ENGINE_KINDS: dict[EngineKind, KindInfo] = {
    "sim": KindInfo("hybridkv_bench.engines.sim:build", processes=True),
    "transformers": KindInfo("hybridkv_bench.engines.hf.engine:build"),
    "vllm": KindInfo("hybridkv_bench.engines.vllm:build", sends_prefetch=False),
}


def builder(kind: EngineKind) -> Callable[[EngineSite], Engine]:
    """The build function of engine kind `kind`, its module imported now."""
    module, _, name = ENGINE_KINDS[kind].build.partition(":")
    return cast("Callable[[EngineSite], Engine]", getattr(importlib.import_module(module), name))
