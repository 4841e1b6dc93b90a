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
    # environment defaults its library reads when imported, set by the CLI (the edge) before a run, never below
    env: tuple[tuple[str, str], ...] = ()


ENGINE_KINDS: dict[EngineKind, KindInfo] = {
    "sim": KindInfo("hybridkv_bench.engines.sim:build", processes=True),
    "transformers": KindInfo("hybridkv_bench.engines.hf.engine:build"),
    # vLLM's planner only plans here (no model is built): its CPU platform, and no download of the config it wrote
    "vllm": KindInfo("hybridkv_bench.engines.vllm:build", sends_prefetch=False,
                     env=(("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"))),
}


def builder(kind: EngineKind) -> Callable[[EngineSite], Engine]:
    """The build function of engine kind `kind`, its module imported now."""
    module, _, name = ENGINE_KINDS[kind].build.partition(":")
    return cast("Callable[[EngineSite], Engine]", getattr(importlib.import_module(module), name))
