"""The engine kinds a scenario's `engine` may name. A new kind is a module with a `build(site) -> Engine` function
and one `register_engine` line here; the module is imported only when a scenario asks for its kind (transformers
and vLLM are optional extras: `engines.base.builder`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KindInfo:
    build: str                   # "module:function" of its build(site) -> Engine
    processes: bool = False      # its engines can run as a process each (engines.procs)
    sends_prefetch: bool = True  # it sends a multi_turn's prefetch hints
    # environment defaults its library reads when imported, set by the CLI (the edge) before a run, never below
    env: tuple[tuple[str, str], ...] = ()


ENGINE_KINDS: dict[str, KindInfo] = {}


def register_engine(kind: str, info: KindInfo) -> None:
    if kind in ENGINE_KINDS:
        raise ValueError(f"engine kind {kind!r} is registered already ({ENGINE_KINDS[kind].build})")
    ENGINE_KINDS[kind] = info


# sim: pages derived from keys; transformers: a real model (engines/hf); vllm: vLLM's scheduler, simulated forward
register_engine("sim", KindInfo("hybridkv_bench.engines.sim:build", processes=True))
register_engine("transformers", KindInfo("hybridkv_bench.engines.hf.engine:build"))
# vLLM's planner only plans here (no model is built): its CPU platform, and no download of the config it wrote
register_engine("vllm", KindInfo("hybridkv_bench.engines.vllm:build", sends_prefetch=False,
                                 env=(("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"))))


def engine_kind(kind: str) -> KindInfo:
    """What is registered for engine kind `kind`; ValueError naming the known kinds."""
    try:
        return ENGINE_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {kind!r}; known: {', '.join(sorted(ENGINE_KINDS))}") from None
