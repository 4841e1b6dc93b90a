"""A meta value is a claim from whoever can write the store: the Redis L2 bounds what it costs before believing it
(issue 35). A meta rewritten to a chunk size of 1 made one read send a GET per payload byte; a meta claiming a
huge payload made Clear build one key name per claimed chunk. Real redis-server processes."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
import tracemalloc

import pytest
import rediskit
from hybridkv.server.l2.header import HEADER_BYTES, ObjectHeader
from hybridkv.server.l2.redis_spec import RedisL2Spec
from rediskit import key_of, payload

pytestmark = pytest.mark.skipif(rediskit.skip_reason() is not None, reason=str(rediskit.skip_reason()))

NS_A = b"namespace-a-0001"
NS_B = b"namespace-b-0002"
MB = 1 << 20
CHUNK = 256 * 1024  # the adapters' chunk size here: a 1 MiB object is 4 data keys


@pytest.fixture
def store():
    r = rediskit.RedisProcess()
    yield r
    r.close()


def make(url: str, prefix: str = "hybridkv:", mac_key: bytes = b""):
    from hybridkv.server.l2.redis import RedisL2

    return RedisL2(RedisL2Spec(url=url, prefix=prefix, chunk_bytes=CHUNK, mac_key=mac_key))


def meta_name(key: bytes, prefix: str = "hybridkv:") -> str:
    return f"{prefix}m:{{{key.hex()}-0}}"


def data_names(client, key: bytes, prefix: str = "hybridkv:") -> list[bytes]:
    return sorted(client.scan_iter(match=f"{prefix}d:{{{key.hex()}-0}}:*", count=1000))


def gets(client) -> int:
    """GET and MGET commands the store has run so far (INFO commandstats)."""
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("get", "mget"))


@pytest.mark.parametrize("mac", [False, True], ids=["without-mac", "with-mac"])
def test_a_meta_rewritten_to_chunk_size_1_is_a_removed_miss_at_the_cost_of_one_read(store, mac):
    """Before the fix, 8 objects of 1 MiB cost 8.39 M GETs, 45 s and 2.4 GB of RSS: the reader trusted the chunk
    size and checked the MAC after the reads. Now the chunk size is checked against the range any writer may use
    before a key name is built: the read costs what a genuine one costs, and the object is a miss and removed."""
    mac_key = os.urandom(32) if mac else b""
    n = 2
    with make(store.url, mac_key=mac_key) as writer:
        for i in range(n):
            writer.put(key_of(i), 0, NS_A, payload(i, MB))
    c = store.client()
    for i in range(n):
        meta = c.get(meta_name(key_of(i)))
        c.set(meta_name(key_of(i)), meta[:HEADER_BYTES] + struct.pack("<I", 1) + meta[HEADER_BYTES + 4:])
    before = gets(c)
    out = bytearray(MB)
    with make(store.url, mac_key=mac_key) as reader:
        tracemalloc.start()
        t = time.monotonic()
        try:
            # the server asks with the length its layout expects (and may know it from its index already)
            assert not any(reader.get_into(key_of(i), 0, memoryview(out), NS_A) for i in range(n))
            took = time.monotonic() - t
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        st = reader.stats()
    sent = gets(c) - before
    assert sent <= n * (1 + MB // CHUNK), f"{sent} GETs for {n} reads of a 1 MiB object"  # a genuine read's
    assert took < 10, f"{took:.1f} s"
    assert peak < 8 * MB, f"{peak / MB:.0f} MiB allocated by {n} reads"
    assert st["misses"] == n and st["corrupt_removed"] + st["forged"] == n and st["hits"] == 0
    for i in range(n):
        assert c.exists(meta_name(key_of(i))) == 0 and data_names(c, key_of(i)) == [], "removed with its chunks"
    with make(store.url, mac_key=mac_key) as writer:  # the object can be stored and served again
        writer.put(key_of(0), 0, NS_A, payload(0, MB))
        assert writer.get_into(key_of(0), 0, memoryview(out), NS_A) and out == payload(0, MB)


def test_a_meta_naming_another_writer_s_chunk_size_costs_one_more_read_and_is_removed_whole(store):
    """A chunk size in range but not the one written: the reader reads the keys it names once (no third try), finds
    them wrong, and removes the keys of both chunk sizes."""
    with make(store.url) as writer:
        writer.put(key_of(6), 0, NS_A, payload(6, MB))
    c = store.client()
    meta = c.get(meta_name(key_of(6)))
    c.set(meta_name(key_of(6)), meta[:HEADER_BYTES] + struct.pack("<I", 64 * 1024))
    before = gets(c)
    with make(store.url) as reader:
        out = bytearray(MB)
        assert not reader.get_into(key_of(6), 0, memoryview(out), NS_A)
        assert reader.stats()["corrupt_removed"] == 1  # chunk 0 is 256 KiB, not 64
    assert gets(c) - before == (1 + MB // CHUNK) + (1 + MB // (64 * 1024))
    assert c.exists(meta_name(key_of(6))) == 0 and data_names(c, key_of(6)) == []


def test_objects_of_more_chunks_than_one_window_are_removed_and_cleared_whole(store):
    """Deleting a window at a time goes on while windows find keys: 150 chunks are three windows of 64."""
    from hybridkv.server.l2.redis import RedisL2

    c = store.client()
    with RedisL2(RedisL2Spec(url=store.url, chunk_bytes=64 * 1024)) as l2:
        for i in range(3):
            l2.put(key_of(i), 0, NS_A, payload(i, 150 * 64 * 1024 + 5))
        assert len(data_names(c, key_of(0))) == 151
        assert l2.remove(key_of(0), 0)
        assert l2.clear(NS_A) == 2
    assert c.dbsize() == 0


def test_a_meta_with_a_bad_chunk_size_is_no_length_in_the_index(store):
    """The index's probe (what `length` asks) checks the chunk size too: such an object is not held, and its meta
    is removed without reading a chunk."""
    with make(store.url) as writer:
        writer.put(key_of(5), 0, NS_A, payload(5, MB))
    c = store.client()
    meta = c.get(meta_name(key_of(5)))
    c.set(meta_name(key_of(5)), meta[:HEADER_BYTES] + struct.pack("<I", 1 << 30))  # over 512 MiB
    with make(store.url) as reader:
        assert reader.length(key_of(5), 0) is None
        assert reader.stats()["corrupt_removed"] == 1
    assert c.exists(meta_name(key_of(5))) == 0


def names(args: list[bytes]) -> int:
    """How many keys a command of SLOWLOG named (it keeps 31 arguments, then "... (N more arguments)")."""
    more = re.fullmatch(rb"\.\.\. \((\d+) more arguments\)", args[-1])
    return len(args) - 1 + (int(more[1]) - 1 if more else 0)


def plant(client, key: bytes, ns: bytes, chunks: int, cb: int, prefix: str = "hybridkv:") -> None:
    """A meta whose header checks out, claiming `chunks` chunks of `cb` bytes, and the first of its data keys."""
    hdr = ObjectHeader(ns, key, 0, chunks * cb, 0).pack()
    client.set(meta_name(key, prefix), hdr + struct.pack("<I", cb))
    client.set(f"{prefix}d:{{{key.hex()}-0}}:0", b"x" * 100)


# Run in a child process under an address-space limit: the old code's 1e9 key names would take the host's memory.
_CLEAR = r"""
import json, resource, sys, time
from hybridkv.server.l2.redis import RedisL2
from hybridkv.server.l2.redis_spec import RedisL2Spec

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
url, ns, keys = sys.argv[1], bytes.fromhex(sys.argv[2]), [bytes.fromhex(k) for k in sys.argv[3:]]
l2 = RedisL2(RedisL2Spec(url=url, chunk_bytes=256 * 1024))
l2.clear(b"namespace-z-0000")  # connections and imports warm: what follows is the clear's own
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
vm = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize:"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), hard))
base, t, res = hwm(), time.monotonic(), {}
try:
    res["removed"] = [l2.remove(k, 0) for k in keys[:1]]
    res["cleared"] = l2.clear(ns)
    res["again"] = l2.clear(ns)
