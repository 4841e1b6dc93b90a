"""Microbenchmarks (pytest-benchmark): codecs, keys, protocol, request round trips, gather/scatter on CPU.

The round trips (group "round trip (ipc)": Health, a 71-chunk lookup unpinned and pinned, prepare + commit
of a 2-chunk store) run against a real server process and print beside their ceiling, a bare pyzmq
DEALER -> ROUTER echo of the same bytes on the same transport, measured in the same run (issue 15's target:
a 71-chunk lookup <= 100 us at p50). In the default test run they execute once each as tests
(`--benchmark-disable`); `nox -s microbench` times them, saves the results and fails on a regression
against the saved baseline.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybridkv.baselines.codec import decode_tensor, encode_tensor
from hybridkv.engine.client import CacheClient
from hybridkv.model.keys import chunk_keys, namespace
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P
from hybridkv_bench.microbench.lookup_bench import store_chunks
from hybridkv_kernels import PagedLayers, build_plan, run_plan

pytestmark = pytest.mark.benchmark

QWEN = preset_layout("qwen3.6-27b")
TOKENS_56K = np.random.default_rng(0).integers(0, 150_000, 71 * 784)


@pytest.mark.parametrize("fmt", ["pickle", "torch_save"])
def test_legacy_codec_4mib(benchmark, fmt):
    t = torch.randn(2 << 20, dtype=torch.float32).to(torch.bfloat16)
    back = benchmark(lambda: decode_tensor(fmt, encode_tensor(fmt, t)))
    assert torch.equal(back, t)


def test_chunk_keys_56k_tokens(benchmark):
    ns = namespace(QWEN, 0, 784)
    keys = benchmark(chunk_keys, ns, TOKENS_56K, 784)
    # a prefix hash: every chunk's key differs, and a prompt cut after 70 chunks keeps the first 70
    assert len(keys) == 71 and len(set(keys)) == 71
    assert chunk_keys(ns, TOKENS_56K[:70 * 784 + 5], 784) == keys[:70]


def test_protocol_lookup_message_71_keys(benchmark):
    keys = chunk_keys(namespace(QWEN, 0, 784), TOKENS_56K, 784)
    msg = P.Lookup(engine=1, request="r", keys=keys)
    out = benchmark(lambda: P.decode_request(P.encode(msg)))
    assert out == msg


# ---- request round trips, beside the bare pyzmq echo measured in the same run (issue 15) -------------

ROUND_TRIP = pytest.mark.benchmark(group="round trip (ipc)")
PINNED_ROUNDS = STORE_ROUNDS = 1000  # fixed: each round needs its own untimed setup (release, fresh keys)


@pytest.fixture(scope="module")
def sock_dir():
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def lookup_server(sock_dir):
    from hybridkv.server.books.config import GIB, ServerConfig
    from hybridkv.server.front.launch import start_server

    # room for the store benchmark's rounds (8 objects of 20 KiB each) beside the 71 chunks, so no lookup
    # benchmark finds its chunks evicted whatever order the tests run in
    # admin: Stats checks the pins
    s = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/s.sock", l1_bytes=GIB // 4, admin=True))
    yield s.endpoint
    s.close()


@pytest.fixture(scope="module")
def echo_endpoint(sock_dir):
    import subprocess
    import sys
    from pathlib import Path

    endpoint = f"ipc://{sock_dir}/echo.sock"
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("echo_server.py")), endpoint],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield endpoint
    proc.kill()
    proc.wait()
    proc.stdout.close()


@pytest.fixture
def client_71(lookup_server):
    """A client, its engine and 71 chunks of tiny-hybrid stored (every group of every chunk)."""
    with CacheClient(lookup_server, timeout_s=10) as c:
        engine, keys = store_chunks(c)  # a test before this one may have stored them already
        yield c, engine, keys


@ROUND_TRIP
def test_echo_round_trip_reference(benchmark, echo_endpoint):
    # the same bytes a 71-chunk lookup sends, echoed by a ROUTER that does nothing else
    frame = P.encode(P.Lookup(engine=1, request="r", keys=chunk_keys(namespace(QWEN, 0, 784), TOKENS_56K, 784)))
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(echo_endpoint)
    try:
        def echo() -> bytes:
            sock.send(frame)
            return sock.recv()

        assert benchmark(echo) == frame
    finally:
        sock.close()


@ROUND_TRIP
def test_health_round_trip(benchmark, lookup_server):
    with CacheClient(lookup_server, timeout_s=10) as c:
        res, _ = benchmark(c.call, P.Health())
        assert isinstance(res, P.HealthResult)


@ROUND_TRIP
def test_lookup_round_trip_71_chunks(benchmark, client_71):
    c, engine, keys = client_71
    res, _ = benchmark(c.call, P.Lookup(engine=engine, request="r", keys=keys, pin=False))
    assert res.hit_chunks == 71 and res.lease == 0


@ROUND_TRIP
def test_lookup_pinned_round_trip_71_chunks(benchmark, client_71):
    # what an engine's lookup does: pin the hit's objects; each lease is released untimed before the next round
    c, engine, keys = client_71
    leases: list[int] = []

    def release_last() -> None:
        while leases:
            c.call(P.Release(engine=engine, lease=leases.pop()))

    def lookup() -> P.LookupResult:
        res, _ = c.call(P.Lookup(engine=engine, request="r", keys=keys))
        leases.append(res.lease)
        return res

    res = benchmark.pedantic(lookup, setup=release_last, rounds=PINNED_ROUNDS, warmup_rounds=10)
    release_last()
    # boundary policy: the attention group of every chunk and the three recurrent states of the last
    assert res.hit_chunks == 71 and len(res.objects) == 71 + 3 and res.lease
    stats, _ = c.call(P.Stats())
    assert stats.counters["l1_pinned_objects"] == 0


@ROUND_TRIP
def test_prepare_and_commit_round_trips_2_chunk_store(benchmark, lookup_server):
    # PrepareStore then CommitStore (shm: the bytes are in the arena already); fresh keys each round, untimed
    layout = preset_layout("tiny-hybrid")
    objects = [(k, g) for k in range(2) for g in range(4)]
    with CacheClient(lookup_server, timeout_s=10) as c:
        reg, _ = c.call(P.Register(layout=layout, chunk_tokens=0))
        rounds = iter(range(1 << 30))

        def fresh_keys():
            tokens = np.arange(160) + 160 * next(rounds) + 10**6  # none of them among the 71 chunks' tokens
            return (chunk_keys(reg.namespace, tokens, 80),), {}

        def store(keys: list[bytes]) -> P.Committed:
            prep, _ = c.call(P.PrepareStore(engine=reg.engine, request="s", keys=keys, objects=objects))
            done, _ = c.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation))
            return done

        done = benchmark.pedantic(store, setup=fresh_keys, rounds=STORE_ROUNDS, warmup_rounds=10)
        assert done.objects == 8


def test_plan_build_71_chunks_qwen36(benchmark):
    # Qwen3.6-27B TP1: 4 groups x 16 layers x 71 chunks = 4544 pages; views over tiny storage, plan only
    views = [[torch.empty(150, 64, dtype=torch.uint8)[:, :64] for _ in range(16)] for _ in range(4)]
    groups = [PagedLayers.from_views(v) for v in views]
    dst = torch.empty(4 * 16 * 71 * 64, dtype=torch.uint8)
    parts = torch.split(dst, 16 * 71 * 64)
    transfers = [(g, np.arange(71) * 2, p) for g, p in zip(groups, parts, strict=True)]
    plan = benchmark(build_plan, "gather", transfers)
    assert plan.num_pages == 4544


def test_gather_scatter_cpu_tiny_hybrid(benchmark):
    layout = preset_layout("tiny-hybrid")
    from hybridkv_bench.pools import fill_random, vllm_pools

    pools = vllm_pools(layout, 64, "cpu")
    fill_random(pools, 0)
    groups = [PagedLayers.from_views(p) for p in pools]
    objs = [torch.empty(g.object_bytes(8), dtype=torch.uint8) for g in groups]
    ids = [np.arange(8) + 8 * i for i in range(4)]

    def round_trip():
        run_plan(build_plan("gather", list(zip(groups, ids, objs, strict=True))), "torch")
        back = [np.arange(8) + 32 + 8 * i for i in range(4)]  # groups share buffers: disjoint blocks
        run_plan(build_plan("scatter", list(zip(groups, back, objs, strict=True))), "torch")

    benchmark(round_trip)
    for g, layers in enumerate(pools):
        for t in layers:
            assert torch.equal(t[32 + 8 * g:40 + 8 * g], t[ids[g]])
