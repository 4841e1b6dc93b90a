"""The limits all clients share, against real server processes: each refusal names its flag (keys, engines,
leases, message and frame bytes), a client over its pending limit is refused rather than queued, and one
connection takes only its share (engines per client; what it can make the server hold, the formula in
docs/protocol.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.model.layout import MAX_NAME_CHARS
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P
from serverkit import Engine, RawDealer, alive, expect

E = P.ErrorCode


def test_limits_refuse_with_an_error_naming_the_flag(server_factory):
    srv = server_factory("--max-keys", "8", "--max-engines", "2", "--max-leases", "2",
                         "--max-message-bytes", "65536", "--max-frame-bytes", "1048576")
    with CacheClient(srv.endpoint, timeout_s=10) as c:
        eng = Engine(c)
        keys = eng.keys(9, seed=6)
        assert "--max-keys" in expect(E.LIMIT, lambda: eng.lookup(keys)).message
        eng.store(keys[:2])
        eng.lookup(keys[:2], request="1")
        eng.lookup(keys[:2], request="2")
        assert "--max-leases" in expect(E.LIMIT, lambda: eng.lookup(keys[:2], request="3")).message
        Engine(c)
        assert "--max-engines" in expect(E.LIMIT, lambda: Engine(c)).message
        big = P.Lookup(engine=eng.id, request="x" * 70_000, keys=keys[:1])
        assert "--max-message-bytes" in expect(E.LIMIT, lambda: c.call(big)).message
    raw = RawDealer(srv.endpoint)
    try:
        raw.sock.setsockopt(zmq.RCVTIMEO, 1000)
        raw.sock.send_multipart([P.encode(P.Health()), b"\0" * (2 << 20)])  # over --max-frame-bytes
        with pytest.raises(zmq.Again):
            raw.sock.recv_multipart()  # libzmq dropped the connection before allocating the frame
    finally:
        raw.close()
    assert alive(srv.endpoint)


def test_a_client_over_its_pending_limit_is_refused_not_queued(server_factory, tmp_path):
    srv = server_factory("--max-pending", "1", "--max-keys", "4096")
    with CacheClient(srv.endpoint, timeout_s=30) as c:
        eng = Engine(c)
        keys = eng.keys(1, seed=7)
        eng.store(keys)
        leases = [eng.lookup(keys, request=str(i)).lease for i in range(2)]
        futs = [c.submit(P.Retrieve(engine=eng.id, lease=lease, format="pickle")) for lease in leases]
        codes = []
        for f in futs:
            try:
                f.result(timeout=30)
                codes.append("ok")
            except ServerError as e:
                codes.append(e.code)
        assert codes[0] == "ok" and codes[1] in ("ok", E.LIMIT)  # the second may find the first done


MIB = 1 << 20


def rss_anon(pid: int) -> int:
    """The server's private memory (its heap), not the arena pages it touched."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def test_one_connection_takes_only_its_share_of_the_engines(server_factory):
    s = server_factory("--max-engines", "8", "--max-engines-per-client", "3")
    with CacheClient(s.endpoint, timeout_s=10) as a, CacheClient(s.endpoint, timeout_s=10) as b:
        mine = [Engine(a) for _ in range(3)]
        with pytest.raises(ServerError) as ei:
            Engine(a)
        assert ei.value.code == P.ErrorCode.LIMIT and "--max-engines-per-client 3" in ei.value.message
        Engine(b)  # another client still registers
        a.call(P.Unregister(engine=mine[0].id))
        Engine(a)  # and an unregistered engine gives its place back


def test_one_client_holds_at_most_what_the_formula_in_protocol_md_says(server_factory):
    """docs/protocol.md: C x [0.35 MiB + L x (0.3 KiB + 150 B x min(K x G, N1)) + R x 0.3 KiB + F x K x 60 B]
    per connection (+ what requests being answered hold: none here). Two connections try to hold more, with
    fields at and past their bounds (1 MiB names and request ids were kept before: 1 MiB per lease), and
    the server's heap stays under twice the formula."""
    c_, leases, k = 2, 16, 128
    s = server_factory("--max-engines-per-client", str(c_), "--max-leases", str(leases), "--max-keys", str(k),
                       l1_gib=0.1)
    tiny = preset_layout("tiny-hybrid")
    g = len(tiny.groups)
    with CacheClient(s.endpoint, timeout_s=30) as first, CacheClient(s.endpoint, timeout_s=30) as second:
        warm = Engine(second)
        warm.store(warm.keys(k, seed=9))
        second.call(P.Unregister(engine=warm.id))
        before = rss_anon(s.pid)
        for name in ("n" * (1 << 20), "n" * MAX_NAME_CHARS, "m" * MAX_NAME_CHARS, "o" * MAX_NAME_CHARS):
            try:  # the first connection registers engines with the longest names it can
                first.call(P.Register(layout=tiny, chunk_tokens=0, name=name))
            except ServerError:
                pass  # too long, or its share is taken
        eng = Engine(second)
        keys = eng.keys(k, seed=9)
        for i in range(leases + 4):  # the second holds every lease it can, each pinning every object
            for rid in (f"{i}" + "r" * (1 << 20), f"{i}" + "r" * (MAX_NAME_CHARS - 3)):
                try:
                    eng.lookup(keys, policy="all", request=rid)
                except ServerError:
                    pass
        counters = first.call(P.Stats())[0].counters
        assert counters["engines"] == 3 and counters["leases"] == leases
        grown = rss_anon(s.pid) - before
    n1 = k * g
    bound = 2 * c_ * (0.35 * MIB + leases * (300 + 150 * min(k * g, n1)) + 1024 * 300 + 16 * k * 60)
    assert grown <= bound, f"the server's heap grew {grown / MIB:.2f} MiB; the formula says {bound / MIB:.2f} MiB"
