"""When a transfer may touch the engine's pages: a load's copies start after the work the engine queued on its
stream before it asked (an engine zeroes new blocks there first), a cancelled load never writes, and a
cancelled store never commits. CUDA cases run on a GPU machine; the cancellation cases run on CPU too."""

from __future__ import annotations

import os
import signal
from concurrent.futures import CancelledError

import numpy as np
import pytest
import torch
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.model.presets import preset_layout
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

NUM_BLOCKS = 48
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _stored(kv: KVTransfer, pools, alloc: BlockAllocator, chunks: int, seed: int):
    """Store `chunks` chunks of random pages; (tokens, the source blocks, their bytes per group)."""
    layout = kv.layout
    ct = kv.chunk_tokens
    bpc = [ct // g.block_tokens for g in layout.groups]
    tokens = np.random.default_rng(seed).integers(0, 150_000, chunks * ct)
    src = [alloc.allocate(chunks * b) for b in bpc]
    kv.store(f"store-{seed}", tokens, src).wait_committed(30)
    kv.end_session(f"store-{seed}")
    return tokens, src, bpc


def _state_block(ids: list[int], bpc: int, chunks: int) -> int:
    return ids[chunks * bpc - 1]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("copy_engine", ["dma", "kernel"])
@pytest.mark.parametrize("preset,tp", [("tiny-hybrid", 1), ("qwen3.6-27b", 8)])
def test_a_load_starts_after_the_engine_s_queued_work(server_factory, copy_engine, preset, tp):
    """The destination blocks are zeroed on the engine's stream behind ~0.1 s of GPU work, then retrieve() is
    called at once: every loaded page must be the stored one, not the late zeroing's."""
    srv = server_factory(l1_gib=2.0)
    layout = preset_layout(preset, tp)
    pools = vllm_pools(layout, NUM_BLOCKS, "cuda")
    fill_random(pools, 5)
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(srv.endpoint, layout, pools, TransferConfig(copy_engine=copy_engine, salt=copy_engine)) as kv:
        chunks = 2
        tokens, src, bpc = _stored(kv, pools, alloc, chunks, 1)
        torch.cuda.synchronize()
        dst = [alloc.allocate(chunks * b) for b in bpc]
        hit = kv.lookup("load", tokens)
        assert hit.hit_chunks == chunks
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the zeroing, on the current stream
        for g, ids in enumerate(dst):
            for t in pools[g]:
                t[ids] = 0
        kv.retrieve(hit, dst).wait(30)
        torch.cuda.synchronize()
        wrong = 0
        for g, grp in enumerate(layout.groups):
            pairs = (list(zip(src[g], dst[g], strict=True)) if grp.kind == "attention"
                     else [(_state_block(src[g], bpc[g], chunks), _state_block(dst[g], bpc[g], chunks))])
            for t in pools[g]:
                wrong += sum(not torch.equal(t[s], t[d]) for s, d in pairs)
        assert wrong == 0, f"{wrong} loaded pages were overwritten by work queued before the load"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.cuda])])
def test_a_cancelled_load_never_writes(server_factory, device):
    """A load given up while the server is stopped (its answer late) writes nothing once the server answers."""
    srv = server_factory()
    layout = preset_layout("tiny-hybrid", 1)
    pools = vllm_pools(layout, NUM_BLOCKS, device)
    fill_random(pools, 6)
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(srv.endpoint, layout, pools, TransferConfig(wire_format="raw", salt=f"cancel-{device}")) as kv:
        chunks = 2
        tokens, _, bpc = _stored(kv, pools, alloc, chunks, 2)
        dst = [alloc.allocate(chunks * b) for b in bpc]
        for g, ids in enumerate(dst):
            for t in pools[g]:
                t[ids] = 0
        hit = kv.lookup("late", tokens)
        os.kill(srv.pid, signal.SIGSTOP)  # the raw wire fetches the payload from the server: it waits
        try:
            h = kv.retrieve(hit, dst)
            with pytest.raises(TimeoutError):
                h.wait(0.3)
            assert h.cancel(), "the load had written before its payload arrived"
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        with pytest.raises(CancelledError):
            h.wait(30)
        if device == "cuda":
            torch.cuda.synchronize()
        assert all(int(t[ids].abs().sum()) == 0 for g, ids in enumerate(dst) for t in pools[g]), \
            "a cancelled load wrote into the engine's blocks"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.cuda])])
