"""The Lookup handler timed in-process, without the socket: a probe (pin=False) and a pinned lookup + its release
of 71 chunks of tiny-hybrid, every object READY in L1 (the round-trip microbenchmark's lookup). On a loaded
machine the socket's noise (echo p50 from 25 to 117 us between runs) hides a microsecond; this does not.
Run it against two trees and compare (README.md beside it):

    PYTHONPATH=<tree>/reference_impl python results/cpu/2026-12-02/namespace_check/handler_bench.py LABEL
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
from hybridkv import protocol as P
from hybridkv.keys import chunk_keys
from hybridkv.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.loop import CacheServer
from hybridkv.server.ops import admin, lookup, retrieve, store


def bench(fn: Callable[[], None], n: int) -> tuple[float, float]:
    """(min, median) microseconds per call over 15 runs of n calls, after a warm-up."""
    for _ in range(2000):
        fn()
    out = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
    return min(out), statistics.median(out)


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "tree"
    d = tempfile.mkdtemp(dir="/tmp")
    srv = CacheServer(ServerConfig(endpoint=f"ipc://{d}/s.sock", l1_bytes=int(0.25 * GIB), admin=True))
    ctx = srv.ctx
    sent: list[P.Message] = []
    ctx.send = lambda ident, rid, msg, frames: sent.append(msg)  # deferred answers: kept, not sent
    layout = preset_layout("tiny-hybrid")
    ident = b"client"
    reg = admin.register(ctx, ident, P.Register(layout=layout, chunk_tokens=0), [])[0]
    keys = chunk_keys(reg.namespace, np.arange(71 * 80) % 5000, 80)
    store.prepare(ctx, ident, P.PrepareStore(engine=reg.engine, request="s", keys=keys, objects=[
        (k, g) for k in range(71) for g in range(len(layout.groups))]), [])
    prep = sent.pop()
    store.commit(ctx, ident, P.CommitStore(engine=reg.engine, reservation=prep.reservation), [])
    probe = P.Lookup(engine=reg.engine, request="r", keys=keys, pin=False)
    pinned = P.Lookup(engine=reg.engine, request="r", keys=keys)
    assert lookup.lookup(ctx, ident, probe, [])[0].hit_chunks == 71

    def probe_once() -> None:
        lookup.lookup(ctx, ident, probe, [])

    def pinned_once() -> None:
        lookup.lookup(ctx, ident, pinned, [])
        res = sent.pop()
        assert res.hit_chunks == 71
        retrieve.release(ctx, ident, P.Release(engine=reg.engine, lease=res.lease), [])

    cases = (("probe lookup (pin=False)", probe_once, 20000), ("pinned lookup + release", pinned_once, 3000))
    for name, fn, n in cases:
        lo, med = bench(fn, n)
        print(f"{label:>6}: {name}: min {lo:.2f} us, median {med:.2f} us of 15 runs")
    srv.close()


if __name__ == "__main__":
    main()
