"""Microbenchmarks (pytest-benchmark): codecs, keys, protocol, a lookup round trip, gather/scatter on CPU.

In the default test run they execute once each as tests (`--benchmark-disable`); `nox -s microbench`
times them, saves the results and fails on a regression against the saved baseline.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybridkv import protocol as P
from hybridkv.baselines.codec import decode_tensor, encode_tensor
from hybridkv.engine.client import CacheClient
from hybridkv.keys import chunk_keys, namespace
from hybridkv.presets import preset_layout
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


@pytest.fixture(scope="module")
def lookup_server():
    import shutil
    import tempfile

    from hybridkv.server.launch import start_server

    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    s = start_server(f"ipc://{d}/s.sock", l1_gib=0.05)
    yield s.endpoint
    s.close()
    shutil.rmtree(d, ignore_errors=True)


def test_lookup_round_trip_71_chunks(benchmark, lookup_server):
    layout = preset_layout("tiny-hybrid")
    with CacheClient(lookup_server, timeout_s=10) as c:
        reg, _ = c.call(P.Register(layout=layout, chunk_tokens=0))
        keys = chunk_keys(reg.namespace, np.arange(71 * 80) % 5000, 80)
        prep, _ = c.call(P.PrepareStore(engine=reg.engine, request="s", keys=keys,
                                        objects=[(k, g) for k in range(71) for g in range(4)]))
        c.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation))
        look = P.Lookup(engine=reg.engine, request="r", keys=keys, pin=False)
        res, _ = benchmark(c.call, look)
        assert res.hit_chunks == 71


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
