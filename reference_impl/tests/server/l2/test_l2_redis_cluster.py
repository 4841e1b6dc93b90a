"""RedisL2 on a real 3-node Redis Cluster made by `redis-cli --cluster create` on loopback (issue 23): objects
spread over every node, each object's keys in one slot, a slot migrated under us (ASK, then MOVED), a clear of
one namespace on every node; and, slow, a resharding by redis-cli mid-run, a node killed, AUTH on the cluster."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time

import pytest
import rediskit
from hybridkv.server.l2.base import L2Error
from hybridkv.server.l2.header import HEADER_BYTES, ObjectHeader
from hybridkv.server.l2.redis_cluster import key_slot
from hybridkv.server.l2.redis_meta import MetaCodec
from hybridkv.server.l2.redis_spec import RedisL2Spec
from hybridkv.server.l2.specs import L2ConfigError, parse_l2_adapter
from rediskit import key_of, payload, read_back

NS_A = b"namespace-a-0001"
NS_B = b"namespace-b-0002"
CHUNK = 64 * 1024
SIZE = 5 * CHUNK + 123  # six data keys and a meta: an object of several keys, all in one slot
needs_cluster = pytest.mark.skipif(rediskit.cluster_skip_reason() is not None,
                                   reason=str(rediskit.cluster_skip_reason()))


def make(cluster, **kw):
    from hybridkv.server.l2.redis import RedisL2

    kw.setdefault("chunk_bytes", CHUNK)
    return RedisL2(RedisL2Spec(url=cluster.url, **kw))


def our_keys(node, prefix: str = "hybridkv:") -> list[bytes]:
    """Every key under `prefix` that this node holds (SCAN sees only its own slots)."""
    return list(node.client().scan_iter(match=prefix.encode() + b"*", count=1000))


@pytest.fixture(scope="module")
def cluster():
    c = rediskit.started_cluster()
    yield c
    c.close()


@pytest.fixture
def empty(cluster):
    for r in cluster.nodes:
        r.client().flushall()
    return cluster


# ---- without a cluster: slots, names, the spec ----

def test_key_slot_is_the_clusters_crc16_of_the_hash_tag():
    """The vectors of the Redis Cluster spec: CRC16 XMODEM, and the tag's first-{-to-next-} rule."""
    assert key_slot("123456789") == 0x31C3 % 16384
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers") == key_slot("user1000")
    assert key_slot("foo{}{bar}") == key_slot(b"foo{}{bar}")  # an empty tag: the whole key is hashed
    assert key_slot("foo{}{bar}") != key_slot("bar")
    assert key_slot("foo{{bar}}zap") == key_slot("{bar")
    assert key_slot("foo{bar}{zap}") == key_slot("bar")


def test_every_key_of_an_object_shares_its_slot():
    codec = MetaCodec("tenant-a:", b"")
    for i in range(50):
        names = [codec.meta_key(key_of(i), i % 3), *codec.data_keys(key_of(i), i % 3, 40 * CHUNK, CHUNK)]
        assert len({key_slot(n) for n in names}) == 1, names
    assert len({key_slot(codec.meta_key(key_of(i), 0)) for i in range(200)}) > 150  # and objects spread


@pytest.mark.parametrize("url, extra, says", [
    ("redis+cluster://", {}, "has no host"),
    ("redis+cluster://h1:7000,", {}, "has no host"),
    ("redis+cluster://h1:7000,h2:99999", {}, "does not parse"),
    ("redis+cluster://h1:7000/2", {}, "database 0 only"),
    ("redis+cluster://hkv:s3cret@h1:7000", {}, "carries a user or password"),
    ("redis+cluster://h1:7000", {"tls_ca_file": "/ca.crt"}, "needs a rediss://"),
    ("redis+cluster://h1:7000", {"prefix": "t{a}:"}, "hash tag"),
    ("redis://h1:7000", {"prefix": "t{"}, "hash tag"),
])
def test_cluster_url_errors_name_the_value(url, extra, says):
    with pytest.raises(L2ConfigError, match=says) as ei:
        parse_l2_adapter(json.dumps({"type": "redis", "url": url, **extra}), {})
    assert "\n" not in str(ei.value) and "s3cret" not in str(ei.value)


def test_cluster_url_seeds():
    spec = parse_l2_adapter('{"type":"valkey","url":"valkeys+cluster://10.0.0.1:7000,[::1]:7001,h3/0"}', {})
    assert spec.cluster and spec.tls and spec.seeds == (("10.0.0.1", 7000), ("::1", 7001), ("h3", 6379))
    assert not RedisL2Spec("redis://h:1/0").cluster
    assert RedisL2Spec("redis+cluster://h:1").describe().startswith("redis cluster ")


