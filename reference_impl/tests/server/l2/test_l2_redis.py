"""RedisL2 against real redis-server processes: round trips, damage, the store's eviction, a dead store."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import rediskit
from hybridkv.server.l2.base import L2Error
from hybridkv.server.l2.fs_spec import FsL2Spec
from hybridkv.server.l2.header import HEADER_BYTES
from hybridkv.server.l2.redis_spec import RedisL2Spec
from hybridkv.server.l2.specs import L2ConfigError, parse_l2_adapter
from rediskit import key_of, payload, read_back

pytestmark = pytest.mark.skipif(rediskit.skip_reason() is not None, reason=str(rediskit.skip_reason()))

NS_A = b"namespace-a-0001"
NS_B = b"namespace-b-0002"
MB = 1 << 20


@pytest.fixture
def store():
    r = rediskit.RedisProcess()
    yield r
    r.close()


def make(store, **kw):
    from hybridkv.server.l2.redis import RedisL2

    kw.setdefault("chunk_bytes", 256 * 1024)
    return RedisL2(RedisL2Spec(url=store.url, **kw))


@pytest.mark.parametrize("size", [0, 1, 1000, 256 * 1024, 256 * 1024 + 1, 3 * MB + 17])
def test_round_trip_sizes(store, size):
    """Values below, at and above one chunk come back byte-exact, through a second adapter too."""
    data = payload(size, size)
    with make(store) as a, make(store) as b:
        a.put(key_of(1), 3, NS_A, data)
        assert a.length(key_of(1), 3) == size
        assert read_back(a, key_of(1), 3) == data
        assert read_back(b, key_of(1), 3) == data  # another server sees it: the store is shared
        assert read_back(b, key_of(1), 4) is None
        st = a.stats()
        assert st["puts"] == 1 and st["bytes_written"] == size and st["store_up"] == 1


def test_reader_with_another_chunk_size(store):
    """A value written in 256 KiB chunks is read by a server configured for 1 MiB chunks."""
    data = payload(7, 3 * MB)
    with make(store) as a, make(store, chunk_bytes=MB) as b:
        a.put(key_of(7), 0, NS_A, data)
        assert read_back(b, key_of(7), 0) == data


def test_put_is_idempotent_and_skips_what_the_store_holds(store):
    """A second put of a held object writes nothing, from this adapter or another."""
    data = payload(2, MB)
    with make(store) as a, make(store) as b:
        a.put(key_of(2), 0, NS_A, data)
        a.put(key_of(2), 0, NS_A, data)
        b.put(key_of(2), 0, NS_A, data)
        assert a.stats()["bytes_written"] == MB and b.stats()["bytes_written"] == 0
        assert b.stats()["puts"] == 1


@pytest.mark.parametrize("damage", ["payload_bit", "short_chunk", "missing_chunk", "header_bit", "meta_short"])
def test_damaged_value_is_a_miss_and_deleted(store, damage, caplog):
    """Every kind of damage is a miss (never served) and the object's keys are removed."""
    data = payload(3, MB + 5)
    r = store.client()
    with make(store) as l2:
        l2.put(key_of(3), 1, NS_A, data)
        mkey = f"hybridkv:m:{{{key_of(3).hex()}-1}}"
        dkey = f"hybridkv:d:{{{key_of(3).hex()}-1}}:2"
        if damage == "payload_bit":
            v = bytearray(r.get(dkey))
            v[100] ^= 0x10
            r.set(dkey, bytes(v))
        elif damage == "short_chunk":
            r.set(dkey, r.get(dkey)[:-1])
        elif damage == "missing_chunk":
            r.delete(dkey)
        elif damage == "header_bit":
            v = bytearray(r.get(mkey))
            v[40] ^= 1
            r.set(mkey, bytes(v))
        else:
            r.set(mkey, r.get(mkey)[:HEADER_BYTES])
        out = bytearray(MB + 5)
        with caplog.at_level(logging.WARNING, logger="hybridkv.server.l2.redis"):
            assert not l2.get_into(key_of(3), 1, memoryview(out))
        assert out != bytearray(data) or damage == "missing_chunk"
        assert "removed bad object" in caplog.text
        assert r.exists(mkey) == 0
        assert l2.stats()["corrupt_removed"] == 1
    with make(store) as fresh:
        assert fresh.length(key_of(3), 1) is None


