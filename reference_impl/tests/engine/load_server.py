"""Load a real cache server with 16 client processes, three of them misbehaving, and report what it held.

    python reference_impl/tests/engine/load_server.py --seconds 20

13 engines store, look up and release in a loop (shm format; lookup latency measured per call); one
client sends retrieves and never reads a reply; one registers, reserves slots and vanishes mid-store
(over and over, a new process each time); one pins leases and never releases them. Passes when every
well-behaved engine kept making progress (no call slower than --stall-s), the server's RSS stayed under
--max-rss-mib, and every retrieved byte matched what was stored. The same 13 engines run first without
the misbehaving three: that run is the reference the loaded figures are read against.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))  # fuzz_server, the server tests' helper

GOOD = 13


def _good(endpoint: str, seconds: float, idx: int, out) -> None:
    """A well-behaved engine: store 4 chunks, look them up, check the bytes, release, end the session."""
    import numpy as np
    from hybridkv.engine.client import CacheClient
    from hybridkv.wire import protocol as P
    from serverkit import Engine

    lat: list[float] = []
    worst = ops = corrupt = 0.0
    with CacheClient(endpoint, timeout_s=60) as c:
        eng = Engine(c, salt=f"good-{idx}")
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            keys = eng.keys(4, seed=idx * 1_000_000 + n % 50)  # a working set that is revisited
            t = time.monotonic()
            eng.store(keys, request=str(n))
            t1 = time.monotonic()
            hit = eng.lookup(keys, request=str(n))
            t2 = time.monotonic()
            for o in hit.objects:
                got = eng.arena[o.offset:o.offset + o.length]
                if not np.array_equal(got, Engine.payload(keys[o.chunk], o.group, o.length)):
                    corrupt += 1
            c.call(P.EndSession(engine=eng.id, request=str(n)))
            t3 = time.monotonic()
            lat.append(t2 - t1)
            worst = max(worst, t1 - t, t2 - t1, t3 - t2)
            ops += 3
            n += 1
    out.put({"role": "good", "ops": ops, "lookup_s": lat, "worst_s": worst, "corrupt": corrupt})


def _never_reads(endpoint: str, seconds: float, out) -> None:
    """Sends retrieves of a leased chunk as fast as it can and never reads an answer."""
    import zmq
    from fuzz_server import SocketClient
    from hybridkv.wire import protocol as P
    from serverkit import Engine

    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 100)
    sock.connect(endpoint)
    eng = Engine(SocketClient(sock), salt="never-reads")
    keys = eng.keys(4, seed=7)
    eng.store(keys)
    lease = eng.lookup(keys).lease
    sent = 0
    end = time.monotonic() + seconds
    msg = P.encode(P.Retrieve(engine=eng.id, lease=lease, format="raw"))
    while time.monotonic() < end:
        try:
            sock.send(msg)
            sent += 1
        except zmq.Again:
            time.sleep(0.01)  # the server stopped reading from us: back-pressure, not growth
    out.put({"role": "never_reads", "sent": sent})
    sock.close(linger=0)


def _vanisher(endpoint: str) -> None:
    """Registers, reserves slots, writes half of them and dies without committing."""
    from hybridkv.engine.client import CacheClient
    from serverkit import Engine

    c = CacheClient(endpoint, timeout_s=30)
    eng = Engine(c, salt=f"vanish-{os.getpid()}")
    from hybridkv.wire import protocol as P

    keys = eng.keys(4, seed=os.getpid())
    prep, _ = c.call(P.PrepareStore(engine=eng.id, request="v", keys=keys,
                                    objects=[(i, g) for i in range(4) for g in range(4)]))
    for s in prep.slots[: len(prep.slots) // 2]:
        eng.arena[s.offset:s.offset + s.length] = 0xAB
    os._exit(0)  # mid-transfer: no commit, no abort, no unregister


def _disconnects(endpoint: str, seconds: float, out) -> None:
    ctx = mp.get_context("spawn")
    kills = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        p = ctx.Process(target=_vanisher, args=(endpoint,))
        p.start()
        p.join(60)
        kills += 1
    out.put({"role": "disconnects", "vanished": kills})


def _holds_pins(endpoint: str, seconds: float, out) -> None:
    """Looks up and never releases: its leases pile up to the per-engine limit and stay pinned."""
    from hybridkv.engine.client import CacheClient, ServerError
    from serverkit import Engine

    refused = held = 0
    with CacheClient(endpoint, timeout_s=60) as c:
        eng = Engine(c, salt="holds-pins")
        keys = eng.keys(2, seed=11)
        eng.store(keys)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                eng.lookup(keys, request=f"h{held}")
                held += 1
            except ServerError as e:
                assert e.code == "limit", e
                refused += 1
                time.sleep(0.05)
    out.put({"role": "holds_pins", "leases": held, "refused": refused})


def run(endpoint: str, pid: int, seconds: float, hostile: bool = True) -> dict:
    """The 13 engines, with the three misbehaving clients (hostile) or alone (the same run's reference)."""
    from fuzz_server import rss_mib

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_good, args=(endpoint, seconds, i + (100 if hostile else 0), out))
             for i in range(GOOD)]
    if hostile:
        procs += [ctx.Process(target=_never_reads, args=(endpoint, seconds, out)),
                  ctx.Process(target=_disconnects, args=(endpoint, seconds, out)),
                  ctx.Process(target=_holds_pins, args=(endpoint, seconds, out))]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    rss = []
    results: list[dict] = []
    while len(results) < len(procs) and time.monotonic() - t0 < seconds + 180:
        rss.append(rss_mib(pid))
        try:
            results.append(out.get(timeout=0.5))
        except Exception:  # noqa: BLE001 - queue.Empty from another module
            pass
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    wall = time.monotonic() - t0
    good = [r for r in results if r["role"] == "good"]
    lat = sorted(x for r in good for x in r["lookup_s"])
    return {
        "processes": len(procs), "finished": len(results), "seconds": wall,
        "ops_per_s": sum(r["ops"] for r in good) / seconds,
        "lookup_p50_ms": 1e3 * statistics.median(lat) if lat else None,
        "lookup_p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))] if lat else None,
        "worst_call_s": max((r["worst_s"] for r in good), default=None),
        "corrupt_objects": sum(r["corrupt"] for r in good),
        "rss_max_mib": max(rss), "rss_start_mib": rss[0],
        "misbehaving": [r for r in results if r["role"] != "good"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--stall-s", type=float, default=10.0)
    ap.add_argument("--max-rss-mib", type=float, default=256.0)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from hybridkv.server.books.config import GIB, ServerConfig
    from hybridkv.server.front.launch import start_server

    sock = tempfile.mkdtemp(prefix="hkv-ld-", dir="/tmp")
    server = start_server(ServerConfig(endpoint=f"ipc://{sock}/s.sock", l1_bytes=GIB // 4, max_queued_replies=100,
                                       max_leases=256, client_timeout_s=5), log_level="error")
    try:
        alone = run(server.endpoint, server.pid, args.seconds, hostile=False)
        res = run(server.endpoint, server.pid, args.seconds)
        res["server_alive"] = server.alive()
        res["reference_without_misbehaving_clients"] = {k: alone[k] for k in (
            "ops_per_s", "lookup_p50_ms", "lookup_p99_ms", "worst_call_s", "rss_max_mib")}
    finally:
        server.stop()
        server.close()
    print(json.dumps(res, indent=1))
    ok = (res["server_alive"] and res["finished"] == res["processes"] and res["corrupt_objects"] == 0
          and res["worst_call_s"] is not None and res["worst_call_s"] < args.stall_s
          and res["rss_max_mib"] < args.max_rss_mib)
    print(f"load {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
