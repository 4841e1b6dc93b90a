"""Helpers of the vLLM connector tests (with conftest.py's fixtures): prompts, a request run to its end, the
connector's counters."""

from __future__ import annotations

import numpy as np

C = 80  # the tiny hybrid's unified block = chunk


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def run(engine, rid: str, toks: list[int]):
    engine.add_request(rid, toks)
    return engine.run()


def sched_stats(engine):
    return engine.scheduler.connector.scheduler_side.stats


def worker_stats(engine):
    return engine.worker.worker_side.stats


def settle(engine) -> None:
    """Wait for A's commits, then forget vLLM's local prefix cache so B's hit can only come from hybridkv."""
    engine.worker.worker_side.wait_idle(10)
    assert engine.scheduler.reset_prefix_cache()


def hits_by_source(engine) -> dict[str, int]:
    """vLLM's connector prefix-cache metric: external hit tokens by the tier the connector named, summed."""
    out: dict[str, int] = {}
    for s in engine.scheduler_stats:
        cps = s.connector_prefix_cache_stats
        for source, n in (cps.hits_by_source if cps is not None else {}).items():
            out[source.value] = out.get(source.value, 0) + n
    return out


def counters(endpoint: str) -> dict:
    """The server's Stats counters (a server started with --admin)."""
    from hybridkv.engine.client import CacheClient
    from hybridkv.wire import protocol as P

    with CacheClient(endpoint, timeout_s=10) as c:
        return c.call(P.Stats())[0].counters
