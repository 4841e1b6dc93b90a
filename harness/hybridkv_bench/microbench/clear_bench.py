"""How long a large Clear holds the server's loop: another client's Health round trips while one client clears
its namespace, on a real server process.

    python -m hybridkv_bench.microbench.clear_bench [--objects N] [--l2-objects M]

Stores N tiny objects in L1 (half of them in the clearing engine's namespace, half in another's), and, with
--l2-objects, writes M objects of the clearing namespace into an L2 directory before the server starts (it indexes
them at start). Prints the Clear's round trip, the objects it dropped, and the worst and median Health round trip
another client saw while the Clear worked.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import numpy as np
from hybridkv.engine.client import CacheClient
from hybridkv.model.keys import chunk_keys, namespace
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
from hybridkv.server.l2.fs import FilesystemL2
from hybridkv.wire import protocol as P

CT = 2
GROUPS = 4
LAYOUT = ModelLayout(model="clear", groups=tuple(
    GroupLayout(kind="attention", layer_names=(f"a{g}",), page_bytes=2, block_tokens=1) for g in range(GROUPS)))
PER_STORE = 1 << 14  # keys per PrepareStore


def fill(client: CacheClient, engine: int, ns: bytes, objects: int, seed: int) -> None:
    chunks = objects // GROUPS
    for start in range(0, chunks, PER_STORE):
        n = min(PER_STORE, chunks - start)
        tokens = np.random.default_rng(seed * 1000 + start).integers(0, 1 << 30, (n + 1) * CT)
        keys = chunk_keys(ns, tokens, CT)[:n]
        prep, _ = client.call(P.PrepareStore(engine=engine, request="f", keys=keys,
                                             objects=[(c, g) for c in range(n) for g in range(GROUPS)]))
        if prep.reservation:
            client.call(P.CommitStore(engine=engine, reservation=prep.reservation))


def fill_l2(directory: str, ns: bytes, objects: int) -> None:
    l2 = FilesystemL2(directory, 1 << 40, direct_io=False)
    rng = np.random.default_rng(7)
    for i in range(objects):
        l2.put(rng.bytes(16), i % GROUPS, ns, b"xy")
    l2.close()


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--objects", type=int, default=1 << 20)
    ap.add_argument("--l2-objects", type=int, default=0)
    ap.add_argument("--sock-dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    ns_a = namespace(LAYOUT, 0, CT, "a")
    l2_dir = tempfile.mkdtemp(prefix="clear-bench-l2-") if a.l2_objects else None
    if l2_dir:
        t = time.perf_counter()
        fill_l2(l2_dir, ns_a, a.l2_objects)
        print(f"L2: {a.l2_objects} objects written in {time.perf_counter() - t:.1f}s")
    gib = (a.objects * 4096 * 1.05 + (64 << 20)) / (1 << 30)
    flags = [f"--endpoint=ipc://{a.sock_dir}/clear-bench.sock", f"--l1-gib={gib:.3f}", "--admin",
             "--client-timeout=600"]
    if l2_dir:
        flags += [f"--l2-dir={l2_dir}", "--l2-gib=64", "--spill-watermark=0"]
    server = start_server(parse(flags), ready_timeout=600)
    try:
        with CacheClient(server.endpoint, timeout_s=600) as ca, CacheClient(server.endpoint, timeout_s=600) as cb:
            ra = ca.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt="a"))[0]
            rb = cb.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt="b"))[0]
            assert ra.namespace == ns_a
            t = time.perf_counter()
            fill(ca, ra.engine, ra.namespace, a.objects // 2, 1)
            fill(cb, rb.engine, rb.namespace, a.objects // 2, 2)
            before = ca.call(P.Stats())[0].counters
            print(f"stored {before['l1_objects']} L1 objects in {time.perf_counter() - t:.1f}s; "
                  f"L2 {before.get('l2_objects', 0)}")
            rtts: list[float] = []
            stop = threading.Event()

            def watch() -> None:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    cb.call(P.Health())
                    rtts.append(time.perf_counter() - t0)
                    time.sleep(0.001)

            w = threading.Thread(target=watch)
            w.start()
            time.sleep(0.2)
            n_before = len(rtts)
            t0 = time.perf_counter()
            done = ca.call(P.Clear(engine=ra.engine))[0]
            clear_s = time.perf_counter() - t0
            stop.set()
            w.join()
            during = rtts[n_before:] or [0.0]
            after = ca.call(P.Stats())[0].counters
            print(f"Clear: {clear_s * 1e3:.1f} ms, dropped {done.count}; L1 {after['l1_objects']} left, "
                  f"L2 {after.get('l2_objects', 0)} left")
            print(f"Health during the clear: {len(during)} round trips, worst {max(during) * 1e3:.1f} ms, "
                  f"median {statistics.median(during) * 1e3:.2f} ms")
    finally:
        server.close()


if __name__ == "__main__":
    main()