def test_a_cancelled_store_never_commits(server_factory, device):
    """A store whose copies were not done when the engine gave up (its reservation answered late) never
    becomes visible: the engine may have reused the blocks while they were read."""
    srv = server_factory()
    layout = preset_layout("tiny-hybrid", 1)
    pools = vllm_pools(layout, NUM_BLOCKS, device)
    fill_random(pools, 7)
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(srv.endpoint, layout, pools, TransferConfig(salt=f"store-cancel-{device}")) as kv:
        ct = kv.chunk_tokens
        bpc = [ct // g.block_tokens for g in layout.groups]
        tokens = np.random.default_rng(3).integers(0, 150_000, 2 * ct)
        src = [alloc.allocate(2 * b) for b in bpc]
        os.kill(srv.pid, signal.SIGSTOP)  # the reservation's answer comes late: no copy can start
        try:
            h = kv.store("late-store", tokens, src)
            with pytest.raises(TimeoutError):
                h.wait(0.3)
            assert h.cancel()
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        with pytest.raises(CancelledError):
            h.wait_committed(30)
        assert kv.lookup("after", tokens).hit_chunks == 0, "a cancelled store was committed"


def ordered_store_wrong_pages(endpoint: str, preset: str, tp: int, ordered: bool) -> tuple[int, int]:
    """A prepared store on CUDA, then at once an overwrite of its blocks on the engine's stream, as vLLM does
    when it reuses them; with `ordered` the stream first waits for the store's copies (`order_after_copies`,
    no wait in this thread). (stored pages holding the later writes, pages checked)."""
    layout = preset_layout(preset, tp)
    pools = vllm_pools(layout, NUM_BLOCKS, "cuda")
    fill_random(pools, 8)
    alloc = BlockAllocator(NUM_BLOCKS)
    cfg = TransferConfig(copy_engine="dma", salt=f"ordered-{preset}-{ordered}")
    with KVTransfer(endpoint, layout, pools, cfg) as kv:
        chunks, ct = 2, kv.chunk_tokens
        bpc = [ct // g.block_tokens for g in layout.groups]
        tokens = np.random.default_rng(9).integers(0, 150_000, chunks * ct)
        src = [alloc.allocate(chunks * b) for b in bpc]
        want = [[t[ids].clone() for t in pools[g]] for g, ids in enumerate(src)]
        prep = kv.prepare_store("ordered", tokens, block_ids=src)
        prep.wait(30)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the engine's stream busy for ~0.1 s: the copies start after it
        h = kv.store("ordered", tokens, src, prepared=prep)
        if ordered:
            assert h.order_after_copies(torch.cuda.current_stream()), "a prepared store queues its copies in store()"
        for g, ids in enumerate(src):  # the engine reuses the blocks at once, on its own stream
            for t in pools[g]:
                t[ids] = 0
        h.wait_committed(30)
        kv.end_session("ordered")
        dst = [alloc.allocate(chunks * b) for b in bpc]
        hit = kv.lookup("check", tokens)
        assert hit.hit_chunks == chunks
        kv.retrieve(hit, dst).wait(30)
        torch.cuda.synchronize()
        wrong = total = 0
        for g, grp in enumerate(layout.groups):
            rows = range(len(src[g])) if grp.kind == "attention" else [chunks * bpc[g] - 1]
            for t, w in zip(pools[g], want[g], strict=True):
                for r in rows:
                    total += 1
                    wrong += not torch.equal(t[dst[g][r]], w[r])
    return wrong, total


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("preset,tp", [("tiny-hybrid", 1), ("qwen3.6-27b", 8)])
def test_a_store_ordered_on_the_engine_stream_is_read_before_later_writes(server_factory, preset, tp):
    """The stored pages are the ones before the engine's overwrite (results/h200/2026-12-01-late has the
    negative control: without the stream wait, some are not)."""
    wrong, _ = ordered_store_wrong_pages(server_factory(l1_gib=2.0).endpoint, preset, tp, ordered=True)
    assert wrong == 0, f"{wrong} stored pages hold the engine's later writes"
