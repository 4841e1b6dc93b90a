"""A large Clear works in turns (docs/protocol.md, Clear): on real server processes (`turns_serve.py --turn-s 0`: a
turn per piece) with a real filesystem L2, it drops every evictable object of its namespace from L1 and from disk,
leaves other namespaces' objects and pinned ones, answers other clients between its turns, and is answered
unknown_engine when its engine is unregistered while it works."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import turns_serve
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.model.keys import chunk_keys, namespace
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import ServerProcess
from hybridkv.server.l2.fs import FilesystemL2
from hybridkv.wire import protocol as P
from serverkit import counters

CT = 2
LAYOUT = ModelLayout(model="clear", groups=(
    GroupLayout(kind="attention", layer_names=("a",), page_bytes=2, block_tokens=1),
    GroupLayout(kind="attention", layer_names=("b",), page_bytes=2, block_tokens=1),
))
SIZE = 4  # an object's bytes: 2 tokens of 2 bytes
NS_A, NS_B = namespace(LAYOUT, 0, CT, "a"), namespace(LAYOUT, 0, CT, "b")


@pytest.fixture
def servers(sock_dir):
    procs: list[ServerProcess] = []

    def start(name: str, *flags: str) -> ServerProcess:
        config = parse([f"--endpoint=ipc://{sock_dir}/{name}.sock", "--l1-gib=0.7", "--client-timeout=60",
                        "--admin", *flags])
        s = turns_serve.start(config, turn_s=0.0)
        procs.append(s)
        return s

    yield start
    for s in procs:
        s.close()


def keys(ns: bytes, n: int, seed: int) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 1 << 30, (n + 1) * CT)
    return chunk_keys(ns, tokens, CT)[:n]


def store(client: CacheClient, engine: int, ks: list[bytes]) -> None:
    for i in range(0, len(ks), 1 << 14):
        part = ks[i:i + (1 << 14)]
        prep, _ = client.call(P.PrepareStore(engine=engine, request="s", keys=part,
                                             objects=[(c, g) for c in range(len(part)) for g in range(2)]))
        client.call(P.CommitStore(engine=engine, reservation=prep.reservation))


def l2_files(directory: Path, ns: bytes, ks: list[bytes]) -> None:
    l2 = FilesystemL2(directory, 1 << 30, direct_io=False)
    for k in ks:
        for g in range(2):
            l2.put(k, g, ns, bytes(SIZE))
    l2.close()



def settled(client: CacheClient) -> dict:
    """Counters once nothing is parked (a large store's lists are emptied in turns after its answer) and no worker
    is busy."""
    deadline = time.monotonic() + 60
    while (c := counters(client))["parked"] or c["workers_inflight"]:
        assert time.monotonic() < deadline, c
        time.sleep(0.01)
    return c


def answered_between_turns(watcher: CacheClient, fut) -> None:
    """Other requests are answered while the Clear is parked between its turns, before its answer."""
    deadline = time.monotonic() + 60
    while counters(watcher)["parked"] < 1:
        assert not fut.done(), "the large Clear was answered before any other request came between its turns"
        assert time.monotonic() < deadline
    watcher.call(P.Health())
    assert not fut.done()


@pytest.mark.slow  # 8 s on the 2-core VM: `nox -s tests_slow` runs it
def test_large_clear_in_turns_drops_own_evictable_objects_from_l1_and_disk(servers, tmp_path):
    l2_dir = tmp_path / "l2"
    a_l1, b_l1 = keys(NS_A, 60_000, 1), keys(NS_B, 20_000, 2)
    a_l2, b_l2 = keys(NS_A, 4_000, 3), keys(NS_B, 2_000, 4)
    l2_files(l2_dir, NS_A, a_l2)
    l2_files(l2_dir, NS_B, b_l2)
    s = servers("big", f"--l2-dir={l2_dir}", "--l2-gib=1", "--spill-watermark=0")
    with CacheClient(s.endpoint, timeout_s=120) as ca, CacheClient(s.endpoint, timeout_s=120) as cb:
        ra = ca.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt="a"))[0]
        ea, eb = ra.engine, cb.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt="b"))[0].engine
        assert ra.object_bytes == [SIZE, SIZE]
        store(ca, ea, a_l1)
        store(cb, eb, b_l1)
        pinned = ca.call(P.Lookup(engine=ea, request="p", keys=a_l1[:100], policy="all"))[0]
        assert pinned.hit_chunks == 100 and pinned.lease
        before = settled(cb)
        assert before["l1_objects"] == 160_000 and before["l2_objects"] == 12_000

        fut = ca.submit(P.Clear(engine=ea))
        answered_between_turns(cb, fut)
        done = fut.result(timeout=120)[0]
        assert done.count == 2 * (60_000 - 100) + 2 * 4_000  # every evictable one of A's, in L1 and L2

        after = settled(cb)
        assert after["l1_objects"] == 40_000 + 200 and after["l2_objects"] == 4_000
        assert ca.call(P.Lookup(engine=ea, request="q", keys=a_l1[:101], policy="all", pin=False))[0].hit_chunks \
            == 100  # the pinned chunks stay, the rest is gone
        assert cb.call(P.Lookup(engine=eb, request="q", keys=b_l1, policy="all", pin=False))[0].hit_chunks \
            == 20_000
        assert cb.call(P.Lookup(engine=eb, request="q", keys=b_l2, policy="all", pin=False))[0].hit_chunks \
            == 2_000
        ca.call(P.Release(engine=ea, lease=pinned.lease))
    s.close()
    left = FilesystemL2(l2_dir, 1 << 30, direct_io=False)  # the files on disk, indexed anew from their headers
    try:
        assert left.stats()["objects"] == 4_000
        assert all(left.length(k, g) is None for k in a_l2 for g in range(2))
        assert all(left.length(k, g, NS_B) == SIZE for k in b_l2 for g in range(2))
    finally:
        left.close()
    shutil.rmtree(l2_dir)


def test_admin_clear_of_every_namespace_in_turns_and_small_clears_in_one(servers):
    s = servers("all")
    with CacheClient(s.endpoint, timeout_s=120) as ca, CacheClient(s.endpoint, timeout_s=120) as cb:
        ea = ca.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt="a"))[0].engine
        eb = cb.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt="b"))[0].engine
        store(ca, ea, keys(NS_A, 3, 5))
        assert ca.call(P.Clear(engine=ea))[0].count == 6  # a small clear: answered in its first turn
        store(ca, ea, keys(NS_A, 15_000, 6))  # 60,000 objects in two namespaces: 234 pieces of table.PIECE, a turn each
        store(cb, eb, keys(NS_B, 15_000, 7))
        pinned = cb.call(P.Lookup(engine=eb, request="p", keys=keys(NS_B, 15_000, 7)[:10], policy="all"))[0]
        settled(cb)
        fut = ca.submit(P.Clear())
        answered_between_turns(cb, fut)
        assert fut.result(timeout=120)[0].count == 60_000 - 20
        assert counters(cb)["l1_objects"] == 20
        cb.call(P.Release(engine=eb, lease=pinned.lease))


def test_engine_unregistered_while_its_clear_works(servers):
    s = servers("gone")
    with CacheClient(s.endpoint, timeout_s=120) as ca, CacheClient(s.endpoint, timeout_s=120) as cb:
        ea = ca.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt="a"))[0].engine
        store(ca, ea, keys(NS_A, 30_000, 8))  # 60,000 objects: 234 turns
        settled(cb)
        fut = ca.submit(P.Clear(engine=ea))
        answered_between_turns(cb, fut)
        ca.call(P.Unregister(engine=ea))
        with pytest.raises(ServerError) as err:
            fut.result(timeout=120)
        assert err.value.code == "unknown_engine"
        c = settled(cb)
        assert c["l1_pinned_objects"] == 0, c
        # what it had not dropped yet stays, and a Clear of every namespace takes it
        assert cb.call(P.Clear())[0].count == c["l1_objects"]
        assert counters(cb)["l1_objects"] == 0


@pytest.mark.slow  # 11 s on the 2-core VM: `nox -s tests_slow` runs it
def test_a_flood_of_clears_holds_one_io_thread_and_clears_every_namespace(servers, tmp_path):
    """40 Clears sent at once over 8 namespaces, each with 1,500 keys x 2 groups on a filesystem L2: their L2 walks
    run one at a time (never more than one job on the I/O threads, which other clients' spills and prefetches
    need: before, each Clear queued a walk of its own, 40 at once), the Clears waiting while one walk runs share the
    next whatever their namespaces (before, a walk per namespace: 8 at least), and every namespace ends empty on
    disk, each Clear counting 0 or all of its namespace's objects."""
    l2_dir = tmp_path / "l2"
    salts = "abcdefgh"
    nss = [namespace(LAYOUT, 0, CT, s) for s in salts]
    for i, ns in enumerate(nss):
        l2_files(l2_dir, ns, keys(ns, 1_500, 10 + i))
    s = servers("flood", f"--l2-dir={l2_dir}", "--l2-gib=1", "--io-threads=2")
    with CacheClient(s.endpoint, timeout_s=120) as c, CacheClient(s.endpoint, timeout_s=120) as watcher:
        engines = [c.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt=salt))[0].engine for salt in salts]
        assert settled(watcher)["l2_objects"] == 8 * 3_000
        futs = [(i % 8, c.submit(P.Clear(engine=engines[i % 8]))) for i in range(40)]
        most = 0
        while not all(f.done() for _, f in futs):
            most = max(most, counters(watcher)["workers_inflight"])
        assert most <= 1, f"{most} jobs on the I/O threads at once"
        counts: list[list[int]] = [[] for _ in nss]
        for i, f in futs:
            counts[i].append(f.result(timeout=120)[0].count)
        for per_ns in counts:
            assert set(per_ns) <= {0, 3_000} and 3_000 in per_ns, counts
        c = settled(watcher)
        assert c["l2_objects"] == 0
        # the first Clear's walk, then one for all that came meanwhile (a third if some came after it started)
        assert 1 <= c["l2_clear_walks"] <= 3, c["l2_clear_walks"]
    s.close()
    assert not any(p.suffix == ".obj" for p in l2_dir.rglob("*"))


