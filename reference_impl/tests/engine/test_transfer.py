"""The transfer library against a real server: every wire format x copy engine x stream mode x
retrieve policy returns identical bytes, on CPU tensors (the same code runs CUDA tensors on a GPU)."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from hybridkv.engine.client import ServerError, ServerTimeout
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.model.layout import LayoutError
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools
from hybridkv_kernels import cuda_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_BLOCKS = 48
SENTINEL = 0xA5




def poison(pools, blocks) -> None:
    for g, ids in enumerate(blocks):
        for t in pools[g]:
            t[ids] = SENTINEL


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    import shutil
    import tempfile

    from serverkit import spawn_server

    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    s = spawn_server(d, l1_gib=0.5)
    yield s.endpoint
    s.close()
    shutil.rmtree(d, ignore_errors=True)


def round_trip(endpoint: str, layout, cfg: TransferConfig, chunks: int, seed: int) -> None:
    """Store `chunks` full chunks (+ a partial one) from some blocks, retrieve into other blocks, compare."""
    pools = vllm_pools(layout, NUM_BLOCKS, DEVICE)
    fill_random(pools, seed)
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(endpoint, layout, pools, cfg) as kv:
        ct = kv.chunk_tokens
        bpc = [ct // g.block_tokens for g in layout.groups]
        tokens = np.random.default_rng(seed).integers(0, 150_000, chunks * ct + ct // 2)
        src = [alloc.allocate(chunks * b + 1) for b in bpc]
        st = kv.store("req-a", tokens, src).wait_committed(30)
        n_obj = sum(chunks if (g.kind == "attention" or cfg.store_policy == "all") else 1 for g in layout.groups)
        assert st.objects == n_obj and st.refused == 0
        hit = kv.lookup("req-b", tokens)
        assert hit.hit_chunks == chunks and hit.hit_tokens == chunks * ct
        dst = [alloc.allocate(chunks * b + 1) for b in bpc]
        poison(pools, dst)
        before = [[t.clone() for t in grp] for grp in pools]
        kv.retrieve(hit, dst).wait(30)
        for g, grp in enumerate(layout.groups):
            if grp.kind == "attention":
                moved = list(range(chunks * bpc[g]))
            else:  # only the blocks that end a chunk hold states; boundary loads only the last one
                ends = [(c + 1) * bpc[g] - 1 for c in range(chunks)]
                moved = ends if cfg.retrieve_policy == "all" else ends[-1:]
            for layer, t in enumerate(pools[g]):
                for j in range(len(dst[g])):
                    got = t[dst[g][j]]
                    if j in moved:
                        assert torch.equal(got, t[src[g][j]]), (cfg, g, layer, j)
                    else:  # nothing else written: still poison
                        assert bool((got == SENTINEL).all()), (cfg, g, layer, j)
                # source blocks untouched by the whole round trip
                for j in src[g]:
                    assert torch.equal(t[j], before[g][layer][j])
        kv.end_session("req-a")
        kv.end_session("req-b")


AXES = list(itertools.product(("shm", "raw", "pickle", "torch_save"), ("kernel", "dma"),
                              ("single", "per_group"), ("boundary", "all")))


@pytest.mark.parametrize("fmt,engine,streams,policy", AXES, ids=["-".join(a) for a in AXES])
def test_round_trip_tiny_hybrid(endpoint, fmt, engine, streams, policy):
    cfg = TransferConfig(wire_format=fmt, copy_engine=engine, streams=streams, retrieve_policy=policy,
                         store_policy=policy, salt="-".join((fmt, engine, streams, policy)))
    round_trip(endpoint, preset_layout("tiny-hybrid"), cfg, chunks=3, seed=hash(cfg.salt) % 1000)


@pytest.mark.parametrize("fmt", ["shm", "raw", "pickle", "torch_save"])
@pytest.mark.parametrize("engine", ["kernel", "dma"])
def test_round_trip_qwen36_page_shape(endpoint, fmt, engine):
    """Qwen3.6-27B's 4-group layout and 3.2 MB pages, scaled down in layers and blocks, not page shape."""
    layout = preset_layout("qwen3.6-27b-4layers")
    assert layout.groups[0].page_bytes == 3_211_264 and len(layout.groups) == 4
    cfg = TransferConfig(wire_format=fmt, copy_engine=engine, salt=f"q-{fmt}-{engine}")
    round_trip(endpoint, layout, cfg, chunks=2, seed=7)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton runs on CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt", ["shm", "raw"])
