"""Lookup round trip p50 (µs) against a real `hybridkv serve`, for the tree on PYTHONPATH: a small lookup (71 chunks of
tiny-hybrid, the latency case) pinned and not, and a large one (2,048 chunks x tiny-hybrid's groups, above
turns.BIG_OBJECTS, so in turns) pinned and not; each pinned lookup's lease released after it (not timed).

    PYTHONPATH=TREE/reference_impl:TREE/kernels:TREE/harness python lookup_p50.py [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from hybridkv.engine.client import CacheClient

try:  # this round's tree
    from hybridkv.server.books.config import GIB, ServerConfig
    from hybridkv.server.front.launch import start_server
    from hybridkv.wire import protocol as P
except ImportError:  # 9d8dd9e, before the reshape: server/ flat, the protocol at the package's top
    from hybridkv import protocol as P  # type: ignore[no-redef]
    from hybridkv.server.config import GIB, ServerConfig  # type: ignore[no-redef]
    from hybridkv.server.launch import start_server  # type: ignore[no-redef]
from hybridkv_bench.microbench.lookup_bench import store_chunks

SIZES = {"small": 71, "large": 2048}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        server = start_server(ServerConfig(endpoint=f"ipc://{d}/s.sock", l1_bytes=int(0.5 * GIB)))
        try:
            with CacheClient(server.endpoint, timeout_s=60) as c:
                for size, chunks in SIZES.items():
                    eng, keys = store_chunks(c, chunks)
                    rounds = a.rounds if size == "small" else max(20, a.rounds // 10)
                    for pin in (False, True):
                        times = []
                        for _ in range(rounds):
                            t = time.perf_counter()
                            res = c.call(P.Lookup(engine=eng, request="r", keys=keys, pin=pin))[0]
                            times.append(time.perf_counter() - t)
                            assert res.hit_chunks == chunks, res.hit_chunks
                            if res.lease:
                                c.call(P.Release(engine=eng, lease=res.lease))
                        out[f"{size}_{'pinned' if pin else 'probe'}_us"] = round(statistics.median(times) * 1e6, 1)
        finally:
            server.close()
    print(json.dumps(out) if a.json else "\n".join(f"{k:24s} {v:10.1f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