@pytest.mark.skipif(rediskit.skip_reason() is not None, reason=str(rediskit.skip_reason()))
def test_a_cluster_url_at_a_plain_server_or_at_nothing_is_a_store_that_is_down(caplog):
    """No node answers CLUSTER SLOTS (a server without cluster support, a port nobody listens on): misses and
    failed puts, said in the log, never an exception out of a read."""
    from hybridkv.server.l2.redis import RedisL2

    plain = rediskit.RedisProcess()
    try:
        for url in (f"redis+cluster://127.0.0.1:{plain.port}", f"redis+cluster://127.0.0.1:{rediskit.free_port()}"):
            with caplog.at_level(logging.WARNING, logger="hybridkv.server.l2.redis"), \
                    RedisL2(RedisL2Spec(url=url)) as l2:
                assert l2.length(key_of(1), 0) is None
                assert not l2.get_into(key_of(1), 0, memoryview(bytearray(10)))
                with pytest.raises(L2Error, match="unreachable"):
                    l2.put(key_of(1), 0, NS_A, b"abc")
                assert l2.stats()["store_up"] == 0
        assert "cluster support disabled" in caplog.text and "no cluster node answers CLUSTER SLOTS" in caplog.text
    finally:
        plain.close()


# ---- on a 3-node cluster ----

@needs_cluster
def test_objects_spread_over_every_node_and_come_back_byte_exact(empty):
    """60 objects through one adapter: every node holds some, every object's keys sit on one node, a second
    adapter (another host) reads each back byte-exact, and our slots are the cluster's CLUSTER KEYSLOT."""
    with make(empty) as a, make(empty) as b:
        for i in range(60):
            a.put(key_of(i), i % 2, NS_A, payload(i, SIZE))
        for i in range(60):
            assert read_back(b, key_of(i), i % 2) == payload(i, SIZE), i
        per_node = [our_keys(r) for r in empty.nodes]
        assert all(len(k) >= 7 * 5 for k in per_node), [len(k) for k in per_node]
        assert sum(len(k) for k in per_node) == 60 * 7
        codec = MetaCodec("hybridkv:", b"")
        for i in (0, 7, 33):
            names = [codec.meta_key(key_of(i), i % 2), *codec.data_keys(key_of(i), i % 2, SIZE, CHUNK)]
            holders = [n for n, keys in enumerate(per_node) if names[0].encode() in keys]
            assert len(holders) == 1 and all(n.encode() in per_node[holders[0]] for n in names)
            assert empty.nodes[0].client().execute_command("CLUSTER", "KEYSLOT", names[0]) == key_slot(names[0])
        st = b.stats()
        assert st["cluster_nodes"] == 3 and st["cluster_nodes_up"] == 3 and st["store_up"] == 1


def same_slot_key(slot: int, start: int) -> bytes:
    """An object key whose group-0 keys hash to `slot`."""
    codec = MetaCodec("hybridkv:", b"")
    return next(key_of(i) for i in range(start, start + 1 << 22) if key_slot(codec.meta_key(key_of(i), 0)) == slot)


@needs_cluster
def test_a_slot_migrated_under_us_is_followed_by_ask_then_moved(empty):
    """SETSLOT MIGRATING/IMPORTING, then MIGRATE of half an object's keys: a read finds each key on its side
    (ASK for the moved ones), a put of a new object in that slot lands on the target; after SETSLOT NODE every
    read is MOVED to the new owner once. Never a wrong byte."""
    codec = MetaCodec("hybridkv:", b"")
    k = key_of(1)
    slot = key_slot(codec.meta_key(k, 0))
    src = empty.owner(slot)
    dst = next(r for r in empty.nodes if r is not src)
    src_id, dst_id = empty.node_id(src), empty.node_id(dst)
    with make(empty) as l2:
        l2.put(k, 0, NS_A, payload(1, SIZE))
        names = [codec.meta_key(k, 0), *codec.data_keys(k, 0, SIZE, CHUNK)]
        dst.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        src.client().execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *names[::2])
        with make(empty) as fresh:  # no index: it reads the store
            assert read_back(fresh, k, 0) == payload(1, SIZE)
            assert fresh.stats()["cluster_asked"] >= len(names[::2])
            k2 = same_slot_key(slot, 1000)
            fresh.put(k2, 0, NS_B, payload(2, SIZE))  # new keys in a migrating slot: ASK, onto the target
            assert dst.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == len(names[::2]) + 7
            assert read_back(fresh, k2, 0) == payload(2, SIZE)
        rest = src.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        src.client().execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *rest)
        for r in (dst, src, *(n for n in empty.nodes if n not in (src, dst))):
            r.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        l2.remove(key_of(999), 0)  # anything, so that l2 meets the move on a key it did not index
        for kk, i in ((k, 1), (k2, 2)):
            out = bytearray(SIZE)
            assert l2.get_into(kk, 0, memoryview(out)) and bytes(out) == payload(i, SIZE)
        assert l2.stats()["cluster_moved"] >= 1
        assert empty.owner(slot) is dst and src.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    empty.wait_agree()  # the next tests (a resharding) want a cluster whose nodes agree


