"""A lookup's round trip through CacheClient.call(), p50 and p99 over ROUNDS: a 71-chunk full hit (pin=false, the
latency case) and a 1-chunk one, each on one thread against a real `hybridkv serve` started from the same tree
(PYTHONPATH), plus two threads sharing one client (the path where calls lead, follow and use the book).

    PYTHONPATH=<tree>/reference_impl:<tree>/kernels:<tree>/harness python lookup_rt.py [ROUNDS]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time

from hybridkv.engine.client import CacheClient
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv_bench.microbench.lookup_bench import store_chunks

try:
    from hybridkv.wire import protocol as P
except ImportError:  # a tree from before the core's folders (8362982 to 2704d0e)
    from hybridkv import protocol as P


def times(client: CacheClient, msg_of, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        msg = msg_of()
        t0 = time.perf_counter()
        client.call(msg)
        out.append(time.perf_counter() - t0)
    return out


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_us": round(statistics.median(xs) * 1e6, 1), "p99_us": round(xs[int(len(xs) * 0.99)] * 1e6, 1)}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    sock_dir = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    server = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/s.sock", l1_bytes=int(0.25 * GIB)))
    try:
        with CacheClient(server.endpoint, timeout_s=60) as c:
            engine, keys = store_chunks(c)
            out = {}
            for n in (71, 1):
                look = lambda n=n: P.Lookup(engine=engine, request="r", keys=keys[:n], pin=False)  # noqa: E731
                times(c, look, 100)  # warm-up
                out[f"lookup{n}"] = summary(times(c, look, rounds))
            shared: list[list[float]] = [[], []]
            look1 = lambda: P.Lookup(engine=engine, request="r", keys=keys[:1], pin=False)  # noqa: E731
            threads = [threading.Thread(target=lambda i=i: shared[i].extend(times(c, look1, rounds // 2)))
                       for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out["lookup1_2threads"] = summary(shared[0] + shared[1])
        print(json.dumps(out))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