def test_bad_header_seen_by_probe_is_removed(store):
    """A meta key with a scribbled header is a miss for length() and is deleted."""
    r = store.client()
    with make(store) as l2:
        l2.put(key_of(4), 0, NS_A, payload(4, 1000))
        mkey = f"hybridkv:m:{{{key_of(4).hex()}-0}}"
        v = bytearray(r.get(mkey))
        v[0] ^= 0xFF
        r.set(mkey, bytes(v))
    with make(store) as l2:
        assert l2.length(key_of(4), 0) is None
        assert r.exists(mkey) == 0


def test_eviction_by_the_store_is_a_miss(store):
    """Under maxmemory with allkeys-lru, evicted objects are misses, the rest byte-exact."""
    r = store.client()
    r.config_set("maxmemory", str(8 * MB))
    size = MB
    with make(store, index_ttl_s=0.0) as l2:
        for i in range(40):
            l2.put(key_of(i), 0, NS_A, payload(i, size))
        served = missed = 0
        for i in range(40):
            got = read_back(l2, key_of(i), 0)
            if got is None:
                missed += 1
            else:
                assert got == payload(i, size)
                served += 1
        assert missed >= 30 and served >= 1, (served, missed)
        assert r.info("stats")["evicted_keys"] > 0


def test_tenants_by_prefix_do_not_see_each_other(store):
    """Two prefixes on one store: neither sees, counts or clears the other's objects."""
    with make(store, prefix="tenant-a:") as a, make(store, prefix="tenant-b:") as b:
        a.put(key_of(5), 0, NS_A, payload(5, 2000))
        assert b.length(key_of(5), 0) is None and read_back(b, key_of(5), 0) is None
        b.put(key_of(6), 0, NS_B, payload(6, 2000))
        assert b.clear() == 1
        assert read_back(a, key_of(5), 0) == payload(5, 2000)


def test_clear_by_namespace(store):
    """clear(ns) drops that namespace's objects and their chunks, and leaves the others."""
    with make(store) as l2:
        for i in range(5):
            l2.put(key_of(i), 0, NS_A if i % 2 else NS_B, payload(i, 300 * 1024))
        assert l2.clear(NS_A) == 2
        assert [read_back(l2, key_of(i), 0) is not None for i in range(5)] == [True, False, True, False, True]
        assert l2.clear() == 3
        assert store.client().dbsize() == 0


def test_one_clear_walk_drops_several_namespaces_and_counts_each(store):
    """The walk the server's waiting Clears share: the objects of the namespaces named (chunks too), counted per
    namespace; the others stay; a walk of every namespace takes the rest."""
    ns_c = b"namespace-c-0003"
    spaces = [NS_A, NS_B, ns_c]

    def walked(namespaces) -> dict[bytes, int]:
        total: dict[bytes, int] = {}
        for piece in l2.clear_walk(namespaces):
            for ns, n in piece.items():
                total[ns] = total.get(ns, 0) + n
        return total

    with make(store) as l2:
        for i in range(9):
            l2.put(key_of(i), 0, spaces[i % 3], payload(i, 300 * 1024))
        assert walked(frozenset({NS_A, ns_c})) == {NS_A: 3, ns_c: 3}
        assert [read_back(l2, key_of(i), 0) for i in range(9)] == [payload(i, 300 * 1024) if i % 3 == 1 else None
                                                                   for i in range(9)]
        assert walked(None) == {NS_B: 3}
        assert store.client().dbsize() == 0