def test_round_trip_through_the_triton_kernel(endpoint, fmt):
    cfg = TransferConfig(wire_format=fmt, copy_engine="triton", salt=f"triton-{fmt}")
    round_trip(endpoint, preset_layout("tiny-hybrid"), cfg, chunks=2, seed=3)


def test_store_is_delta_aware_and_partial_chunks_are_not_stored(endpoint):
    layout = preset_layout("tiny-hybrid")
    pools = vllm_pools(layout, NUM_BLOCKS, DEVICE)
    fill_random(pools, 1)
    with KVTransfer(endpoint, layout, pools, TransferConfig(salt="delta")) as kv:
        ct = kv.chunk_tokens
        tokens = np.arange(4 * ct + 3) % 1000
        blocks = [list(range(g * 5, g * 5 + 5)) for g in range(4)]
        first = kv.store("a", tokens[:2 * ct], blocks).wait_committed(30)
        assert first.objects == 2 + 3  # attention for both chunks, states at the last
        again = kv.store("a", tokens, blocks).wait_committed(30)
        assert again.skipped == 2 and again.objects == 2 + 3  # attention chunks 0-1 already there
        assert kv.lookup("b", tokens).hit_chunks == 4


def test_get_finished_reports_completed_requests(endpoint):
    layout = preset_layout("tiny-hybrid")
    pools = vllm_pools(layout, NUM_BLOCKS, DEVICE)
    fill_random(pools, 2)
    with KVTransfer(endpoint, layout, pools, TransferConfig(salt="finished")) as kv:
        tokens = np.arange(2 * kv.chunk_tokens)
        blocks = [[g * 2, g * 2 + 1] for g in range(4)]
        kv.store("s1", tokens, blocks).wait_committed(30)
        hit = kv.lookup("l1", tokens)
        kv.retrieve(hit, [[20 + g * 2, 21 + g * 2] for g in range(4)]).wait(30)
        stores, loads = kv.get_finished()
        assert stores == {"s1"} and loads == {"l1"}
        assert kv.get_finished() == (set(), set())


@pytest.mark.parametrize("wire_format", ["shm", "raw"])
def test_a_load_s_release_is_sent_before_the_load_resolves(endpoint, wire_format, monkeypatch):
    """An engine ends a request's session as soon as its load is done (vLLM's connector does). The load's own
    release must already be on the socket by then, or the server would answer it with an unknown lease (an
    error on every dashboard). Checked as the order of the two steps, and as the server's error count."""
    layout = preset_layout("tiny-hybrid")
    pools = vllm_pools(layout, NUM_BLOCKS, DEVICE)
    fill_random(pools, 3)
    with KVTransfer(endpoint, layout, pools, TransferConfig(wire_format=wire_format, salt=f"end-{wire_format}")) as kv:
        tokens = np.arange(2 * kv.chunk_tokens)
        kv.store("s", tokens, [[g * 2, g * 2 + 1] for g in range(4)]).wait_committed(30)
        steps: list[str] = []
        release, resolve = kv.route._release, kv.route._resolve_done
        monkeypatch.setattr(kv.route, "_release", lambda *a, **k: (steps.append("release"), release(*a, **k)))
        monkeypatch.setattr(kv.route, "_resolve_done", lambda h: (steps.append(f"resolve {h.kind}"), resolve(h)))
        before = kv.client.call(P.Status())[0].errors.get("unknown_lease", 0)
        for i in range(20):
            hit = kv.lookup(f"r{i}", tokens)
            kv.retrieve(hit, [[20 + g * 2, 21 + g * 2] for g in range(4)]).wait(30)
            kv.end_session(f"r{i}")
        assert steps == ["release", "resolve load"] * 20
        assert kv.client.call(P.Status())[0].errors.get("unknown_lease", 0) == before