except BaseException as e:
    res["error"] = f"{type(e).__name__}: {e}"[:300]
res["seconds"], res["rss_growth"] = time.monotonic() - t, hwm() - base
print(json.dumps(res))
"""


@pytest.mark.parametrize("claim", [3_000_000, 1_000_000_000])
def test_clear_of_metas_claiming_huge_payloads_stays_bounded(store, claim):
    """Before the fix a clear built one key name per claimed chunk: 3e6 chunks cost 867 MiB and stalled the store
    for 0.7 s (one UNLINK of 3e6 names); 1e9 was a MemoryError, and every later clear failed the same way. Now an
    object's chunks are deleted a window at a time, until a window finds none of them."""
    c = store.client()
    c.config_set("slowlog-log-slower-than", 0)  # every command, with its argument count
    c.config_set("slowlog-max-len", 100_000)
    with make(store.url) as l2, make(store.url, prefix="other:") as other:
        for i in range(6):
            l2.put(key_of(i), 0, NS_A if i % 2 else NS_B, payload(i, MB))
            other.put(key_of(i), 0, NS_A, payload(i, MB))
        bombs = [key_of(100 + i) for i in range(3)]
        plant(c, bombs[0], NS_A, claim, 1)             # a chunk size no writer uses
        plant(c, bombs[1], NS_A, claim, 64 * 1024)     # a valid one, a payload no store holds
        plant(c, bombs[2], NS_A, claim, 512 * MB)      # the largest chunks: a 1.6 PB claim (3e6)
    c.slowlog_reset()
    p = subprocess.run([sys.executable, "-c", _CLEAR, store.url, NS_A.hex(), *(k.hex() for k in bombs)],
                       capture_output=True, text=True, timeout=300, env={**os.environ})
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.splitlines()[-1])
    assert "error" not in res, res
    assert res["removed"] == [True] and res["cleared"] == 3 + 2 and res["again"] == 0, res
    assert res["rss_growth"] < 64 * MB, f"{res['rss_growth'] / MB:.0f} MiB"
    assert res["seconds"] < 30, res
    widest = max((names(args) for _, _, _, args, *_ in c.execute_command("SLOWLOG", "GET", 100_000)
                  if args[0].upper() in (b"UNLINK", b"DEL")), default=0)
    assert widest <= 1024, f"one command named {widest} keys: the store stalls for every other client"
    for k in bombs:
        assert c.exists(meta_name(k)) == 0 and data_names(c, k) == []
    with make(store.url) as l2, make(store.url, prefix="other:") as other:  # other namespaces and prefixes intact
        out = bytearray(MB)
        for i in range(6):
            assert l2.get_into(key_of(i), 0, memoryview(out), NS_B) == (i % 2 == 0)
            assert other.get_into(key_of(i), 0, memoryview(out), NS_A) and out == payload(i, MB)
        assert l2.clear() == 3 and other.clear() == 6
