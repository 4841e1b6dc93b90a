"""`hybridkv serve --metrics-port`: Prometheus text scraped over HTTP from a real server, after real stores and
loads through the transfer library, parsed with prometheus_client's parser and held against that traffic."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from hybridkv.engine.client import CacheClient
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.model.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv.server.front.metrics_http import CONNECTION_S, MAX_CONNECTIONS
from hybridkv.wire import protocol as P
from prometheus_client.parser import text_string_to_metric_families
from serverkit import Engine, process_fds

NUM_BLOCKS = 64


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def one(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_follow_stores_and_loads(server_factory):
    layout = preset_layout("tiny-hybrid")
    server = server_factory("--metrics-port", "0", admin=False)
    url = server.metrics_url
    assert url is not None and url.startswith("http://127.0.0.1:")
    before = scrape(url)
    assert one(before, "hybridkv_bytes_total", op="stored") == 0
    assert one(before, "hybridkv_engines") == 0
    assert one(before, "hybridkv_arena_bytes") == int(0.05 * 2**30)  # --l1-gib 0.05

    pages = [[torch.randint(0, 256, (NUM_BLOCKS, g.page_bytes), dtype=torch.uint8) for _ in range(g.num_layers)]
             for g in layout.groups]
    with KVTransfer(server.endpoint, layout, pages, TransferConfig(wire_format="shm")) as kv:
        chunk = kv.chunk_tokens
        tokens = np.random.default_rng(0).integers(0, 150_000, 3 * chunk + 5)
        per_chunk = [chunk // g.block_tokens for g in layout.groups]
        cold = kv.lookup("cold", tokens)  # nothing stored yet: 3 chunks missed
        assert cold.hit_chunks == 0
        kv.end_session("cold")
        stored = kv.store("r1", tokens, [list(range(3 * n)) for n in per_chunk]).wait_committed(30)
        kv.end_session("r1")
        hit = kv.lookup("r2", tokens)
        assert hit.hit_chunks == 3
        during = scrape(url)  # the lease is held until the retrieve has copied
        kv.retrieve(hit, [list(range(3 * n, 6 * n)) for n in per_chunk]).wait(30)
        kv.end_session("r2")
        assert one(during, "hybridkv_engines") == 1
        assert one(during, "hybridkv_namespaces") == 1
        assert one(during, "hybridkv_leases") == 1
        assert one(during, "hybridkv_leases_max_engine") == 1
        assert one(during, "hybridkv_l1_objects", state="pinned") == len(hit.objects)
        after = scrape(url)

    assert one(after, "hybridkv_bytes_total", op="stored") == stored.nbytes > 0
    assert one(after, "hybridkv_bytes_total", op="loaded") == hit.nbytes > 0
    assert one(after, "hybridkv_bytes_total", op="spilled") == 0  # no L2
    assert one(after, "hybridkv_hit_chunks_total", tier="l1") == 3
    assert one(after, "hybridkv_hit_tokens_total", tier="l1") == 3 * chunk == hit.hit_tokens
    assert one(after, "hybridkv_hit_chunks_total", tier="l2") == 0
    assert one(after, "hybridkv_miss_chunks_total") == 3  # the cold lookup's; the warm one hit all 3
    assert one(after, "hybridkv_miss_tokens_total") == 3 * chunk
    assert one(after, "hybridkv_store_objects_total", result="committed") == stored.objects > 0
    assert one(after, "hybridkv_tier_used_bytes", tier="l1") >= stored.nbytes
    assert one(after, "hybridkv_l1_objects", state="pinned") == 0
    assert one(after, "hybridkv_leases") == 0
    assert one(after, "hybridkv_engines_limit") == 1024
    # every request was answered and timed: 2 lookups, one prepare + commit, and their histograms agree
    assert one(after, "hybridkv_requests_total", type="lookup") == 2
    assert one(after, "hybridkv_request_duration_seconds_count", type="lookup") == 2
    assert one(after, "hybridkv_request_duration_seconds_bucket", type="lookup", le="+Inf") == 2
    assert one(after, "hybridkv_request_duration_seconds_sum", type="lookup") > 0
    assert one(after, "hybridkv_requests_total", type="prepare_store") == 1
    assert one(after, "hybridkv_requests_total", type="commit_store") == 1
    assert ("hybridkv_request_errors_total", (("code", "forbidden"), ("type", "stats"))) not in after
    # no label names a request id, an engine or a namespace
    assert {k for _, labels in after for k, _ in labels} <= {"type", "code", "tier", "op", "result", "state",
                                                             "le", "version"}


def test_metrics_count_errors_by_type_and_code(server_factory):
    from hybridkv.engine.client import CacheClient, ServerError

    server = server_factory("--metrics-port", "0", admin=False)
    with CacheClient(server.endpoint) as c:
        for _ in range(2):
            with pytest.raises(ServerError):
                c.call(P.Stats())  # forbidden without --admin
        with pytest.raises(ServerError):
            c.call(P.Lookup(engine=7, request="r", keys=[]))  # never registered
    s = scrape(server.metrics_url)
    assert one(s, "hybridkv_request_errors_total", type="stats", code="forbidden") == 2
    assert one(s, "hybridkv_request_errors_total", type="lookup", code="unknown_engine") == 1
    assert one(s, "hybridkv_forbidden_refusals_total") == 2


@pytest.mark.parametrize("flags, message", [
    (("--metrics-port", "70000"), "--metrics-port must be in 0..65535 (0: any free port), got 70000"),
    (("--metrics-port", "-1"), "got -1"),
    (("--metrics-port", "9400", "--metrics-host", "not-an-ip"), "--metrics-host must be an IP address"),
])
def test_bad_metrics_flags_name_the_value(sock_dir, flags, message):
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", "--endpoint", f"ipc://{sock_dir}/x.sock",
                        "--l1-gib", "0.01", *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_metrics_port_in_use_is_one_line_and_leaves_no_arena(server_factory, sock_dir):
    first = server_factory("--metrics-port", "0")
    port = first.metrics_url.split(":")[2].split("/")[0]
    p = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", "--endpoint", f"ipc://{sock_dir}/y.sock",
                          "--l1-gib", "0.01", "--metrics-port", port], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, (out, err)
    assert err.strip() == (f"hybridkv serve: error: cannot serve metrics on --metrics-host 127.0.0.1 --metrics-port "
                           f"{port}: [Errno 98] Address already in use")
    assert not list(Path("/dev/shm").glob(f"hybridkv-{p.pid}-*.arena"))


def test_metrics_show_spills_reloads_and_l2_hits(server_factory, tmp_path):
    """Chunks pushed out of a 1 MiB L1 go to L2 and come back for a lookup: spilled, reloaded, tier l2."""
    from hybridkv.engine.client import CacheClient
    from serverkit import Engine

    l2 = tmp_path / "l2"
    server = server_factory("--l2-dir", str(l2), "--l2-gib", "0.25", "--metrics-port", "0", l1_gib=1 / 1024)
    with CacheClient(server.endpoint, timeout_s=60) as c:
        eng, filler = Engine(c), Engine(c, salt="filler")
        keys = eng.keys(4, seed=1)
        eng.store(keys)
        for i in range(4):  # 16 chunks of 4 objects after eng's 16, in 51 slots: eng's, the oldest, all leave L1
            assert not filler.store(filler.keys(4, seed=10 + i), request=f"f{i}").refused
        c.call(P.Clear(engine=filler.id))
        before = scrape(server.metrics_url)
        res = eng.lookup(keys, policy="all")
        assert res.hit_chunks == 4
        eng.check(keys, res)
    after = scrape(server.metrics_url)
    per_chunk = sum(eng.sizes)
    assert one(before, "hybridkv_bytes_total", op="spilled") >= 4 * per_chunk
    assert one(before, "hybridkv_tier_objects", tier="l2") >= 16
    assert one(before, "hybridkv_evictions_total", tier="l1") >= 16
    assert one(after, "hybridkv_bytes_total", op="reloaded") - one(before, "hybridkv_bytes_total", op="reloaded") \
        == 4 * per_chunk
    assert one(after, "hybridkv_hit_chunks_total", tier="l2") == 4
    assert one(after, "hybridkv_hit_chunks_total", tier="l1") == 0
    assert one(after, "hybridkv_hit_tokens_total", tier="l2") == 4 * eng.chunk_tokens
    assert one(after, "hybridkv_lookup_l2_waits_total") == 1
    assert one(after, "hybridkv_tier_capacity_bytes", tier="l2") == int(0.25 * 2**30)
    assert one(after, "hybridkv_l2_errors_total", op="spill") == 0
    assert one(after, "hybridkv_l2_corrupt_removed_total") == 0


REDIS_ONLY = {"hybridkv_l2_up"}  # exported only with a Redis / Valkey L2


def test_grafana_dashboard_asks_only_for_metrics_the_server_exports(server_factory, tmp_path):
    """docs/grafana-dashboard.json: every metric its queries name is one a real server (with an L2, after
    traffic) serves; panel ids are unique and every panel reads the dashboard's datasource variable."""
    import json
    import re

    from hybridkv.engine.client import CacheClient, ServerError
    from serverkit import Engine

    dash = json.loads((Path(__file__).parents[4] / "docs" / "grafana-dashboard.json").read_text())
    server = server_factory("--l2-dir", str(tmp_path / "l2"), "--l2-gib", "0.1", "--metrics-port", "0")
    with CacheClient(server.endpoint) as c:
        eng = Engine(c)
        keys = eng.keys(2, seed=1)
        eng.store(keys)
        eng.lookup(keys)
        with pytest.raises(ServerError):
            c.call(P.Lookup(engine=7, request="r", keys=[]))  # an error reply, so the error counter has a sample
    served = {name for name, _ in scrape(server.metrics_url)}
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    asked = set()
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            asked |= set(re.findall(r"\b((?:hybridkv|process)_[a-z0-9_]+)\b", t["expr"]))
    assert len(asked) > 30
    assert asked - served <= REDIS_ONLY, sorted(asked - served)
    docs = (Path(__file__).parents[4] / "docs" / "metrics.md").read_text()
    assert all(f"`{m}`" in docs for m in REDIS_ONLY)