@needs_cluster
def test_clear_of_one_namespace_removes_only_its_keys_on_every_node(empty):
    """clear(NS_A) visits every primary: NS_A's keys are gone from all three nodes, NS_B's and another tenant's
    (whose prefix extends ours) stay, byte-exact."""
    with make(empty, prefix="t") as t, make(empty, prefix="tm:") as tm:
        for i in range(45):
            t.put(key_of(i), 0, NS_A if i % 3 else NS_B, payload(i, 2 * CHUNK))
            tm.put(key_of(i), 0, NS_A, payload(i + 100, 2 * CHUNK))
        def t_keys(r) -> list[bytes]:  # tenant t's names: "t" + "m:{" / "d:{"; tm's are "tm:m:{" / "tm:d:{"
            return [n for n in our_keys(r, "t") if n.startswith((b"tm:{", b"td:{"))]
        assert all(t_keys(r) for r in empty.nodes)
        assert t.clear(NS_A) == 30
        for r in empty.nodes:
            assert len(our_keys(r, "tm:")) - len(t_keys(r)) > 0, f"node {r.port} lost tenant tm:'s objects"
            for name in t_keys(r):
                if name.startswith(b"tm:{"):
                    assert ObjectHeader.unpack(r.client().get(name)[:HEADER_BYTES]).ns == NS_B
        assert sum(len(t_keys(r)) for r in empty.nodes) == 15 * 3
        assert [read_back(t, key_of(i), 0) for i in range(0, 45, 3)] == [payload(i, 2 * CHUNK) for i in range(0, 45, 3)]
        assert all(read_back(tm, key_of(i), 0) == payload(i + 100, 2 * CHUNK) for i in range(45))
        assert t.clear() == 15 and tm.clear() == 45
        assert sum(r.client().dbsize() for r in empty.nodes) == 0


@needs_cluster
def test_clear_of_metas_claiming_huge_payloads_deletes_what_exists_on_the_owning_node(empty):
    """A meta claiming 3e6 chunks costs a clear one window of names on its node (not 3e6 single-key commands), and
    an object of more chunks than one window is deleted whole, window after window (issue 35)."""
    codec = MetaCodec("hybridkv:", b"")
    with make(empty) as l2:
        l2.put(key_of(1), 0, NS_A, payload(1, 150 * CHUNK + 1))  # 151 data keys: three windows of 64
        l2.put(key_of(2), 0, NS_B, payload(2, SIZE))
        bomb = key_of(3)
        node = empty.owner(key_slot(codec.meta_key(bomb, 0))).client()
        node.set(codec.meta_key(bomb, 0), ObjectHeader(NS_A, bomb, 0, 3 * 10**6 * CHUNK, 0).pack()
                 + CHUNK.to_bytes(4, "little"))
        node.set(f"{codec.data_base(bomb, 0)}0", b"x")
        t = time.monotonic()
        assert l2.clear(NS_A) == 2
        assert time.monotonic() - t < 10
        left = [n for r in empty.nodes for n in our_keys(r)]
        assert len(left) == 1 + 6 and all(b"{" + key_of(2).hex().encode() in n for n in left), left
        assert read_back(l2, key_of(2), 0) == payload(2, SIZE)


# ---- slow: a resharding, a node killed, AUTH ----

