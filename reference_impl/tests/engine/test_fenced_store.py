"""Stores whose commit leaves with the copies (TransferConfig.commit = "fenced", hybridkv.server.books.fences): on
CUDA the GPU writes the reservation's fence word after the pages and the server publishes once it shows. The
CUDA cases run on a GPU machine; on a CPU the classic commit applies, which the CPU cases check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

NUM_BLOCKS = 48
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _counters(kv: KVTransfer) -> dict:
    return kv.client.call(P.Stats())[0].counters


def _stored_equal(kv: KVTransfer, pools, alloc: BlockAllocator, tokens, src, chunks: int) -> bool:
    """Load what `tokens` stored into fresh blocks and compare with the source pages."""
    layout = kv.layout
    bpc = [kv.chunk_tokens // g.block_tokens for g in layout.groups]
    dst = [alloc.allocate(chunks * b) for b in bpc]
    hit = kv.lookup("check", tokens)
    assert hit.hit_chunks == chunks
    kv.retrieve(hit, dst).wait(30)
    kv.end_session("check")
    if kv.device.type == "cuda":
        torch.cuda.synchronize()
    for g, grp in enumerate(layout.groups):
        rows = range(len(src[g])) if grp.kind == "attention" else [chunks * bpc[g] - 1]
        for t in pools[g]:
            if not all(torch.equal(t[dst[g][r]], t[src[g][r]]) for r in rows):
                return False
    return True


def test_commit_mode_is_validated():
    with pytest.raises(ValueError, match="commit must be one of"):
        TransferConfig(commit="later")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["fenced", "after_copies"])
def test_on_a_cpu_a_store_writes_its_fence_after_its_copies(server_factory, mode):
    """On a CPU the copies are synchronous: a fenced store writes its fence word and sends its commit once they
    are done (the protocol and the route's fenced steps, with nothing to overlap). Many stores, none waited
    for before the next: every one is committed once, holds its pages, and `done` precedes `committed`."""
    srv = server_factory()
    layout = preset_layout("tiny-hybrid", 1)
    pools = vllm_pools(layout, 4 * NUM_BLOCKS, "cpu")
    fill_random(pools, 1)
    alloc = BlockAllocator(4 * NUM_BLOCKS)
    with KVTransfer(srv.endpoint, layout, pools, TransferConfig(commit=mode, salt=f"cpu-{mode}")) as kv:
        assert kv.route.fenced == (mode == "fenced")
        ct = kv.chunk_tokens
        src = [alloc.allocate(ct // g.block_tokens) for g in layout.groups]
        prompts = [np.random.default_rng(10 + i).integers(0, 150_000, ct) for i in range(20)]
        handles = [kv.store(f"s{i}", t, src) for i, t in enumerate(prompts)]
        for i, h in enumerate(handles):
            h.wait_committed(30)
            assert h.done.done() and h.t_done <= h.t_committed and h.objects == len(layout.groups)
            kv.end_session(f"s{i}")
        st = _counters(kv)
        assert st["commits_fenced"] == (20 if mode == "fenced" else 0) and st["objects_committed"] == 20 * 4
        for i, t in enumerate(prompts):
            assert kv.lookup(f"c{i}", t).hit_chunks == 1
            kv.end_session(f"c{i}")
        assert _stored_equal(kv, pools, alloc, prompts[-1], src, 1)


@pytest.mark.slow  # 6 s on the 2-core VM: `nox -s tests_slow` runs it
def test_a_fenced_store_to_a_server_that_died_fails_and_never_hangs(server_factory):
    srv = server_factory(client_timeout=2.0)
    layout = preset_layout("tiny-hybrid", 1)
    pools = vllm_pools(layout, NUM_BLOCKS, "cpu")
    alloc = BlockAllocator(NUM_BLOCKS)
    cfg = TransferConfig(commit="fenced", salt="cpu-died", timeout_s=3.0)
    with KVTransfer(srv.endpoint, layout, pools, cfg) as kv:
        ct = kv.chunk_tokens
        src = [alloc.allocate(ct // g.block_tokens) for g in layout.groups]
        prep = kv.prepare_store("d", np.arange(ct), block_ids=src)
        prep.wait(10)
        srv.close()  # SIGKILL: the commit is never answered
        h = kv.store("d", np.arange(ct), src, prepared=prep)
        with pytest.raises(Exception) as ei:
            h.wait_committed(20)
        assert "ServerTimeout" in type(ei.value).__name__ or "timeout" in str(ei.value).lower(), ei.value
        assert h.done.done()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("preset,tp,streams", [("tiny-hybrid", 1, "single"), ("tiny-hybrid", 1, "per_group"),
                                               ("qwen3.6-27b", 8, "single")])
def test_a_fenced_store_is_published_only_after_its_copies_and_holds_the_pages(server_factory, preset, tp, streams):
    """The engine's stream is kept busy ~1 s, so the copies (queued after it) start late while the commit
    is already at the server: another engine of the namespace misses until the fence shows, then hits the
    exact pages; `done` comes no later than `committed`. A warm-up store first takes the route's one-time
    set-up (on the H200 the first store of a process outlasted a 0.1 s busy stream, so the premise failed)."""
    srv = server_factory(l1_gib=2.0)
    layout = preset_layout(preset, tp)
    pools = vllm_pools(layout, NUM_BLOCKS, "cuda")
    fill_random(pools, 2)
    alloc = BlockAllocator(NUM_BLOCKS)
    cfg = TransferConfig(copy_engine="dma", streams=streams, commit="fenced", salt=f"fenced-{preset}-{streams}")
    with KVTransfer(srv.endpoint, layout, pools, cfg) as kv, \
            KVTransfer(srv.endpoint, layout, pools, cfg) as other:
        assert kv.route.fenced
        chunks = 2
        tokens = np.random.default_rng(2).integers(0, 150_000, chunks * kv.chunk_tokens)
        src = [alloc.allocate(chunks * (kv.chunk_tokens // g.block_tokens)) for g in layout.groups]
        warm = np.random.default_rng(3).integers(0, 150_000, kv.chunk_tokens)
        first = [ids[:kv.chunk_tokens // g.block_tokens] for ids, g in zip(src, layout.groups, strict=True)]
        kv.store("w", warm, first).wait_committed(30)
        kv.end_session("w")
        prep = kv.prepare_store("f", tokens, block_ids=src)
        prep.wait(30)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # the engine's stream busy ~1 s: the copies wait for it
        busy = torch.cuda.Event()
        busy.record()
        h = kv.store("f", tokens, src, prepared=prep)
        early = other.lookup("early", tokens)
        other.end_session("early")
        assert not busy.query(), "premise: the lookup came after the engine's stream was free again"
        h.wait_committed(30)
        kv.end_session("f")
        assert early.hit_chunks == 0, "published before the copies (and the fence after them) ended"
        assert h.t_commit_sent < h.t_done <= h.t_committed
        assert _counters(kv)["commits_fenced"] == 2
        assert _stored_equal(other, pools, alloc, tokens, src, chunks)


@cuda
@pytest.mark.cuda
def test_fenced_and_classic_commits_store_the_same_bytes_many_times(server_factory):
    """40 stores in each mode, back to back, none waited for before the next is queued: every one hits and
    holds its pages (the fence ring of device words wraps: 64 per stream)."""
    srv = server_factory(l1_gib=2.0)
    layout = preset_layout("tiny-hybrid", 1)
    pools = vllm_pools(layout, 4 * NUM_BLOCKS, "cuda")
    fill_random(pools, 3)
    for mode in ("fenced", "after_copies"):
        alloc = BlockAllocator(4 * NUM_BLOCKS)
        cfg = TransferConfig(copy_engine="dma", commit=mode, salt=f"many-{mode}")
        with KVTransfer(srv.endpoint, layout, pools, cfg) as kv:
            ct = kv.chunk_tokens
            src = [alloc.allocate(ct // g.block_tokens) for g in layout.groups]
            handles, prompts = [], []
            before = _counters(kv)["commits_fenced"]
            for i in range(70):
                tokens = np.random.default_rng(100 + i).integers(0, 150_000, ct)
                handles.append(kv.store(f"m{i}", tokens, src))
                prompts.append(tokens)
            for i, h in enumerate(handles):
                h.wait_committed(30)
                kv.end_session(f"m{i}")
            assert _counters(kv)["commits_fenced"] - before == (70 if mode == "fenced" else 0)
            for i, t in enumerate(prompts):
                assert kv.lookup(f"c{i}", t).hit_chunks == 1, i
                kv.end_session(f"c{i}")
            assert _stored_equal(kv, pools, alloc, prompts[-1], src, 1)