def test_a_clear_of_a_few_thousand_l2_files_removes_them_off_the_loop(servers, tmp_path):
    """A namespace with 3,000 objects in a filesystem L2 (and none in L1): its Clear removed their files in its own
    handler, as an index of at most 4,096 objects counted as small, holding the loop for as long as 3,000 unlinks
    take (0.1 to 0.3 s on the loaded 2-core VM; another client's Health waited up to 1 s). Now on an I/O thread:
    other clients are answered while it works, and every file is gone when it answers."""
    l2_dir = tmp_path / "l2"
    a_l2 = keys(NS_A, 1_500, 5)
    l2_files(l2_dir, NS_A, a_l2)
    s = servers("few", f"--l2-dir={l2_dir}", "--l2-gib=1")
    with CacheClient(s.endpoint, timeout_s=120) as ca, CacheClient(s.endpoint, timeout_s=120) as cb:
        ea = ca.call(P.Register(layout=LAYOUT, chunk_tokens=CT, salt="a"))[0].engine
        assert settled(cb)["l2_objects"] == 3_000
        fut = ca.submit(P.Clear(engine=ea))
        answered_between_turns(cb, fut)
        assert fut.result(timeout=120)[0].count == 3_000
        assert settled(cb)["l2_objects"] == 0
    s.close()
    assert not [p for p in l2_dir.rglob("*.obj")]