@needs_cluster
@pytest.mark.slow
def test_resharding_by_redis_cli_mid_run_is_followed(empty):
    """`redis-cli --cluster reshard` moves 3000 slots from one node to another while four threads put and read
    objects: every read is byte-exact or a miss, and afterwards every object is a hit."""
    src, dst = empty.nodes[0], empty.nodes[1]
    errors: list[str] = []
    stop = threading.Event()
    with make(empty, index_ttl_s=0.0, miss_ttl_s=0.0) as l2:
        for i in range(120):
            l2.put(key_of(i), 0, NS_A, payload(i, SIZE))

        def worker(t: int) -> None:
            n = 0
            while not stop.is_set():
                i = (n * 7 + t * 31) % 160
                n += 1
                try:
                    if i >= 120:
                        l2.put(key_of(i), 0, NS_A, payload(i, SIZE))
                    got = read_back(l2, key_of(i), 0)
                except L2Error as e:
                    errors.append(f"thread {t}: {e}")
                    continue
                if got is not None and got != payload(i, SIZE):
                    errors.append(f"thread {t}: wrong bytes for object {i}")
        empty.wait_agree()
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        before = len(our_keys(dst))
        try:
            empty.cli("--cluster", "reshard", f"127.0.0.1:{src.port}", "--cluster-from", empty.node_id(src),
                      "--cluster-to", empty.node_id(dst), "--cluster-slots", "3000", "--cluster-yes")
            time.sleep(0.5)
        finally:
            stop.set()
            for th in threads:
                th.join()
        assert [e for e in errors if "wrong bytes" in e] == []
        assert len(our_keys(dst)) > before
        st = l2.stats()
        assert st["cluster_moved"] + st["cluster_asked"] > 0, st
        # every object is a hit once no node is in a back-off (on a loaded machine a read during the resharding
        # may time out, and its node's slots are then misses for 0.5 s or more): a miss meanwhile, never wrong bytes
        deadline = time.monotonic() + 20
        for i in range(160):
            while (got := read_back(l2, key_of(i), 0)) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert got == payload(i, SIZE), (i, None if got is None else "wrong bytes")


@needs_cluster
@pytest.mark.slow
def test_a_node_killed_is_misses_for_its_objects_only(caplog):
    """SIGKILL one primary: its objects are misses (fast, after one failure), puts to its slots raise L2Error,
    the other nodes' objects are hits byte-exact and their puts work; the store as a whole stays up. Then
    CLUSTERDOWN (full coverage required) is misses only, and the node restarted serves again."""
    c = rediskit.RedisCluster()
    try:
        codec = MetaCodec("hybridkv:", b"")
        with make(c, retry_after_s=0.2, index_ttl_s=0.0, miss_ttl_s=0.0) as l2:
            for i in range(45):
                l2.put(key_of(i), 0, NS_A, payload(i, SIZE))
            victim = c.nodes[2]
            on_victim = {i for i in range(45) if c.owner(key_slot(codec.meta_key(key_of(i), 0))) is victim}
            assert 5 < len(on_victim) < 40
            victim.kill()
            t = time.perf_counter()
            for rounds in range(3):
                for i in range(45):
                    got = read_back(l2, key_of(i), 0)
                    assert got == (None if i in on_victim else payload(i, SIZE)), (rounds, i)
            assert time.perf_counter() - t < 5
            for i in range(45, 90):
                if c.owner(key_slot(codec.meta_key(key_of(i), 0))) is victim:
                    with pytest.raises(L2Error):
                        l2.put(key_of(i), 0, NS_A, payload(i, SIZE))
                else:
                    l2.put(key_of(i), 0, NS_A, payload(i, SIZE))
                    assert read_back(l2, key_of(i), 0) == payload(i, SIZE)
            # `cluster_nodes_up` counts nodes outside a back-off, and a back-off ends on its own (0.2 s doubling):
            # read the stats right after a read that, past the back-off, retried the victim and failed again.
            a_victim_key = key_of(min(on_victim))
            deadline = time.monotonic() + 10
            while True:
                assert read_back(l2, a_victim_key, 0) is None
                st = l2.stats()
                if st["cluster_nodes_up"] == 2:
                    break
                assert time.monotonic() < deadline, st
            assert st["store_up"] == 1 and st["cluster_nodes"] == 3, st

            # A cluster that wants every slot covered refuses all commands now (CLUSTERDOWN): every read a miss,
            # none an exception; the node restarted (empty, same slots) makes the cluster whole and serving again.
            survivors = [r for r in c.nodes if r is not victim]
            for r in survivors:
                r.client().config_set("cluster-require-full-coverage", "yes")
            c.wait_down(survivors)
            with caplog.at_level(logging.WARNING, logger="hybridkv.server.l2.redis"):
                assert all(read_back(l2, key_of(i), 0) is None for i in range(45))
            assert "CLUSTERDOWN" in caplog.text
            victim.start()
            c.wait_ok()
            deadline = time.monotonic() + 20
            while read_back(l2, key_of(next(i for i in range(45) if i not in on_victim)), 0) is None:
                assert time.monotonic() < deadline, "the cluster never served again"
                time.sleep(0.1)
            for i in range(45):
                assert read_back(l2, key_of(i), 0) == (None if i in on_victim else payload(i, SIZE)), i
    finally:
        c.close()