def test_bad_layouts_and_block_ids_are_refused_before_any_byte_moves(endpoint):
    layout = preset_layout("tiny-hybrid")
    pools = vllm_pools(layout, NUM_BLOCKS, DEVICE)
    fill_random(pools, 4)
    with pytest.raises(LayoutError, match="groups"):
        KVTransfer(endpoint, layout, pools[:3])
    wrong = vllm_pools(preset_layout("tiny-hybrid", tp=2), NUM_BLOCKS, DEVICE)
    with pytest.raises(LayoutError, match="pages of"):
        KVTransfer(endpoint, layout, wrong)
    with pytest.raises(LayoutError, match="multiple"):
        KVTransfer(endpoint, layout, pools, TransferConfig(chunk_tokens=layout.groups[0].block_tokens + 1))
    with pytest.raises(ValueError, match="wire_format"):
        TransferConfig(wire_format="json")
    snapshot = [[t.clone() for t in g] for g in pools]
    with KVTransfer(endpoint, layout, pools, TransferConfig(salt="bad-ids")) as kv:
        tokens = np.arange(2 * kv.chunk_tokens)
        with pytest.raises(ValueError, match="block ids"):
            kv.store("x", tokens, [[0, 1]] * 3)
        with pytest.raises(ValueError, match="needs 2"):
            kv.store("x", tokens, [[0]] * 4)
        with pytest.raises(ValueError, match=f"block id {NUM_BLOCKS + 7}"):
            kv.store("x", tokens, [[0, NUM_BLOCKS + 7]] * 4)  # planned in the caller's thread: refused there
        # the failed store left nothing reserved or visible on the server
        assert kv.lookup("y", tokens).hit_chunks == 0
    for g, grp in enumerate(pools):
        for t, s in zip(grp, snapshot[g], strict=True):
            assert torch.equal(t, s), "the engine's own pages must never be touched by a failed transfer"


def test_a_server_that_is_gone_gives_a_clear_error(sock_dir):
    layout = preset_layout("tiny-hybrid")
    pools = vllm_pools(layout, 8, DEVICE)
    with pytest.raises(ServerTimeout, match="no reply"):
        KVTransfer(f"ipc://{sock_dir}/nobody.sock", layout, pools, TransferConfig(timeout_s=0.5))


def test_a_server_error_fails_the_handle(endpoint):
    layout = preset_layout("tiny-hybrid")
    pools = vllm_pools(layout, NUM_BLOCKS, DEVICE)
    fill_random(pools, 5)
    kv = KVTransfer(endpoint, layout, pools, TransferConfig(salt="gone"))
    tokens = np.arange(2 * kv.chunk_tokens)
    kv.client.call(__import__("hybridkv.wire.protocol", fromlist=["Unregister"]).Unregister(engine=kv.engine_id))
    h = kv.store("x", tokens, [[0, 1]] * 4)
    with pytest.raises(ServerError, match="unknown_engine"):
        h.wait_committed(30)
    kv.close()


@pytest.fixture(scope="module")
def cuda_ipc_endpoint():
    import shutil
    import tempfile

    from serverkit import spawn_server

    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    s = spawn_server(d, "--cuda-ipc", l1_gib=0.5)
    yield s.endpoint
    s.close()
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["boundary", "all"])
def test_round_trip_cuda_ipc_baseline(cuda_ipc_endpoint, policy):
    cfg = TransferConfig(wire_format="cuda_ipc", retrieve_policy=policy, store_policy=policy, salt=f"ipc-{policy}")
    round_trip(cuda_ipc_endpoint, preset_layout("tiny-hybrid"), cfg, chunks=3, seed=11)


def test_a_cpu_only_server_refuses_the_cuda_ipc_format(endpoint):
    from hybridkv.engine.client import CacheClient
    from hybridkv.wire import protocol as P

    layout = preset_layout("tiny-hybrid")
    with CacheClient(endpoint, timeout_s=10) as c:
        reg, _ = c.call(P.Register(layout=layout, chunk_tokens=0))
        share = P.CudaShare(0, b"x" * 64, 1, 0, b"r", 0, b"e", False, 0, [4, 4], [4, 1])
        with pytest.raises(ServerError, match="CPU-only"):
            c.call(P.ShareCuda(engine=reg.engine, groups=[[share] * g.num_layers for g in layout.groups]))
        c.call(P.Health())


def test_auto_copy_engine_picks_dma_for_large_pages_and_the_kernel_for_small(endpoint):
    """On CUDA with the batched driver copy, `auto` is DMA at every page size (it measured above the kernel
    beside the engine's compute); elsewhere the kernel copies small pages and DMA large ones."""
    batched = DEVICE == "cuda" and cuda_batch.available()
    for preset, want in (("qwen3.6-27b-4layers", "dma"), ("tiny-hybrid", "dma" if batched else "kernel")):
        layout = preset_layout(preset)
        pools = vllm_pools(layout, 4, DEVICE)
        with KVTransfer(endpoint, layout, pools, TransferConfig(salt=f"auto-{preset}")) as kv:
            kernel = "triton" if DEVICE == "cuda" else "torch"
            assert kv.impl == ("dma" if want == "dma" else kernel), (preset, kv.impl)
