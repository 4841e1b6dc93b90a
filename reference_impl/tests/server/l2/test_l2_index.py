"""The L2 adapters' index (`lru.LruIndex`: a sharded table in one segmented LRU queue) keeps the order, counts and
bytes one OrderedDict kept: alone under random operations, inside FilesystemL2 on real files (evictions, hits,
replacements, removes, clears and restarts, with segments of 4 so every order crosses segment boundaries), and as
RedisL2's index of known lengths against a real redis-server."""

from __future__ import annotations

import gc
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import rediskit
from hybridkv.model.keys import ObjectKey
from hybridkv.server.l2.base import L2Error
from hybridkv.server.l2.fs import FilesystemL2, _IndexEntry
from hybridkv.server.machinery import lru
from hybridkv.server.machinery.lru import LruIndex

NS_A = b"namespace-a-0001"
NS_B = b"namespace-b-0002"


def key_of(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def payload(i: int, size: int) -> bytes:
    return bytes((i * 7 + j) & 0xFF for j in range(size)) if size < 64 else (bytes([i & 0xFF]) * size)


@pytest.fixture
def small_segments(monkeypatch):
    """Segments of 4 entries (merged under 2): a few objects span many segments."""
    monkeypatch.setattr(lru, "SEGMENT", 4)
    monkeypatch.setattr(lru, "_SPARSE", 2)


def check_index(index: LruIndex, model: OrderedDict) -> None:
    """The index holds what the model holds, in its order, with its bytes; every entry linked where it sits."""
    got = list(index.values())
    assert [e.oid for e in got] == list(model)
    assert len(index) == len(model) == len(index.table) and bool(index) == bool(model)
    assert index.bytes == sum(e.size for e in got)
    assert all(index.get(oid) is e and oid in index for oid, e in zip(model, got, strict=True))
    segs = index.queue.segs
    assert all(e.queue is index.queue and any(e.seg is s for s in index.queue.segments()) for e in got)
    assert not any(gc.is_tracked(s) for s in index.queue.segments())
    assert not any(gc.is_tracked(s) for s in index.table._all_shards())
    assert all(segs[i] for i in range(len(segs) - 1)), "an empty segment other than the youngest"
    assert len(segs) <= 2 * len(model) // lru.SEGMENT + 3


@pytest.mark.parametrize("seed", range(4))
def test_the_index_keeps_the_order_of_one_ordered_dict(small_segments, seed):
    """20,000 random puts (new and in place of a held entry), hits, pops and evictions of the oldest, and now and
    then a clear, keep exactly what one OrderedDict keeps; an entry that leaves is unlinked."""
    rng = random.Random(seed)
    index: LruIndex[_IndexEntry] = LruIndex()
    model: OrderedDict[ObjectKey, _IndexEntry] = OrderedDict()
    oids = [(key_of(i), i % 3) for i in range(300)]
    for step in range(20_000):
        oid, r = rng.choice(oids), rng.random()
        e = index.get(oid)
        assert e is model.get(oid)
        if r < 0.45:
            new = _IndexEntry(oid, rng.randrange(1, 100), NS_A, step)
            old = index.put(new)
            assert old is model.pop(oid, None)
            model[oid] = new
        elif r < 0.7 and e is not None:
            index.touch(e)
            model.move_to_end(oid)
        elif r < 0.85:
            old = index.pop(oid)
            assert old is model.pop(oid, None)
        elif model:
            old = index.pop_oldest()
            assert old is model.popitem(last=False)[1]
        elif r < 0.95:
            with pytest.raises(KeyError):
                index.pop_oldest()
        if r < 0.85 and e is not None and e is not index.get(oid):
            assert e.seg is None and e.queue is None  # left the index: no link back to it
        if r > 0.9995:
            held = list(model.values())
            index.clear()
            model.clear()
            assert all(not x.seg for x in held)  # emptied: nothing links back to an entry
        if step % 101 == 0 or step > 19_950:
            check_index(index, model)


# ---- FilesystemL2 on real files ----

class FsModel:
    """What FilesystemL2 keeps, as one OrderedDict (least recently used first): oid -> (namespace, size)."""

    def __init__(self, capacity: int, disk_bytes) -> None:
        self.capacity, self.disk_bytes = capacity, disk_bytes
        self.d: OrderedDict[ObjectKey, tuple[bytes, int]] = OrderedDict()

    def disk(self) -> int:
        return sum(self.disk_bytes(size) for _, size in self.d.values())

    def put(self, oid: ObjectKey, ns: bytes, size: int) -> list[ObjectKey]:
        """The victims, oldest first."""
        held = self.d.get(oid)
        if held is not None and held[0] != ns:
            raise L2Error("another namespace")
        if held is not None and held[1] == size:
            self.d.move_to_end(oid)
            return []
        victims = []
        while self.d and self.disk() + self.disk_bytes(size) > self.capacity:
            victims.append(self.d.popitem(last=False)[0])
        self.d.pop(oid, None)
        self.d[oid] = (ns, size)
        return victims

    def fit(self, capacity: int) -> None:
        """A restart with `capacity`: the oldest go until the rest fits."""
        self.capacity = capacity
        while self.disk() > capacity:
            self.d.popitem(last=False)


def fs_files(root: Path) -> set[ObjectKey]:
    out = set()
    for sub in root.iterdir():
        if sub.is_dir():
            for f in sub.iterdir():
                if f.name.endswith(".obj"):
                    k, g = f.name[:-4].split("-")
                    out.add((bytes.fromhex(k), int(g)))
    return out


def check_fs(l2: FilesystemL2, model: FsModel, files: bool = True) -> None:
    assert [e.oid for e in l2._index.values()] == list(model.d)
    assert [(e.ns, e.size) for e in l2._index.values()] == list(model.d.values())
    s = l2.stats()
    assert s["objects"] == len(model.d) and s["bytes"] == sum(size for _, size in model.d.values())
    assert s["disk_bytes"] == model.disk() <= model.capacity
    if files:
        assert fs_files(l2.directory) == set(model.d)


def get(l2: FilesystemL2, oid: ObjectKey, size: int, ns: bytes | None = None) -> bool:
    out = np.empty(size, dtype=np.uint8)
    return l2.get_into(*oid, memoryview(out), ns)


@pytest.mark.parametrize("seed", range(3))
def test_filesystem_l2_keeps_the_order_counts_and_files_of_one_ordered_dict(small_segments, tmp_path, seed):
    """On real files, with segments of 4 entries: random puts (new, the same again, a new size, another
    namespace's), hits, misses, touches, removes and clears by namespace keep what one OrderedDict model keeps
    (order, bytes, disk bytes, the files); every restart rebuilds the same order from the files' mtimes, and a
    restart with less capacity evicts the oldest."""
    rng = random.Random(seed)
    sizes = [1, 1000, 5000, 9000]
    l2 = FilesystemL2(tmp_path, 1)  # only to learn the directory's block rounding
    disk_bytes = l2._dir.disk_bytes
    l2.close()
    capacity = 20 * disk_bytes(5000)
    l2 = FilesystemL2(tmp_path, capacity)
    model = FsModel(capacity, disk_bytes)
    oids = [(key_of(i), i % 2) for i in range(60)]
    try:
        for step in range(700):
            oid, r = rng.choice(oids), rng.random()
            held = model.d.get(oid)
            if r < 0.45:
                ns, size = (held[0], held[1] if rng.random() < 0.3 else rng.choice(sizes)) if held else \
                    (rng.choice([NS_A, NS_B]), rng.choice(sizes))
                if rng.random() < 0.05:
                    ns = NS_B if ns == NS_A else NS_A  # another namespace's object at this key: refused if held
                try:
                    model.put(oid, ns, size)
                except L2Error:
                    with pytest.raises(L2Error, match="another namespace"):
                        l2.put(*oid, ns, payload(step, size))
                else:
                    l2.put(*oid, ns, payload(step, size))
            elif r < 0.7:
                ns = rng.choice([None, NS_A, NS_B])
                hit = held is not None and (ns is None or held[0] == ns)
                assert get(l2, oid, held[1] if held else 1, ns) is hit
                if hit:
                    model.d.move_to_end(oid)
            elif r < 0.8:
                l2.touch(*oid)
                if held:
                    model.d.move_to_end(oid)
            elif r < 0.95:
                assert l2.remove(*oid) is (model.d.pop(oid, None) is not None)
            elif r < 0.97:
                ns = rng.choice([NS_A, NS_B])
                gone = [o for o, (n, _) in model.d.items() if n == ns]
                assert l2.clear(ns) == len(gone)
                for o in gone:
                    del model.d[o]
            else:
                l2.close()
                l2 = FilesystemL2(tmp_path, capacity)  # the rebuilt order is the order it had
            check_fs(l2, model, files=step % 10 == 0)
        check_fs(l2, model)
        l2.close()
        smaller = capacity // 3
        model.fit(smaller)
        l2 = FilesystemL2(tmp_path, smaller)
        check_fs(l2, model)
    finally:
        l2.close()


@pytest.mark.parametrize("reopen", [False, True], ids=["running", "restarted"])
def test_eviction_order_crosses_segment_boundaries(small_segments, tmp_path, reopen):
    """20 objects in 5 segments of 4; hits in three of them move those to the young end, and the next 20 puts
    evict the rest oldest first, then the hit ones in the order of their hits; the same after a restart, which
    rebuilds that order from the files."""
    l2 = FilesystemL2(tmp_path, 1)
    capacity = 20 * l2._dir.disk_bytes(100)
    l2.close()
    l2 = FilesystemL2(tmp_path, capacity)
    try:
        for i in range(20):
            l2.put(key_of(i), 0, NS_A, payload(i, 100))
        assert [len(s) for s in l2._index.queue.segs] == [4, 4, 4, 4, 4]
        assert get(l2, (key_of(9), 0), 100)
        l2.touch(key_of(1), 0)
        assert get(l2, (key_of(14), 0), 100)
        l2.put(key_of(6), 0, NS_A, payload(6, 100))  # held with this size: a hit, nothing written
        if reopen:
            l2.close()
            l2 = FilesystemL2(tmp_path, capacity)
        want = [i for i in range(20) if i not in (9, 1, 14, 6)] + [9, 1, 14, 6]
        evicted = []
        for j in range(20, 40):
            l2.put(key_of(j), 0, NS_A, payload(j, 100))
            gone = [i for i in range(20) if i not in evicted and not l2.contains(key_of(i), 0)]
            assert len(gone) == 1, (j, gone)
            evicted += gone
            assert not (tmp_path / key_of(gone[0]).hex()[:2] / f"{key_of(gone[0]).hex()}-0.obj").exists()
        assert evicted == want
        assert l2.stats()["evictions"] == 20 and l2.stats()["objects"] == 20
    finally:
        l2.close()


# ---- RedisL2's index of known lengths ----

@pytest.mark.skipif(rediskit.skip_reason() is not None, reason=str(rediskit.skip_reason()))
def test_redis_known_lengths_forget_the_oldest_across_segments(small_segments, monkeypatch):
    """RedisL2 keeps at most _MAX_INDEX known lengths (here 10, in segments of 4) and forgets the oldest; stats
    count the objects known to be held and their bytes without walking the index; a clear forgets all."""
    from hybridkv.server.l2 import redis as redis_l2
    from hybridkv.server.l2.redis_spec import RedisL2Spec

    monkeypatch.setattr(redis_l2, "_MAX_INDEX", 10)
    store = rediskit.RedisProcess()
    l2 = redis_l2.RedisL2(RedisL2Spec(url=store.url, chunk_bytes=64 * 1024))
    try:
        for i in range(15):
            l2.put(key_of(i), 0, NS_A, payload(i, 100 + i))
        assert [e.oid for e in l2._known.values()] == [(key_of(i), 0) for i in range(5, 15)]
        assert l2.stats()["objects"] == 10 and l2.stats()["bytes"] == sum(100 + i for i in range(5, 15))
        assert l2.length(key_of(99), 0) is None  # known to be missing: in the index, not counted
        assert l2.stats()["objects"] == 9 and l2.stats()["bytes"] == sum(100 + i for i in range(6, 15))
        probes = l2.stats()["probes"]
        assert l2.length(key_of(0), 0) == 100  # forgotten: asked again, and known at the young end
        assert l2.stats()["probes"] == probes + 1 and (key_of(0), 0) in l2._known
        assert l2.length(key_of(0), 0) == 100 and l2.stats()["probes"] == probes + 1
        assert l2.remove(key_of(14), 0) and l2.length(key_of(14), 0) is None
        model = {o: e.length for o, e in ((e.oid, e) for e in l2._known.values())}
        assert l2.stats()["objects"] == sum(v is not None for v in model.values())
        assert l2.stats()["bytes"] == sum(v or 0 for v in model.values())
        entries = list(l2._known.values())
        assert l2.clear() == 14
        assert l2.stats()["objects"] == 0 == l2.stats()["bytes"] and not l2._known
        assert all(not e.seg for e in entries)
    finally:
        l2.close()
        store.close()


def test_entries_are_untracked_and_go_with_their_index(small_segments, tmp_path):
    """The collector does not walk L2 entries (gc=False) nor the segments and shards that hold them (plain dicts
    of untracked entries), so nothing but emptying frees a segment they link to: an index that is dropped (its
    adapter closed and gone) empties its segments and leaves its queue none, so an entry held elsewhere links only
    to its own, empty, segment and a queue with no segments, and reaches no other entry."""
    l2 = FilesystemL2(tmp_path, 1 << 20)
    for i in range(10):
        l2.put(key_of(i), 0, NS_A, payload(i, 10))
    e = l2._index.get((key_of(0), 0))
    assert e is not None and not gc.is_tracked(e) and "seg" not in repr(e) and "gen=" in repr(e)
    queue = l2._index.queue
    assert len(queue.segs) >= 3 and not any(gc.is_tracked(s) for s in queue.segments())
    del queue
    l2.close()
    del l2
    gc.collect()
    assert e.seg is not None and not e.seg and e.queue is not None
    assert not e.queue.segs and not e.queue.front and e.seg is not e.queue.front