@needs_cluster
@pytest.mark.slow
def test_a_primary_lost_to_its_replica_serves_again_after_the_failover():
    """3 primaries with a replica each: SIGKILL a primary; once its replica has taken its slots over, the
    adapter finds them in the map and every object is a hit again, byte-exact (misses meanwhile, never wrong)."""
    c = rediskit.RedisCluster(n=6, replicas=1)
    try:
        codec = MetaCodec("hybridkv:", b"")
        with make(c, retry_after_s=0.1, index_ttl_s=0.0, miss_ttl_s=0.0) as l2:
            for i in range(30):
                l2.put(key_of(i), 0, NS_A, payload(i, SIZE))
            deadline = time.monotonic() + 10
            while sum(r.client().dbsize() for r in c.nodes) < 2 * 30 * 7:  # every key on its replica too
                assert time.monotonic() < deadline
                time.sleep(0.05)
            victim = next(r for r in c.primaries() if r is not c.nodes[0])
            mine = [i for i in range(30) if c.owner(key_slot(codec.meta_key(key_of(i), 0))) is victim]
            assert mine
            victim.kill()
            deadline = time.monotonic() + 20
            while True:
                got = [read_back(l2, key_of(i), 0) for i in mine]
                assert all(g is None or g == payload(i, SIZE) for g, i in zip(got, mine, strict=True))
                if all(g is not None for g in got):
                    break
                assert time.monotonic() < deadline, "the replica never served the lost primary's objects"
                time.sleep(0.1)
            assert all(read_back(l2, key_of(i), 0) == payload(i, SIZE) for i in range(30))
            assert l2.stats()["cluster_nodes"] == 3
    finally:
        c.close()


@needs_cluster
@pytest.mark.slow
def test_auth_on_the_cluster(tmp_path):
    """requirepass + masterauth on every node: the password from a file reaches every node (objects spread over
    all three); without it the cluster refuses us, which is a store that is down."""
    c = rediskit.RedisCluster(password="cluster-s3cret")
    try:
        pw = tmp_path / "pw"
        pw.write_bytes(b"cluster-s3cret\n")
        pw.chmod(0o600)
        spec = {"type": "redis", "url": c.url, "chunk_mb": CHUNK / (1 << 20)}
        from hybridkv.server.l2.redis import RedisL2

        with RedisL2(parse_l2_adapter(json.dumps({**spec, "password_file": str(pw)}), {})) as l2:
            for i in range(30):
                l2.put(key_of(i), 0, NS_A, payload(i, SIZE))
            assert all(read_back(l2, key_of(i), 0) == payload(i, SIZE) for i in range(30))
            assert all(len(our_keys(r)) > 0 for r in c.nodes)
        with RedisL2(parse_l2_adapter(json.dumps(spec), {})) as stranger:
            assert read_back(stranger, key_of(1), 0) is None
            with pytest.raises(L2Error):
                stranger.put(key_of(100), 0, NS_A, b"x" * 100)
            assert stranger.stats()["store_up"] == 0
    finally:
        c.close()


@needs_cluster
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificates")
def test_tls_on_the_cluster(tmp_path):
    """A cluster that speaks only TLS, between its nodes too, and asks clients for certificates: rediss+cluster://
    with our certificate reaches every node (the map names their TLS ports); without one it is a store that is
    down."""
    certs = rediskit.make_certs(str(tmp_path))
    c = rediskit.RedisCluster(certs=certs)
    try:
        from hybridkv.server.l2.redis import RedisL2

        tls = {"tls_ca_file": f"{certs}/ca.crt", "tls_cert_file": f"{certs}/client.crt",
               "tls_key_file": f"{certs}/client.key"}
        spec = {"type": "redis", "url": c.url, "chunk_mb": CHUNK / (1 << 20)}
        with RedisL2(parse_l2_adapter(json.dumps({**spec, **tls}), {})) as l2:
            for i in range(30):
                l2.put(key_of(i), 0, NS_A, payload(i, SIZE))
            assert all(read_back(l2, key_of(i), 0) == payload(i, SIZE) for i in range(30))
            assert all(len(our_keys(r)) > 0 for r in c.nodes)
        with RedisL2(parse_l2_adapter(json.dumps({**spec, "tls_ca_file": tls["tls_ca_file"]}), {})) as no_cert:
            assert read_back(no_cert, key_of(1), 0) is None
            assert no_cert.stats()["store_up"] == 0
    finally:
        c.close()
