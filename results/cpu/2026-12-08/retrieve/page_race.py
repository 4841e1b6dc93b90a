"""Paged Retrieve under attack: an honest engine pages through its large leases (more objects than one Retrieve
answers) and races its own Release / EndSession between slices, checking every byte of every slice it gets; a hostile
client on another connection, which sees the honest engine's ids and lease ids, asks for their slices under the honest
engine's id, under its own id with the honest lease, and with huge or negative `first`. Exit 1 on any wrong byte, a
slice of a released lease answered, a slice handed to the wrong client, or a dead server.

    PYTHONPATH=$PWD/reference_impl:$PWD/reference_impl/tests DUR=40 python page_race.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import tempfile
import time

DUR = float(os.environ.get("DUR", "40"))
CHUNKS = 900  # x 4 groups = 3,600 objects a lease: four slices at the default cap of 1,024


def layout():
    from hybridkv.model.layout import GroupLayout, ModelLayout

    return ModelLayout(model="pages", groups=tuple(
        GroupLayout(kind="attention", layer_names=(f"a{i}",), page_bytes=24 + 8 * i, block_tokens=1) for i in range(4)))


def honest(ep: str, ids, out: mp.Queue) -> None:
    from hybridkv.engine.client import CacheClient, ServerError
    from hybridkv.wire import protocol as P
    from serverkit import Engine

    rng = random.Random(1)
    st = {"who": "honest", "bytes_checked": 0, "slices": 0, "bad": 0, "refused_after_release": 0, "errors": {}}
    c = CacheClient(ep, timeout_s=60)
    eng = Engine(c, layout=layout(), chunk_tokens=2, salt="A")
    c.keepalive(eng.id, 0.5)
    keys = eng.keys(CHUNKS, seed=3)
    eng.store(keys)

    def check(r: P.Retrieved, frames) -> None:
        for o, f in zip(r.objects, frames, strict=True):
            if bytes(f) != eng.payload(keys[o.chunk], o.group, o.length).tobytes():
                st["bad"] += 1
                print(f"!!! wrong bytes chunk {o.chunk} group {o.group}", flush=True)
            st["bytes_checked"] += o.length
        st["slices"] += 1

    until = time.monotonic() + DUR
    i = 0
    while time.monotonic() < until:
        i += 1
        req = f"q{i}"
        try:
            res = eng.lookup(keys, policy="all", request=req)
            ids[0], ids[1] = eng.id, res.lease  # what the hostile sees
            mode = rng.randrange(3)
            if mode == 0:  # the whole lease, paged by the client
                r, frames = c.call(P.Retrieve(engine=eng.id, lease=res.lease, format="raw"))
                if len(r.objects) != CHUNKS * 4:
                    st["bad"] += 1
                    print(f"!!! paged retrieve joined {len(r.objects)} objects", flush=True)
                check(r, frames)
                c.call(P.Release(engine=eng.id, lease=res.lease))
            else:  # a slice from anywhere, then Release or EndSession behind it, then the next slice
                first = rng.randrange(CHUNKS * 4)
                fut = c.submit(P.Retrieve(engine=eng.id, lease=res.lease, format="raw", first=first))
                c.call(P.Release(engine=eng.id, lease=res.lease) if mode == 1 else P.EndSession(engine=eng.id,
                                                                                                  request=req))
                r, frames = fut.result(60)
                check(r, frames)
                if r.next < r.total:
                    try:
                        c.call(P.Retrieve(engine=eng.id, lease=res.lease, format="raw", first=r.next))
                        st["bad"] += 1
                        print("!!! a released lease answered its next slice", flush=True)
                    except ServerError:
                        st["refused_after_release"] += 1
            if mode != 2:
                c.call(P.EndSession(engine=eng.id, request=req))
        except ServerError as e:
            st["errors"][e.code] = st["errors"].get(e.code, 0) + 1
    out.put(st)


def hostile(ep: str, ids, out: mp.Queue) -> None:
    from hybridkv.engine.client import CacheClient, ServerError
    from hybridkv.wire import protocol as P
    from serverkit import Engine

    rng = random.Random(2)
    st = {"who": "hostile", "asked": 0, "refused": 0, "bad": 0, "errors": {}}
    c = CacheClient(ep, timeout_s=60)
    eng = Engine(c, layout=layout(), chunk_tokens=2, salt="B")
    c.keepalive(eng.id, 0.5)
    until = time.monotonic() + DUR
    while time.monotonic() < until:
        their_engine, their_lease = int(ids[0]), int(ids[1])
        if not their_lease:
            continue
        first = rng.choice([0, 1, 1023, 1024, 3599, 3600, -1, 2**63 - 1, rng.randrange(4000)])
        engine = rng.choice([their_engine, eng.id])
        st["asked"] += 1
        try:
            r, frames = c.submit(P.Retrieve(engine=engine, lease=their_lease, format="raw", first=first)).result(60)
            st["bad"] += 1  # any slice of another client's lease is a leak
            print(f"!!! hostile got {len(frames)} frames of another client's lease", flush=True)
        except ServerError as e:
            st["refused"] += 1
            st["errors"][e.code] = st["errors"].get(e.code, 0) + 1
    out.put(st)


def main() -> int:
    from hybridkv.engine.client import CacheClient
    from hybridkv.server.books.config import ServerConfig
    from hybridkv.server.front.launch import start_server
    from hybridkv.wire import protocol as P

    d = tempfile.mkdtemp(prefix="pages-", dir="/tmp")
    s = start_server(ServerConfig(l1_bytes=64 << 20, endpoint=f"ipc://{d}/s.sock", client_timeout_s=5.0))
    ctx = mp.get_context("fork")
    ids = ctx.Array("q", 2)
    q: mp.Queue = ctx.Queue()
    ps = [ctx.Process(target=f, args=(s.endpoint, ids, q)) for f in (honest, hostile)]
    for p in ps:
        p.start()
    worst = 0.0
    with CacheClient(s.endpoint, timeout_s=30) as obs:
        t_end = time.monotonic() + DUR
        while time.monotonic() < t_end:
            t = time.perf_counter()
            obs.call(P.Health())
            worst = max(worst, time.perf_counter() - t)
            time.sleep(0.02)
        results = [q.get(timeout=120) for _ in ps]
        for p in ps:
            p.join(30)
        status = obs.call(P.Status())
    alive = s.proc.poll() is None
    s.stop()
    for r in results:
        print(r)
    print(f"status: {status}")
    print(f"worst Health wait {worst * 1000:.0f} ms; server alive: {alive}")
    return 1 if any(r["bad"] for r in results) or not alive else 0


if __name__ == "__main__":
    raise SystemExit(main())
