"""A store prepared ahead (`prepare_store` when the request is scheduled, `store(prepared=...)` after its
prefill) against a real server: the same bytes, the same delta-awareness, limits and clean-up as a store
that prepares itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools
from serverkit import module_server

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUT = preset_layout("tiny-hybrid")
NUM_BLOCKS = 64


def counters(endpoint: str) -> dict:
    with CacheClient(endpoint, timeout_s=10) as c:
        return c.call(P.Stats())[0].counters


def wait_for(pred, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if v := pred():
            return v
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s")


@pytest.fixture(scope="module")
def shared():
    """One server for the tests that check a store's own path, not a server's start: each test's engine registers
    under a salt of its own (its keys are no other test's) and compares counters with their values before it."""
    with module_server(l1_gib=0.05) as s:
        yield s


def salted(request) -> TransferConfig:
    return TransferConfig(salt=request.node.name)


@pytest.fixture
def engine(shared, request):
    """(server, kv, pools, allocator) on the module's server, the engine salted by the test's name."""
    pools = vllm_pools(LAYOUT, NUM_BLOCKS, DEVICE)
    fill_random(pools, 3)
    with KVTransfer(shared.endpoint, LAYOUT, pools, salted(request)) as kv:
        yield shared, kv, pools, BlockAllocator(NUM_BLOCKS)


def delta(endpoint: str, before: dict) -> dict:
    """The server's counters less their values in `before`."""
    return {k: v - before.get(k, 0) for k, v in counters(endpoint).items() if isinstance(v, int | float)}


def prompt(kv: KVTransfer, chunks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 150_000, chunks * kv.chunk_tokens + 3)


def blocks_for(kv: KVTransfer, alloc: BlockAllocator, chunks: int) -> list[list[int]]:
    return [alloc.allocate(chunks * (kv.chunk_tokens // g.block_tokens) + 1) for g in LAYOUT.groups]


def assert_loaded(kv: KVTransfer, pools, src: list[list[int]], dst: list[list[int]], chunks: int) -> None:
    """The retrieve of `chunks` chunks (boundary policy) wrote into `dst` what the store read from `src`."""
    for g, grp in enumerate(LAYOUT.groups):
        bpc = kv.chunk_tokens // grp.block_tokens
        moved = range(chunks * bpc) if grp.kind == "attention" else [chunks * bpc - 1]
        for t in pools[g]:
            for j in moved:
                assert torch.equal(t[dst[g][j]], t[src[g][j]]), (g, j)


@pytest.mark.parametrize("blocks_at_prepare", ["none", "same", "other"])
def test_prepared_store_round_trips_and_times_the_prepare_apart(engine, blocks_at_prepare):
    """Blocks given to the prepare are planned ahead; a store from other blocks plans its own."""
    srv, kv, pools, alloc = engine
    tokens, src = prompt(kv, 3, 1), blocks_for(kv, alloc, 3)
    early = {"none": None, "same": src, "other": blocks_for(kv, alloc, 3)}[blocks_at_prepare]
    before = counters(srv.endpoint)
    prep = kv.prepare_store("a", tokens, block_ids=early)
    assert (prep.pages is not None) == (early is not None)
    reply = prep.wait(10)
    assert len(reply.slots) == 3 + 3 and not reply.present  # 3 attention objects, 3 boundary states
    assert delta(srv.endpoint, before)["reservations"] == 1
    h = kv.store("a", tokens, src, prepared=prep).wait_committed(10)
    assert h.objects == 6 and h.nbytes == sum(s.length for s in reply.slots)
    assert h.t_prepare == prep.t_submit < h.t_submit <= h.t_copy_start <= h.t_done <= h.t_committed
    assert h.span_s > h.total_s > 0
    kv.end_session("a")
    st = delta(srv.endpoint, before)
    assert st["reservations"] == 0 and st["objects_committed"] == 6
    hit = kv.lookup("b", tokens)
    assert hit.hit_chunks == 3
    dst = blocks_for(kv, alloc, 3)
    kv.retrieve(hit, dst).wait(10)
    assert_loaded(kv, pools, src, dst, 3)
    kv.end_session("b")


def test_a_store_without_prepare_sends_its_own(engine):
    _, kv, _, alloc = engine
    tokens = prompt(kv, 2, 2)
    h = kv.store("a", tokens, blocks_for(kv, alloc, 2)).wait_committed(10)
    assert h.objects == 5 and h.t_prepare == h.t_submit and h.span_s == h.total_s
    kv.end_session("a")
    assert kv.lookup("b", tokens).hit_chunks == 2
    kv.end_session("b")


def test_delta_aware_objects_present_at_the_prepare_are_not_copied(engine):
    _, kv, _, alloc = engine
    tokens = prompt(kv, 3, 4)
    kv.store("a", tokens[:2 * kv.chunk_tokens], blocks_for(kv, alloc, 2)).wait_committed(10)
    kv.end_session("a")
    blocks = blocks_for(kv, alloc, 3)
    prep = kv.prepare_store("b", tokens, block_ids=blocks)  # the plan's engine half lists all 6 objects
    h = kv.store("b", tokens, blocks, prepared=prep).wait_committed(10)
    # chunks 0-1's attention is held: chunk 2's attention and its 3 boundary states move
    assert (h.objects, h.skipped, h.refused) == (4, 2, 0)
    kv.end_session("b")


def test_end_session_aborts_a_prepare_whose_store_never_comes(engine):
    srv, kv, _, alloc = engine
    tokens = prompt(kv, 2, 5)
    before = counters(srv.endpoint)
    prep = kv.prepare_store("a", tokens)
    assert len(prep.wait(10).slots) == 5
    st = delta(srv.endpoint, before)
    assert st["reservations"] == 1 and st["l1_unready_objects"] == 5
    assert kv.end_session("a") >= 1
    st = delta(srv.endpoint, before)
    assert st["reservations"] == 0 and st["l1_unready_objects"] == 0 and st["l1_objects"] == 0
    # the store that comes too late fails clearly, and nothing of it becomes visible
    h = kv.store("a", tokens, blocks_for(kv, alloc, 2), prepared=prep)
    with pytest.raises(ServerError, match="unknown_reservation"):
        h.wait_committed(10)
    assert kv.lookup("b", tokens).hit_chunks == 0
    kv.end_session("b")
    # and the objects are free to be stored again
    h = kv.store("c", tokens, blocks_for(kv, alloc, 2)).wait_committed(10)
    assert h.objects == 5


def test_bad_block_ids_abort_the_prepared_reservation(engine):
    srv, kv, _, _ = engine
    tokens = prompt(kv, 2, 6)
    before = counters(srv.endpoint)
    prep = kv.prepare_store("a", tokens)
    with pytest.raises(ValueError, match="needs 2"):
        kv.store("a", tokens, [[0]] * len(LAYOUT.groups), prepared=prep)
    wait_for(lambda: delta(srv.endpoint, before)["objects_aborted"] == 5)
    assert delta(srv.endpoint, before)["reservations"] == 0
    with pytest.raises(ValueError, match="used by a store already"):
        kv.store("a", tokens, [[0, 1]] * len(LAYOUT.groups), prepared=prep)


def test_bad_block_ids_at_the_prepare_reserve_nothing(engine):
    srv, kv, _, _ = engine
    tokens = prompt(kv, 2, 10)
    before = counters(srv.endpoint)
    with pytest.raises(ValueError, match="needs 2"):
        kv.prepare_store("a", tokens, block_ids=[[0]] * len(LAYOUT.groups))
    with pytest.raises(ValueError, match=f"block id {NUM_BLOCKS + 3}"):
        kv.prepare_store("a", tokens, block_ids=[[0, NUM_BLOCKS + 3]] * len(LAYOUT.groups))
    wait_for(lambda: delta(srv.endpoint, before)["reservations"] == 0)
    assert delta(srv.endpoint, before)["l1_objects"] == 0


def test_a_prepare_matches_its_store(engine):
    _, kv, _, alloc = engine
    tokens = prompt(kv, 2, 7)
    prep = kv.prepare_store("a", tokens)
    blocks = blocks_for(kv, alloc, 2)
    with pytest.raises(ValueError, match="does not match"):
        kv.store("other", tokens, blocks, prepared=prep)
    with pytest.raises(ValueError, match="does not match"):
        kv.store("a", tokens[:kv.chunk_tokens], blocks, prepared=prep)
    with pytest.raises(ValueError, match="does not match"):
        kv.store("a", tokens, blocks, start_chunk=1, prepared=prep)
    assert kv.store("a", tokens, blocks, prepared=prep).wait_committed(10).objects == 5
    kv.end_session("a")


def test_prepares_count_against_the_reservation_limit(server_factory):
    srv = server_factory("--max-reservations", "1")
    pools = vllm_pools(LAYOUT, NUM_BLOCKS, DEVICE)
    alloc = BlockAllocator(NUM_BLOCKS)
    with KVTransfer(srv.endpoint, LAYOUT, pools) as kv:
        t1, t2 = prompt(kv, 2, 8), prompt(kv, 2, 9)
        p1 = kv.prepare_store("a", t1)
        p1.wait(10)
        p2 = kv.prepare_store("b", t2)
        with pytest.raises(ServerError, match="limit"):
            p2.wait(10)
        h2 = kv.store("b", t2, blocks_for(kv, alloc, 2), prepared=p2)
        with pytest.raises(ServerError, match="limit"):
            h2.wait_committed(10)
        assert kv.store("a", t1, blocks_for(kv, alloc, 2), prepared=p1).wait_committed(10).objects == 5
        kv.end_session("a")
        kv.end_session("b")
        assert counters(srv.endpoint)["reservations"] == 0


_CHILD = textwrap.dedent("""
    import sys
    import time
    from hybridkv.engine.transfer import KVTransfer
    from hybridkv.model.presets import preset_layout
    from hybridkv_bench.pools import vllm_pools
    layout = preset_layout("tiny-hybrid")
    kv = KVTransfer({endpoint!r}, layout, vllm_pools(layout, 16, "cpu"))
    prep = kv.prepare_store("r", list(range(2 * kv.chunk_tokens)))
    print(len(prep.wait(10).slots), flush=True)
    time.sleep(600)
""")


def test_a_prepare_of_an_engine_that_vanished_is_reclaimed(server_factory):
    srv = server_factory("--client-timeout", "1", "--quarantine", "0.2")
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(endpoint=srv.endpoint)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "5", line or child.stderr.read()
        assert counters(srv.endpoint)["reservations"] == 1
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
        child.stderr.close()
    st = wait_for(lambda: (s := counters(srv.endpoint))["reservations_reclaimed"] == 1 and s)
    assert st["reservations"] == 0 and st["l1_objects"] == 0 and st["objects_committed"] == 0


def test_close_waits_for_commits_in_flight(shared, request):
    """Commits resolve on the client's I/O thread; closing the engine right after a store still lands it."""
    srv = shared
    pools = vllm_pools(LAYOUT, NUM_BLOCKS, DEVICE)
    alloc = BlockAllocator(NUM_BLOCKS)
    before = counters(srv.endpoint)
    kv = KVTransfer(srv.endpoint, LAYOUT, pools, salted(request))
    tokens = prompt(kv, 3, 11)
    handles = [kv.store(f"r{i}", tokens[:(i + 1) * kv.chunk_tokens], blocks_for(kv, alloc, i + 1))
               for i in range(3)]
    kv.close()
    assert all(h.committed.done() and h.committed.exception() is None for h in handles)
    assert delta(srv.endpoint, before)["objects_committed"] == sum(h.objects for h in handles) > 0
    with KVTransfer(srv.endpoint, LAYOUT, pools, salted(request)) as again:
        assert again.lookup("q", tokens).hit_chunks == 3
        again.end_session("q")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_caller_queues_the_copies_of_an_answered_store_and_of_a_retrieve(engine):
    """shm on CUDA: store(prepared=) with the reservation answered, and retrieve(), queue their copies before
    they return (no hand-off to a worker before the first byte moves); the bytes are the same."""
    srv, kv, pools, alloc = engine
    tokens, src = prompt(kv, 2, 21), blocks_for(kv, alloc, 2)
    prep = kv.prepare_store("q", tokens, block_ids=src)
    prep.wait(10)
    h = kv.store("q", tokens, src, prepared=prep)
    assert h.t_copy_issued > 0  # queued on this thread, before store() returned
    h.wait_committed(10)
    assert h.t_copy_start <= h.t_copy_issued <= h.t_done <= h.t_committed
    if kv.route.fenced:  # the default: the commit leaves with the copies, before the worker sees them end
        assert h.t_copy_issued <= h.t_commit_sent <= h.t_done
    else:
        assert h.t_done <= h.t_commit_sent <= h.t_committed
    kv.end_session("q")
    hit = kv.lookup("r", tokens)
    dst = blocks_for(kv, alloc, 2)
    r = kv.retrieve(hit, dst)
    assert r.t_copy_issued > 0
    r.wait(10)
    assert hit.hit_chunks == 2
    assert_loaded(kv, pools, src, dst, 2)
    kv.end_session("r")