def test_a_prefix_that_extends_another_is_a_separate_tenant(store):
    """Tenants "t" and "tm:": a SCAN for "t" + "m:*" matches every key of "tm:". Neither clear of "t" (its own
    namespace, then everything) touches the other tenant's objects, nor keys that are not ours to parse."""
    with make(store, prefix="t") as t, make(store, prefix="tm:") as tm:
        for i in range(6):
            t.put(key_of(i), 0, NS_A, payload(i, 300 * 1024))
            tm.put(key_of(i), 0, NS_A, payload(i + 100, 300 * 1024))
        client = store.client()
        strangers = {b"tm:m:not-a-meta": b"x", b"tm:m:{" + key_of(1).hex().encode() + b"-0}x": b"y", b"tq": b"z"}
        client.mset(strangers)
        assert t.clear(NS_A) == 6
        assert t.clear() == 0
        assert [read_back(tm, key_of(i), 0) for i in range(6)] == [payload(i + 100, 300 * 1024) for i in range(6)]
        assert all(read_back(t, key_of(i), 0) is None for i in range(6))
        assert client.mget(list(strangers)) == list(strangers.values())
        assert tm.clear() == 6


def test_store_down_then_restarted(store, caplog):
    """A killed store is misses and failed puts (L2Error), fast and logged once; a restart heals."""
    data = payload(9, MB)
    with make(store, retry_after_s=0.2) as l2:
        l2.put(key_of(9), 0, NS_A, data)
        store.kill()
        out = bytearray(MB)
        t = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="hybridkv.server.l2.redis"):
            assert not l2.get_into(key_of(9), 0, memoryview(out))
            for i in range(200):
                assert l2.length(key_of(100 + i), 0) is None
                with pytest.raises(L2Error, match="unreachable"):
                    l2.put(key_of(100 + i), 0, NS_A, b"x" * 100)
        assert time.perf_counter() - t < 2.0  # the back-off answers without the network
        assert caplog.text.count("unreachable (") == 1
        assert l2.stats()["store_up"] == 0
        store.start()  # empty after a restart: no persistence
        deadline = time.monotonic() + 10
        while True:
            try:
                l2.put(key_of(9), 0, NS_A, data)
                break
            except L2Error:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert read_back(l2, key_of(9), 0) == data
        assert l2.stats()["store_up"] == 1


def test_store_never_up(caplog):
    """An adapter started against nothing is a working adapter whose every call is a miss."""
    from hybridkv.server.l2.redis import RedisL2

    spec = RedisL2Spec(url=f"redis://127.0.0.1:{rediskit.free_port()}/0")
    with caplog.at_level(logging.WARNING, logger="hybridkv.server.l2.redis"), RedisL2(spec) as l2:
        assert l2.length(key_of(1), 0) is None
        assert not l2.get_into(key_of(1), 0, memoryview(bytearray(10)))
        with pytest.raises(L2Error):
            l2.put(key_of(1), 0, NS_A, b"abc")
    assert "unreachable" in caplog.text


def test_concurrent_puts_and_gets(store):
    """Eight threads putting and reading overlapping objects: every read is exact or a miss."""
    errors: list[str] = []
    with make(store) as l2:
        def worker(t: int) -> None:
            for i in range(30):
                k = key_of(i % 12)
                data = payload(i % 12, 200_000)
                l2.put(k, 0, NS_A, data)
                got = read_back(l2, k, 0)
                if got is not None and got != data:
                    errors.append(f"thread {t} object {i % 12}")
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert errors == []


def test_wrong_out_size_is_the_callers_bug(store):
    with make(store) as l2:
        l2.put(key_of(1), 0, NS_A, b"x" * 100)
        assert l2.length(key_of(1), 0) == 100
        with pytest.raises(ValueError, match="out is 99 bytes"):
            l2.get_into(key_of(1), 0, memoryview(bytearray(99)))


def test_closed_adapter_raises(store):
    l2 = make(store)
    l2.close()
    l2.close()
    with pytest.raises(L2Error, match="closed"):
        l2.length(key_of(1), 0)
    assert l2.stats()["puts"] == 0


@pytest.mark.parametrize("text, error", [
    ("{", "not JSON"),
    ("[1]", "JSON object"),
    ('{"type":"s3"}', '"type" must be'),
    ('{"type":"fs","max_capacity_gb":1}', "needs \"base_path\""),
    ('{"type":"fs","base_path":"/x","max_capacity_gb":-1}', "positive number"),
    ('{"type":"redis"}', "needs \"url\""),
    ('{"type":"redis","url":"http://h:1/0"}', "redis://HOST:PORT/DB"),
    ('{"type":"redis","url":"redis://h:99999/0"}', "does not parse"),
    ('{"type":"redis","url":"redis://h:1/zero"}', "database number"),
    ('{"type":"redis","url":"redis://h:1/0","bogus":1}', "does not take \\['bogus'\\]"),
    ('{"type":"valkey","url":"redis://h:1/0","chunk_mb":0.01}', "chunk_bytes"),
])
def test_l2_adapter_json_errors_name_the_value(text, error):
    with pytest.raises(L2ConfigError, match=error):
        parse_l2_adapter(text, {})


