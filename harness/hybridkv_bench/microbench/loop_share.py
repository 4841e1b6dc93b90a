"""How long a huge request holds the server's loop: another client's worst wait beside the huge request's own time.

One client sends a huge pinned Lookup, then a huge Prefetch, then Releases the lookup's lease (by default
64 groups, half attention and half recurrent, x 16,384 keys, every object stored: a 524,320-object lease), an
unpinned Lookup, a PrepareStore and CommitStore of 4096 more keys x the groups, and an EndSession of a second
such lease, while another client on its own connection sends 71-chunk Lookups (pin=false, the latency case) back
to back.
For each huge request it prints the huge request's round trip and the other client's worst (and 99th percentile)
round trip among those that overlapped it, beside the other client's median round trip on an idle server.

    python -m hybridkv_bench.microbench.loop_share [--groups 64] [--attention 32] [--keys 16384] [--json]

Run it against a tree (PYTHONPATH) to compare two versions of the server: the server is `hybridkv serve`
started from the same interpreter and path.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from hybridkv.engine.client import CacheClient
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P

from hybridkv_bench.microbench.lookup_bench import store_chunks

STORE_KEYS = 4096  # the huge store's keys (x the groups: 262,144 objects in one PrepareStore and CommitStore)
STEPS = ("lookup", "prefetch", "release", "probe_lookup", "prepare", "commit", "end_session")


def huge_layout(groups: int, attention: int) -> ModelLayout:
    """`groups` groups of 2-byte objects (one 1-token block a chunk), the first `attention` attention, the rest
    recurrent: the object count is what costs, not the bytes."""
    return ModelLayout(model="loop-share", groups=tuple(
        GroupLayout(kind="attention" if g < attention else "recurrent", layer_names=(f"l{g}",), page_bytes=2,
                    block_tokens=1) for g in range(groups)))


class Other:
    """The other client, in a process of its own (a thread beside the huge request's client would wait for that
    client's decoding of its huge reply, not for the server): 71-chunk lookups back to back, each round trip kept
    with its start (time.monotonic, the same clock in every process)."""

    def __init__(self, endpoint: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridkv_bench.microbench.loop_share", "--other",
                                      endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.trips: list[tuple[float, float]] = []  # (start, seconds)

    def stop(self) -> None:
        out, _ = self.proc.communicate("stop\n", timeout=300)
        self.trips = [tuple(t) for t in json.loads(out)]

    def during(self, t0: float, t1: float) -> list[float]:
        """The round trips that overlapped [t0, t1], longest last."""
        return sorted(s for start, s in self.trips[1:] if start < t1 and start + s > t0)


def other_client(endpoint: str, idle_rounds: int = 300) -> None:
    """The other client's process: stores its chunks, times `idle_rounds` lookups alone (the first trip printed
    is their median, start 0), says ready, then looks up until stdin says stop; prints its trips as JSON."""
    with CacheClient(endpoint, timeout_s=300) as c:
        engine, keys = store_chunks(c)
        msg = P.Lookup(engine=engine, request="other", keys=keys, pin=False)
        idle = []
        for _ in range(idle_rounds):
            t = time.monotonic()
            c.call(msg)
            idle.append(time.monotonic() - t)
        stop = threading.Event()

        def wait_for_stop() -> None:
            sys.stdin.readline()
            stop.set()

        threading.Thread(target=wait_for_stop, daemon=True).start()
        print("ready", flush=True)
        trips = [(0.0, statistics.median(idle))]
        while not stop.is_set():
            t = time.monotonic()
            c.call(msg)
            trips.append((t, time.monotonic() - t))
    print(json.dumps(trips))


def measure(groups: int, attention: int, n_keys: int) -> dict[str, float | int]:
    sock_dir = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    # a slot is 4 KiB whatever the object: the arena holds every object's slot (a sparse file, the bytes unused)
    l1 = ((groups * (n_keys + STORE_KEYS) + 10_000) * 4096) / GIB + 0.1
    server = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/s.sock", l1_bytes=int(l1 * GIB), admin=True))
    out: dict[str, float | int] = {"groups": groups, "attention_groups": attention, "keys": n_keys}
    try:
        with CacheClient(server.endpoint, timeout_s=300) as big:
            reg = big.call(P.Register(layout=huge_layout(groups, attention), chunk_tokens=1))[0]
            keys = chunk_keys(reg.namespace, np.arange(n_keys), 1)
            for lo in range(0, n_keys, 4096):
                prep = big.call(P.PrepareStore(engine=reg.engine, request="s", keys=keys, objects=[
                    (c, g) for c in range(lo, min(n_keys, lo + 4096)) for g in range(groups)]))[0]
                big.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation))
            other = Other(server.endpoint)
            time.sleep(0.05)
            spans: dict[str, tuple[float, float]] = {}

            def timed(name: str, req: P.Message) -> P.Message:
                t0 = time.monotonic()
                res = big.call(req)[0]
                spans[name] = (t0, time.monotonic())
                out[f"{name}_ms"] = 1e3 * (spans[name][1] - t0)
                time.sleep(0.05)
                return res

            res = timed("lookup", P.Lookup(engine=reg.engine, request="big", keys=keys))
            assert isinstance(res, P.LookupResult), res
            out["lookup_objects"] = len(res.objects)
            pre = timed("prefetch", P.Prefetch(engine=reg.engine, keys=keys))
            assert isinstance(pre, P.Prefetching), pre
            timed("release", P.Release(engine=reg.engine, lease=res.lease))
            timed("probe_lookup", P.Lookup(engine=reg.engine, request="big", keys=keys, pin=False))
            more = chunk_keys(reg.namespace, np.arange(n_keys, n_keys + STORE_KEYS), 1)
            prep = timed("prepare", P.PrepareStore(engine=reg.engine, request="w", keys=more, objects=[
                (c, g) for c in range(STORE_KEYS) for g in range(groups)]))
            assert isinstance(prep, P.Prepared) and len(prep.slots) == STORE_KEYS * groups, prep
            timed("commit", P.CommitStore(engine=reg.engine, reservation=prep.reservation))
            big.call(P.Lookup(engine=reg.engine, request="again", keys=keys))
            time.sleep(0.05)
            timed("end_session", P.EndSession(engine=reg.engine, request="again"))
            other.stop()
            out["other_idle_p50_ms"] = 1e3 * other.trips[0][1]
            for name, (t0, t1) in spans.items():
                trips = other.during(t0, t1) or [0.0]
                out[f"{name}_other_worst_ms"] = 1e3 * trips[-1]
                out[f"{name}_other_p99_ms"] = 1e3 * trips[min(len(trips) - 1, int(0.99 * len(trips)))]
                out[f"{name}_other_trips"] = len(trips)
            # the prefetch lets its pins go when its last read ends, a large lease's in turns after its answer
            deadline = time.monotonic() + 10.0
            while (pinned := big.call(P.Stats())[0].counters["l1_pinned_objects"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            out["pinned_after"] = pinned
    finally:
        server.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--attention", type=int, default=32, help="attention groups among them (the rest recurrent)")
    ap.add_argument("--keys", type=int, default=16384)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--other", metavar="ENDPOINT", help=argparse.SUPPRESS)  # the other client's process
    a = ap.parse_args(argv)
    if a.other:
        other_client(a.other)
        return
    out = measure(a.groups, a.attention, a.keys)
    if a.json:
        print(json.dumps(out))
        return
    print(f"{a.groups} groups ({a.attention} attention) x {a.keys} keys; other client: 71-chunk lookups, "
          f"{out['other_idle_p50_ms']:.3f} ms p50 on an idle server")
    for name in STEPS:
        worst, p99, trips = (out[f"{name}_other_{k}"] for k in ("worst_ms", "p99_ms", "trips"))
        print(f"  {name:13s} {out[f'{name}_ms']:8.1f} ms; other client's worst wait {worst:7.1f} ms (p99 {p99:.1f} ms) "
              f"over {trips} round trips")
    print(f"  lease of {out['lookup_objects']} objects; pinned objects after: {out['pinned_after']}")


if __name__ == "__main__":
    main()