def test_idle_and_slow_metrics_connections_never_lock_engines_out_and_time_out_without_a_traceback(sock_dir, tmp_path):
    """Two findings, one wait of CONNECTION_S (each took its own, 10 s and more of the suite apiece):
    - the metrics endpoint kept a thread and a file for each connection as long as the client kept it open, and the
      engines' gate counted those files as clients, for good: with 200 idle connections under a limit of 256 files
      the ipc door closed and stayed closed after they left. Now it holds MAX_CONNECTIONS at most, each for
      CONNECTION_S, and an engine registers at once while they stay and after they leave;
    - socketserver printed a traceback to stderr for every connection that timed out (here 3 that send half a
      request line): any client could fill the log, and a JSON log got lines that are not JSON."""
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        s = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/m.sock", l1_bytes=int(0.02 * GIB)), metrics_port=0,
                         nofile=256, log_format="json", stderr=log)
    try:
        assert s.metrics_url is not None
        host, port = s.metrics_url.split("/")[2].rsplit(":", 1)
        base = process_fds(s.pid)
        slow = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        for c in slow:
            c.sendall(b"GET /metr")  # a request line it never finishes
        held = list(slow)
        for _ in range(200):
            c = socket.socket()
            c.settimeout(5)
            try:
                c.connect((host, int(port)))
            except OSError:
                c.close()
                continue
            held.append(c)
        most = process_fds(s.pid)
        t0 = time.monotonic()
        with CacheClient(s.endpoint, timeout_s=5) as c:
            assert Engine(c).id
        took = time.monotonic() - t0
        assert took < 5 and most <= base + MAX_CONNECTIONS + 4, (took, base, most)
        # the server ends every connection it kept within CONNECTION_S, whatever the client does
        deadline = time.monotonic() + CONNECTION_S + 10
        waiting = list(held)
        while waiting and time.monotonic() < deadline:
            readable, _, _ = select.select(waiting, [], [], 0.5)
            waiting = [w for w in waiting if w not in readable]
        assert not waiting, f"{len(waiting)} connections still open after {CONNECTION_S + 10} s"
        assert scrape(s.metrics_url)[("hybridkv_engines", ())] == 1  # and a scrape gets in again
        for h in held:
            h.close()
        with CacheClient(s.endpoint, timeout_s=5) as c:
            assert Engine(c).id
    finally:
        assert s.stop() == 0
    lines = log_path.read_text().splitlines()
    bad = [line for line in lines if not line.startswith("{")]
    assert not bad, f"{len(bad)} of {len(lines)} log lines are not JSON: {bad[:5]}"
