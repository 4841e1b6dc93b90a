"""Chaos: honest engines (salt A) check every byte they get; hostile clients (salt B, knowing A's keys) race
big lookups/prefetches against release/end/unregister/clear, pause themselves, send garbage; the parent pauses the
server. Prints a summary; exit 1 on any wrong byte or a dead server. MEMFD=1: a server of --l1-memfd.

    PYTHONPATH=$PWD/reference_impl:$PWD/reference_impl/tests:$PWD/reference_impl/tests/server DUR=90 python chaos.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

DUR = float(os.environ.get("DUR", "60"))
NCH = int(os.environ.get("NCH", "1500"))
SETS = 6
L1 = float(os.environ.get("L1", "0.001"))


def layout():
    from hybridkv.model.layout import GroupLayout, ModelLayout

    return ModelLayout(
        model="chaos",
        groups=(
            GroupLayout(kind="attention", layer_names=("a",), page_bytes=32, block_tokens=1),
            GroupLayout(kind="recurrent", layer_names=("r",), page_bytes=40, block_tokens=1),
            GroupLayout(kind="sliding", layer_names=("s",), page_bytes=24, block_tokens=1, window=9),
            GroupLayout(kind="attention", layer_names=("b",), page_bytes=32, block_tokens=1),
        ),
    )


def keyset(ns: bytes, i: int, n: int = NCH) -> list[bytes]:
    from hybridkv.model.keys import chunk_keys

    toks = np.random.default_rng(1000 + i).integers(0, 50000, n * 2)
    return chunk_keys(ns, toks, 2)


def honest(ep: str, idx: int, out: mp.Queue, salt: str = "A") -> None:
    from hybridkv.engine.client import CacheClient, ServerError, ServerTimeout
    from hybridkv.wire import protocol as P
    from serverkit import Engine

    rng = random.Random(idx)
    stats = {"lookups": 0, "objects_checked": 0, "raw_checked": 0, "bad": 0, "errors": {}, "who": f"honest{idx}{salt}"}
    c = CacheClient(ep, timeout_s=60)
    eng = Engine(c, layout=layout(), chunk_tokens=2, salt=salt)
    c.keepalive(eng.id, 0.5)
    sets = [keyset(eng.reg.namespace, i) for i in range(SETS)]
    until = time.monotonic() + DUR
    while time.monotonic() < until:
        i = rng.randrange(SETS)
        keys = sets[i][: rng.choice([NCH, NCH, NCH // 2, 100, 10])]
        try:
            if rng.random() < 0.5:
                eng.store(keys, request=f"s{i}")
            if rng.random() < 0.2:
                c.call(P.Prefetch(engine=eng.id, keys=keys, policy="all"))
            pol = rng.choice(["all", "boundary"])
            res = eng.lookup(keys, policy=pol, request=f"q{i}", skip=rng.choice([0, 0, 3]))
            stats["lookups"] += 1
            for o in res.objects:
                got = eng.arena[o.offset : o.offset + o.length]
                if not np.array_equal(got, eng.payload(keys[o.chunk], o.group, o.length)):
                    stats["bad"] += 1
                    if stats["bad"] < 5:
                        print(f"!!! {stats['who']} WRONG BYTES shm chunk {o.chunk} group {o.group}", flush=True)
                stats["objects_checked"] += 1
            if res.lease and rng.random() < 0.5:
                r, frames = c.call(P.Retrieve(engine=eng.id, lease=res.lease, format="raw"))
                for o, f in zip(r.objects, frames, strict=True):
                    if bytes(f) != eng.payload(keys[o.chunk], o.group, o.length).tobytes():
                        stats["bad"] += 1
                        if stats["bad"] < 5:
                            print(f"!!! {stats['who']} WRONG BYTES raw chunk {o.chunk} group {o.group}", flush=True)
                    stats["raw_checked"] += 1
            if res.lease:
                if rng.random() < 0.5:
                    c.call(P.Release(engine=eng.id, lease=res.lease))
                else:
                    c.call(P.EndSession(engine=eng.id, request=f"q{i}"))
        except (ServerError, ServerTimeout) as e:
            code = getattr(e, "code", type(e).__name__)
            stats["errors"][code] = stats["errors"].get(code, 0) + 1
            if code == "unknown_engine":
                print(f"!!! {stats['who']} lost its engine: {e}", flush=True)
                eng = Engine(c, layout=layout(), chunk_tokens=2, salt=salt)
                c.keepalive(eng.id, 0.5)
            if isinstance(e, ServerTimeout):
                print(f"!!! {stats['who']} timeout: {e}", flush=True)
    out.put(stats)
    c.close()


def hostile(ep: str, idx: int, out: mp.Queue) -> None:
    import msgspec
    import zmq
    from hybridkv.engine.client import CacheClient, ServerError, ServerTimeout
    from hybridkv.model.keys import namespace
    from hybridkv.wire import protocol as P
    from serverkit import Engine

    rng = random.Random(100 + idx)
    stats = {"ops": 0, "errors": {}, "bad": 0, "who": f"hostile{idx}", "exc": 0}
    c = CacheClient(ep, timeout_s=60)
    lay = layout()
    eng = Engine(c, layout=lay, chunk_tokens=2, salt="B")
    a_ns = namespace(lay, 0, 2, "A")
    a_sets = [keyset(a_ns, i) for i in range(SETS)]
    b_sets = [keyset(eng.reg.namespace, i) for i in range(SETS)]
    futs = []
    leases: list[int] = []
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ep)
    until = time.monotonic() + DUR
    while time.monotonic() < until:
        stats["ops"] += 1
        op = rng.randrange(14)
        keys = rng.choice(a_sets + b_sets)
        mine = keys in b_sets
        try:
            if op == 0:  # big lookup, then at once something that frees what it walks
                f = c.submit(P.Lookup(engine=eng.id, request="x", keys=keys, policy=rng.choice(["all", "boundary"])))
                futs.append((f, keys if mine else None))
                what = rng.randrange(4)
                if what == 0:
                    futs.append((c.submit(P.EndSession(engine=eng.id, request="x")), None))
                elif what == 1:
                    futs.append((c.submit(P.Clear(engine=eng.id)), None))
                elif what == 2 and leases:
                    futs.append((c.submit(P.Release(engine=eng.id, lease=leases.pop())), None))
                else:
                    c.call(P.Unregister(engine=eng.id))
                    eng = Engine(c, layout=lay, chunk_tokens=2, salt="B")
            elif op == 1:
                futs.append((c.submit(P.Prefetch(engine=eng.id, keys=keys, policy="all")), None))
                if rng.random() < 0.5:
                    c.call(P.Unregister(engine=eng.id))
                    eng = Engine(c, layout=lay, chunk_tokens=2, salt="B")
            elif op == 2:
                eng.store(rng.choice(b_sets), request="st")
            elif op == 3:  # store under A's keys: refused where A holds them, else B's objects under A's keys
                keys, mine = rng.choice(a_sets), False
                prep, _ = c.call(
                    P.PrepareStore(
                        engine=eng.id,
                        request="evil",
                        keys=keys[:500],
                        objects=[(ch, g) for ch in range(500) for g in range(4)][:4000],
                    )
                )
                if prep.reservation:
                    for s in prep.slots:
                        eng.arena[s.offset : s.offset + s.length] = 0xEE
                    c.call(P.CommitStore(engine=eng.id, reservation=prep.reservation))
            elif op == 4:  # lookup own keys, check bytes, raw retrieve and release early sometimes
                res = eng.lookup(keys, policy="all", request="y")
                if res.hit_chunks and not mine:  # only B's own objects (0xEE) under A's keys, never A's bytes
                    for o in res.objects:
                        got = eng.arena[o.offset : o.offset + o.length]
                        if not (got == 0xEE).all():
                            print("!!! hostile sees bytes not its own under A's key", flush=True)
                            stats["bad"] += 1
                if res.lease:
                    if mine:
                        for o in res.objects:
                            got = eng.arena[o.offset : o.offset + o.length]
                            if not np.array_equal(got, eng.payload(keys[o.chunk], o.group, o.length)):
                                stats["bad"] += 1
                    if rng.random() < 0.5:
                        # one slice from anywhere in the lease (paged Retrieve), the lease released behind it, then
                        # the next slice asked of the released lease: the slice sent keeps its bytes, the next is
                        # refused
                        first = rng.randrange(max(1, len(res.objects)))
                        rf = c.submit(P.Retrieve(engine=eng.id, lease=res.lease, format="raw", first=first))
                        c.call(P.Release(engine=eng.id, lease=res.lease))
                        r, frames = rf.result(60)
                        stats["slices"] = stats.get("slices", 0) + 1
                        if r.next < r.total:
                            try:
                                c.call(P.Retrieve(engine=eng.id, lease=res.lease, format="raw", first=r.next))
                                print("!!! a released lease answered its next slice", flush=True)
                                stats["bad"] += 1
                            except ServerError:
                                pass
                        if mine:
                            for o, fr in zip(r.objects, frames, strict=True):
                                if bytes(fr) != eng.payload(keys[o.chunk], o.group, o.length).tobytes():
                                    stats["bad"] += 1
                                    print("!!! hostile raw wrong bytes", flush=True)
                    else:
                        leases.append(res.lease)
            elif op == 5:  # lookup of another connection's engine id / lease ids guessed
                try:
                    c.call(P.Release(engine=rng.getrandbits(63), lease=rng.getrandbits(63)))
                except ServerError:
                    pass
            elif op == 6:  # huge values everywhere
                m = rng.choice(
                    [
                        {
                            "t": "lookup",
                            "v": P.PROTOCOL_VERSION,
                            "id": 1,
                            "engine": eng.id,
                            "request": "x" * 10000,
                            "keys": keys,
                            "skip_chunks": rng.choice([2**62, 2**63 - 1, -1, 10**6]),
                        },
                        {
                            "t": "prefetch",
                            "v": P.PROTOCOL_VERSION,
                            "id": 1,
                            "engine": eng.id,
                            "keys": keys,
                            "skip_chunks": rng.choice([2**62, 2**63 - 1, NCH, NCH * 10]),
                        },
                        {"t": "retrieve", "v": P.PROTOCOL_VERSION, "id": 1, "engine": eng.id, "lease": 2**64 - 1},
                        {
                            "t": "lookup",
                            "v": P.PROTOCOL_VERSION,
                            "id": 2**64 - 1,
                            "engine": -1,
                            "request": "",
                            "keys": [b"\0" * 16] * 3,
                        },
                        *[
                            {"t": "prepare_store", "v": P.PROTOCOL_VERSION, "id": 1, "engine": eng.id,
                             "request": "p", "keys": keys[:10], "objects": objects}
                            for objects in (b"\xff" * 8 * 1000, (2**31 - 1).to_bytes(4, "little") * 2)
                        ],
                        {
                            "t": "commit_store",
                            "v": P.PROTOCOL_VERSION,
                            "id": 1,
                            "engine": eng.id,
                            "reservation": 1,
                            "fenced": True,
                        },
                    ]
                )
                raw.send(msgspec.msgpack.encode(m))
                if raw.poll(30000):
                    raw.recv_multipart()
                else:
                    print(f"!!! no answer to {str(m)[:200]}", flush=True)
            elif op == 7:  # garbage frames
                raw.send_multipart([os.urandom(rng.randrange(1, 200)) for _ in range(rng.randrange(1, 4))])
                if raw.poll(30000):
                    raw.recv_multipart()
            elif op == 8:  # pin everything under own keys and go away: SIGSTOP myself
                res = eng.lookup(rng.choice(b_sets), policy="all", request="z")
                if res.lease and rng.random() < 0.1:
                    os.kill(os.getpid(), signal.SIGSTOP)  # the parent wakes us
            elif op == 9:
                futs.append((c.submit(P.Clear(engine=eng.id)), None))
            elif op == 10:  # a second connection sharing the engine id (other connection): unknown_engine
                with CacheClient(ep, timeout_s=30) as c2:
                    try:
                        c2.call(P.Lookup(engine=eng.id, request="x", keys=keys[:10]))
                        print("!!! another connection used my engine", flush=True)
                        stats["bad"] += 1
                    except ServerError as e:
                        assert e.code == "unknown_engine", e
            elif op == 11:  # pin=false probe on A's keys
                r, _ = c.call(P.Lookup(engine=eng.id, request="p", keys=keys, pin=False))
            elif op == 12:  # two lookups of one session, one EndSession between
                f1 = c.submit(P.Lookup(engine=eng.id, request="w", keys=rng.choice(b_sets), policy="all"))
                f2 = c.submit(P.Lookup(engine=eng.id, request="w", keys=rng.choice(b_sets), policy="boundary"))
                f3 = c.submit(P.EndSession(engine=eng.id, request="w"))
                futs += [(f1, None), (f2, None), (f3, None)]
            elif op == 13:  # stats/status
                c.call(P.Status())
            # reap futures
            keep = []
            for f, k in futs:
                if f.done():
                    try:
                        r, _ = f.result()
                        if isinstance(r, P.LookupResult) and r.lease:
                            leases.append(r.lease)
                    except (ServerError, ServerTimeout) as e:
                        code = getattr(e, "code", "timeout")
                        stats["errors"][code] = stats["errors"].get(code, 0) + 1
                else:
                    keep.append((f, k))
            futs = keep
            if len(leases) > 20:
                try:
                    c.call(P.Release(engine=eng.id, lease=leases.pop(0)))
                except ServerError:
                    pass
        except (ServerError, ServerTimeout) as e:
            code = getattr(e, "code", "timeout")
            stats["errors"][code] = stats["errors"].get(code, 0) + 1
            if code == "unknown_engine":
                eng = Engine(c, layout=lay, chunk_tokens=2, salt="B")
                leases = []
            if code in ("timeout", "internal") or isinstance(e, ServerTimeout):
                print(f"!!! hostile{idx}: {type(e).__name__} {e}", flush=True)
        except Exception:
            stats["exc"] += 1
            traceback.print_exc()
    for f, _ in futs:
        try:
            f.result(60)
        except Exception:
            pass
    out.put(stats)
    c.close()


def main() -> int:
    import turns_serve
    from hybridkv.server.front.cli import parse

    d = tempfile.mkdtemp(prefix="chaos-", dir="/tmp")
    l2 = tempfile.mkdtemp(prefix="chaos-l2-", dir="/tmp")
    cfg = parse(
        [
            f"--endpoint=ipc://{d}/s.sock",
            f"--l1-gib={L1}",
            "--client-timeout=3",
            "--quarantine=1",
            "--admin",
            f"--l2-dir={l2}",
            "--l2-gib=0.05",
            "--io-threads=2",
            *(["--l1-memfd"] if os.environ.get("MEMFD") == "1" else []),
        ]
    )
    s = (
        turns_serve.start(cfg, turn_s=0, slice_objects=64)
        if os.environ.get("TURNS", "1") == "1"
        else turns_serve.start(cfg)
    )
    pid = s.proc.pid
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=honest, args=(s.endpoint, i, q)) for i in range(2)]
    hs = [ctx.Process(target=hostile, args=(s.endpoint, i, q)) for i in range(3)]
    for p in procs + hs:
        p.start()
    from hybridkv.engine.client import CacheClient
    from hybridkv.wire import protocol as P

    worst = 0.0
    t0 = time.monotonic()
    paused_server = False
    with CacheClient(s.endpoint, timeout_s=120) as obs:
        while any(p.is_alive() for p in procs + hs):
            for p in hs:  # wake stopped hostiles after a while
                try:
                    st = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    if st == "T" and random.random() < 0.1:
                        os.kill(p.pid, signal.SIGCONT)
                except (FileNotFoundError, ProcessLookupError):
                    pass
            if os.environ.get("PAUSE", "1") == "1" and not paused_server and time.monotonic() - t0 > DUR / 2:
                paused_server = True
                os.kill(pid, signal.SIGSTOP)
                time.sleep(5)
                os.kill(pid, signal.SIGCONT)
                print("server paused 5 s", flush=True)
            a = time.monotonic()
            obs.call(P.Health())
            if not (paused_server and time.monotonic() - t0 < DUR / 2 + 6):
                worst = max(worst, time.monotonic() - a)
                if time.monotonic() - a > 0.15:
                    print(
                        f"stall {time.monotonic() - a:.3f}s at t={a - t0:.1f} load {os.getloadavg()[0]:.1f}", flush=True
                    )
            if s.proc.poll() is not None:
                print("!!! SERVER DIED", s.proc.returncode)
                print(s.proc.stderr.read()[-3000:])
                return 1
            time.sleep(0.05)
        results = [q.get(timeout=5) for _ in procs + hs]
        for r in results:
            print(r)
        # settle: leases gone with their engines' timeouts, quarantine
        time.sleep(6)
        deadline = time.monotonic() + 60
        while True:
            c = obs.call(P.Stats())[0].counters
            if (
                c["parked"] == 0
                and c["workers_inflight"] == 0
                and c["l1_pinned_objects"] == 0
                and c["l1_lent_objects"] == 0
            ):
                break
            if time.monotonic() > deadline:
                print(
                    "!!! NOT SETTLED",
                    {
                        k: v
                        for k, v in c.items()
                        if "pin" in k or "lent" in k or "park" in k or "unready" in k or "engines" in k or "leases" in k
                    },
                )
                break
            time.sleep(0.2)
        print(
            {
                k: c[k]
                for k in sorted(c)
                if any(
                    w in k
                    for w in (
                        "pinned",
                        "lent",
                        "parked",
                        "unready",
                        "engines",
                        "leases",
                        "reservations",
                        "quarant",
                        "errors",
                        "namespace",
                        "stalls",
                        "l2_prefetch",
                    )
                )
            }
        )
    print(f"worst Health wait {worst * 1000:.0f} ms; server alive: {s.proc.poll() is None}")
    bad = sum(r.get("bad", 0) for r in results)
    err = s.proc.poll()
    s.close()
    return 1 if bad or err is not None else 0


if __name__ == "__main__":
    sys.exit(main())