def test_l2_adapter_json_specs():
    assert parse_l2_adapter('{"type":"fs","base_path":"/d","max_capacity_gb":2}', {}) == FsL2Spec("/d", 2 << 30)
    spec = parse_l2_adapter('{"type":"valkey","url":"redis://10.0.0.1:6379/2","prefix":"t1:","chunk_mb":4,'
                            '"max_capacity_gb":100}', {})
    assert spec == RedisL2Spec(url="redis://10.0.0.1:6379/2", prefix="t1:", chunk_bytes=4 << 20)


def test_stalled_store_costs_a_short_timeout_not_a_stall(store):
    """A store that stops answering (SIGSTOP): the loop's index query gives up after meta_timeout_s,
    then everything is a miss at once until the back-off ends; after SIGCONT it serves again."""
    import signal

    data = payload(11, 300_000)
    with make(store, timeout_s=0.5, meta_timeout_s=0.05, retry_after_s=0.3) as l2:
        l2.put(key_of(11), 0, NS_A, data)
        os.kill(store.proc.pid, signal.SIGSTOP)
        try:
            t = time.perf_counter()
            assert l2.length(key_of(12), 0) is None  # unknown: one query, timed out
            first = time.perf_counter() - t
            t = time.perf_counter()
            for i in range(100):
                assert l2.length(key_of(13 + i), 0) is None
            rest = time.perf_counter() - t
            assert not l2.get_into(key_of(11), 0, memoryview(bytearray(300_000)))
        finally:
            os.kill(store.proc.pid, signal.SIGCONT)
        assert first < 0.5 and rest < 0.2, (first, rest)
        time.sleep(0.7)  # past the back-off
        assert read_back(l2, key_of(11), 0) == data


def test_length_of_a_chunk_asks_the_store_once_for_all_its_groups(store):
    """The server asks length() group by group: after the first group the others come from the index."""
    with make(store) as a, make(store) as b:
        for g in range(4):
            a.put(key_of(20), g, NS_A, payload(g, 1000))
        b.length(key_of(99), 3)  # learns that chunks have 4 groups
        probes = b.stats()["probes"]
        assert [b.length(key_of(20), g) for g in range(4)] == [1000] * 4
        assert b.stats()["probes"] == probes + 1
        b.probe([(key_of(21), g) for g in range(4)] + [(key_of(20), 0)])
        assert b.stats()["probes"] == probes + 2
        assert [b.length(key_of(21), g) for g in range(4)] == [None] * 4  # known misses: no query
        assert b.stats()["probes"] == probes + 2


def test_foreign_value_at_our_key_is_a_miss_and_removed(store):
    """Someone else's hash at one of our data keys (WRONGTYPE on GET): a miss, the object's keys deleted."""
    r = store.client()
    with make(store) as l2:
        l2.put(key_of(30), 0, NS_A, payload(30, 600_000))
        dkey = f"hybridkv:d:{{{key_of(30).hex()}-0}}:1"
        r.delete(dkey)
        r.hset(dkey, "x", "y")
        assert not l2.get_into(key_of(30), 0, memoryview(bytearray(600_000)))
        assert r.exists(f"hybridkv:m:{{{key_of(30).hex()}-0}}") == 0
        assert l2.stats()["store_up"] == 1  # one bad key does not take the store down


def test_store_refusing_our_credentials_is_down_not_a_crash(store):
    """A store that requires a password we do not have: misses and failed puts, never an exception out."""
    store.client().config_set("requirepass", "s3cret")
    with make(store) as l2:
        assert l2.length(key_of(40), 0) is None
        assert not l2.get_into(key_of(40), 0, memoryview(bytearray(10)))
        with pytest.raises(L2Error):
            l2.put(key_of(40), 0, NS_A, b"abc")
