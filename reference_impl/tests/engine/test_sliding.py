"""Sliding-window groups through a real server, the engine's blocks as vLLM's SlidingWindowManager leaves them
(every block wholly before t - window + 1 freed, a HOLE in the block list): a store leaves out the chunks whose
tail it can no longer read, a lookup needs only the objects the window of its hit reads, and a retrieve writes
only the blocks the engine holds, a partly needed chunk's object in part."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybridkv.engine.transfer import HOLE, KVTransfer, TransferConfig
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA the copies are the kernel's and DMA's
WINDOW, BLOCK, CHUNK = 40, 16, 32  # a resume needs 39 tokens: 3 blocks, one chunk and half of the one before
PAGE = 512
SENTINEL = 0xA5
LAYOUT = ModelLayout(model="sliding-test", groups=(
    GroupLayout(kind="sliding", layer_names=("model.layers.0", "model.layers.2"), page_bytes=PAGE,
                block_tokens=BLOCK, window=WINDOW),
    GroupLayout(kind="attention", layer_names=("model.layers.1", "model.layers.3"), page_bytes=PAGE,
                block_tokens=BLOCK)))


def as_vllm_holds(blocks: list[int], t: int) -> list[int]:
    """A sliding group's block list at t processed tokens: vLLM frees the blocks wholly before t - window + 1."""
    first = max(0, t - WINDOW + 1) // BLOCK
    return [HOLE if j < first else b for j, b in enumerate(blocks)]


@pytest.fixture
def kv(server_factory):
    pools = vllm_pools(LAYOUT, 96, DEVICE)
    fill_random(pools, 11)
    with KVTransfer(server_factory().endpoint, LAYOUT, pools, TransferConfig(chunk_tokens=CHUNK)) as t:
        yield t, pools, BlockAllocator(96)


def store_step_by_step(t: KVTransfer, rid: str, tokens, src, chunks: int, drop: int | None = None) -> None:
    """As the connector stores under vLLM: chunk k in the step that computes it, from the blocks vLLM holds then
    (`drop`: that chunk's sliding tail freed already, as a store that came late would find it)."""
    for k in range(chunks):
        sliding = as_vllm_holds(src[0][:2 * (k + 1)], (k + 2) * CHUNK if k == drop else k * CHUNK)
        h = t.store(rid, tokens[:(k + 1) * CHUNK], [sliding, src[1][:2 * (k + 1)]], start_chunk=k)
        h.wait_committed(30)
        assert h.objects == (1 if k == drop else 2)


@pytest.mark.parametrize("copy_engine", ["auto", "kernel"])
def test_the_window_is_all_a_hit_needs_and_all_a_retrieve_writes(server_factory, copy_engine):
    pools = vllm_pools(LAYOUT, 96, DEVICE)
    fill_random(pools, 12)
    alloc = BlockAllocator(96)
    with KVTransfer(server_factory().endpoint, LAYOUT, pools,
                    TransferConfig(chunk_tokens=CHUNK, copy_engine=copy_engine)) as t:
        _window_case(t, pools, alloc)


def _window_case(t: KVTransfer, pools, alloc: BlockAllocator) -> None:
    tokens = np.random.default_rng(1).integers(0, 50_000, 12 * CHUNK + 7)
    src = [alloc.allocate(24), alloc.allocate(24)]
    store_step_by_step(t, "a", tokens, src, 12, drop=3)
    hit = t.lookup("b", tokens)
    assert hit.hit_chunks == 12  # chunk 3's sliding object is missing, out of the window of 12 chunks
    # the attention objects of every chunk, the sliding ones of the chunks the window reaches: tokens 345..
    assert sorted((o.chunk, o.group) for o in hit.objects if o.group == 0) == [(10, 0), (11, 0)]
    dst = [alloc.allocate(24), alloc.allocate(24)]
    for g, ids in enumerate(dst):
        for layer in pools[g]:
            layer[ids] = SENTINEL
    held = as_vllm_holds(dst[0], 12 * CHUNK)  # vLLM's table after a hit of 384 tokens: blocks 21, 22, 23
    assert [j for j, b in enumerate(held) if b != HOLE] == [21, 22, 23]
    h = t.retrieve(hit, [held, dst[1]]).wait(30)
    assert h.nbytes == (3 + 24) * 2 * PAGE  # 2 layers each: 3 sliding blocks (of the 4 the objects hold), 24
    for layer in range(2):
        assert torch.equal(pools[1][layer][dst[1]], pools[1][layer][src[1]])
        assert torch.equal(pools[0][layer][dst[0][21:]], pools[0][layer][src[0][21:]])
        # chunk 10's object holds blocks 20 and 21; block 20 was a hole: nothing was written for it anywhere
        assert bool((pools[0][layer][dst[0][:21]] == SENTINEL).all())
    t.end_session("b")
    # a resume at 4 chunks needs the sliding objects of chunks 2 and 3 (tokens 89..): with chunk 3's missing, the
    # longest is 3 chunks (tokens 57.., chunks 1 and 2)
    assert t.lookup("c", tokens[:4 * CHUNK]).hit_chunks == 3
    t.end_session("c")


def test_a_store_leaves_out_the_chunks_whose_tail_was_freed(kv):
    t, _, alloc = kv
    tokens = np.random.default_rng(2).integers(0, 50_000, 12 * CHUNK)
    src = [alloc.allocate(24), alloc.allocate(24)]
    # all 12 chunks in one store at the end: the sliding tails of chunks 0-10 are gone (block 20 is; 21 is not)
    h = t.store("late", tokens, [as_vllm_holds(src[0], 12 * CHUNK), src[1]]).wait_committed(30)
    assert h.objects == 12 + 1
    # chunk 11 alone has its sliding object: a resume at 12 chunks also needs chunk 10's, and at any shorter length
    # the window's chunks are missing too
    assert t.lookup("x", tokens).hit_chunks == 0
    t.end_session("x")
