"""A prepared store's plans are bound to its slots when the prepare is answered (`DirectRoute.prebind`, on the
thread that receives the answer), so the store only queues its copies. On CUDA the caller queues them; the CPU
cases let the caller queue them too (`_in_caller`), which runs the same steps with synchronous copies."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.model.presets import preset_layout
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

NUM_BLOCKS = 64
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pages_equal(kv: KVTransfer, pools, alloc: BlockAllocator, tokens, src) -> bool:
    """Load what `tokens` stored into fresh blocks and compare with the source pages (one chunk)."""
    dst = [alloc.allocate(kv.chunk_tokens // g.block_tokens) for g in kv.layout.groups]
    hit = kv.lookup("check", tokens)
    assert hit.hit_chunks == 1
    kv.retrieve(hit, dst).wait(30)
    kv.end_session("check")
    if kv.device.type == "cuda":
        torch.cuda.synchronize()
    ok = all(torch.equal(t[d], t[s]) for g in range(len(pools)) for t in pools[g]
             for s, d in zip(src[g], dst[g], strict=True))
    for ids in dst:
        alloc.free(ids)
    return ok


def _prebound(device: str, srv, mode: str, monkeypatch) -> None:
    layout = preset_layout("tiny-hybrid", 1)
    pools = vllm_pools(layout, NUM_BLOCKS, device)
    fill_random(pools, 7)
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(srv.endpoint, layout, pools, TransferConfig(commit=mode, salt=f"prebound-{device}-{mode}")) as kv:
        if device == "cpu":
            monkeypatch.setattr(kv.route, "_in_caller", True)
        binds = []
        real_bind = kv.copies.bind
        monkeypatch.setattr(kv.copies, "bind", lambda d, *a, **k: binds.append(d) or real_bind(d, *a, **k))
        ct = kv.chunk_tokens
        src = [alloc.allocate(ct // g.block_tokens) for g in layout.groups]
        other = [alloc.allocate(ct // g.block_tokens) for g in layout.groups]
        for i in range(12):
            tokens = np.random.default_rng(40 + i).integers(0, 150_000, ct)
            prep = kv.prepare_store(f"p{i}", tokens, block_ids=src)
            prep.wait(30)
            n = binds.count("gather")
            assert prep.bound is not None and n == i + 1 + i // 2  # bound on the answer's thread, once
            # every other store reads other blocks than it prepared with: the plans bound ahead do not apply
            blocks = src if i % 2 == 0 else other
            kv.store(f"p{i}", tokens, blocks, prepared=prep).wait_committed(30)
            assert binds.count("gather") == n + (blocks is other)
            kv.end_session(f"p{i}")
            assert _pages_equal(kv, pools, alloc, tokens, blocks), i
        # a store that prepares itself binds once, on its own thread: nothing is bound ahead for it
        tokens = np.random.default_rng(99).integers(0, 150_000, ct)
        before = binds.count("gather")
        kv.store("u", tokens, src).wait_committed(30)
        assert binds.count("gather") == before + 1
        kv.end_session("u")
        assert _pages_equal(kv, pools, alloc, tokens, src)

@pytest.mark.parametrize("mode", ["fenced", "after_copies"])
def test_a_prepared_store_queues_the_plans_bound_when_its_prepare_was_answered(server_factory, mode, monkeypatch):
    """The answer binds the plans once; a store from the same blocks binds nothing more and stores those pages;
    a store from other blocks binds its own and stores those."""
    _prebound("cpu", server_factory(), mode, monkeypatch)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["fenced", "after_copies"])
def test_a_prebound_store_on_cuda_holds_its_pages(server_factory, mode, monkeypatch):
    _prebound("cuda", server_factory(l1_gib=1.0), mode, monkeypatch)


def test_a_prepare_that_fails_leaves_nothing_bound(server_factory, monkeypatch):
    """A prepare the server refuses (unknown engine) binds nothing, and the store reports the error."""
    srv = server_factory()
    layout = preset_layout("tiny-hybrid", 1)
    pools = vllm_pools(layout, NUM_BLOCKS, "cpu")
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(srv.endpoint, layout, pools, TransferConfig(salt="prebound-fail")) as kv:
        monkeypatch.setattr(kv.route, "_in_caller", True)
        src = [alloc.allocate(kv.chunk_tokens // g.block_tokens) for g in layout.groups]
        tokens = np.arange(kv.chunk_tokens)
        monkeypatch.setattr(kv, "engine_id", kv.engine_id + 999)
        prep = kv.prepare_store("f", tokens, block_ids=src)
        with pytest.raises(Exception, match="unknown_engine"):
            prep.wait(30)
        assert prep.bound is None
        with pytest.raises(Exception, match="unknown_engine"):
            kv.store("f", tokens, src, prepared=prep).wait_committed(30)
        monkeypatch.undo()



def _answer_during_load(device: str, srv, monkeypatch) -> None:
    """A prepare answered while a load's copies are being queued: its bind waits until they are queued (then
    runs once, not on the client's I/O thread), and the store from those blocks uses it and stores its pages."""
    layout = preset_layout("tiny-hybrid", 1)
    pools = vllm_pools(layout, NUM_BLOCKS, device)
    fill_random(pools, 11)
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(srv.endpoint, layout, pools, TransferConfig(salt=f"bind-beside-load-{device}")) as kv:
        if device == "cpu":
            monkeypatch.setattr(kv.route, "_in_caller", True)
        ct = kv.chunk_tokens
        src, dst = ([alloc.allocate(ct // g.block_tokens) for g in layout.groups] for _ in range(2))
        stored = np.random.default_rng(1).integers(0, 150_000, ct)
        kv.store("s", stored, dst).wait_committed(30)
        kv.end_session("s")
        binds: list[tuple[str, bool]] = []  # (thread, whether a load's copies were being queued then)
        issuing = [False]
        raw_replies: list = []
        real_bind, real_issue, real_submit = kv.copies.bind, kv.copies.issue, kv.client.submit
        tokens = np.random.default_rng(2).integers(0, 150_000, ct)
        prepared: list = []

        def bind(direction, *a, **k):
            if direction == "gather":
                binds.append((threading.current_thread().name, issuing[0]))
            return real_bind(direction, *a, **k)

        def submit(msg, *a, **k):
            fut = real_submit(msg, *a, **k)
            if type(msg).__name__ == "PrepareStore":
                raw_replies.append(fut)
            return fut

        def issue(h, direction, *a, **k):
            if direction == "scatter":  # the prepare is sent and answered while this load's copies are queued
                issuing[0] = True
                prepared.append(kv.prepare_store("p", tokens, block_ids=src))
                answered = threading.Event()
                # callbacks run in order: once this one runs, the route's own (registered first) has run too
                raw_replies[-1].add_done_callback(lambda f: answered.set())
                assert answered.wait(30)
            try:
                return real_issue(h, direction, *a, **k)
            finally:
                issuing[0] = False

        monkeypatch.setattr(kv.copies, "bind", bind)
        monkeypatch.setattr(kv.client, "submit", submit)
        monkeypatch.setattr(kv.copies, "issue", issue)
        hit = kv.lookup("l", stored)
        kv.retrieve(hit, [list(ids) for ids in src]).wait(30)  # the load writes src: the store below reads it
        kv.end_session("l")
        prep = prepared[0]
        prep.wait(30)
        assert prep.bound is not None
        assert binds == [("hkv-load", False)], binds  # once, after the load's copies were queued, not beside them
        kv.store("p", tokens, src, prepared=prep).wait_committed(30)
        assert len(binds) == 1  # the store queued the plans bound ahead
        kv.end_session("p")
        monkeypatch.undo()
        assert _pages_equal(kv, pools, alloc, tokens, src)


def test_a_prepare_answered_while_a_load_is_queued_binds_after_it(server_factory, monkeypatch):
    _answer_during_load("cpu", server_factory(), monkeypatch)


@cuda
@pytest.mark.cuda
def test_a_prepare_answered_while_a_load_is_queued_binds_after_it_on_cuda(server_factory, monkeypatch):
    _answer_during_load("cuda", server_factory(l1_gib=1.0), monkeypatch)


def test_a_bind_deferred_by_a_load_that_fails_to_queue_still_comes(server_factory, monkeypatch):
    """A load whose copies fail to queue has no load worker step to run the bind its queueing deferred: the bind
    runs once the failure is delivered, so the prepared store's answer resolves (bound) and its store goes on."""
    srv = server_factory()
    layout = preset_layout("tiny-hybrid", 1)
    pools = vllm_pools(layout, NUM_BLOCKS, "cpu")
    fill_random(pools, 12)
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(srv.endpoint, layout, pools, TransferConfig(salt="bind-beside-failed-load")) as kv:
        monkeypatch.setattr(kv.route, "_in_caller", True)
        ct = kv.chunk_tokens
        src, dst = ([alloc.allocate(ct // g.block_tokens) for g in layout.groups] for _ in range(2))
        stored = np.random.default_rng(3).integers(0, 150_000, ct)
        kv.store("s", stored, dst).wait_committed(30)
        kv.end_session("s")
        tokens = np.random.default_rng(4).integers(0, 150_000, ct)
        raw: list = []
        real_submit, prepared = kv.client.submit, []

        def submit(msg, *a, **k):
            fut = real_submit(msg, *a, **k)
            if type(msg).__name__ == "PrepareStore":
                raw.append(fut)
            return fut

        def issue(h, direction, *a, **k):
            prepared.append(kv.prepare_store("p", tokens, block_ids=src))
            answered = threading.Event()
            raw[-1].add_done_callback(lambda f: answered.set())
            assert answered.wait(30)
            assert not prepared[0].reply.done()  # its bind waits for this load's queueing
            raise RuntimeError("queueing failed")

        monkeypatch.setattr(kv.client, "submit", submit)
        monkeypatch.setattr(kv.copies, "issue", issue)
        hit = kv.lookup("l", stored)
        with pytest.raises(RuntimeError, match="queueing failed"):
            kv.retrieve(hit, dst).wait(30)
        kv.end_session("l")
        monkeypatch.undo()
        prep = prepared[0]
        prep.wait(30)
        assert prep.bound is not None
        kv.store("p", tokens, src, prepared=prep).wait_committed(30)
        kv.end_session("p")
        assert _pages_equal(kv, pools, alloc, tokens, src)
