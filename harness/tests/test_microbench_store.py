"""Microbenchmarks of the fixed cost of a store and of a load (issue 15), against a real server process.

Pages of 64 B in the Qwen3.6-27B TP8 rank's shape (4 groups x 16 layers, one block per chunk), so the copy
is negligible and what is timed is what every store pays whatever its size: the hand-offs, the plan, the
round trips. `store_unprepared` pays the prepare round trip on its critical path; `store_prepared` had
its reservation (and its plan's engine half) made ahead, as an engine does when it schedules a request.
`python -m hybridkv_bench.microbench.fixed_cost` prints the step-by-step breakdown for every preset.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile

import numpy as np
import pytest
import torch
from hybridkv.engine.transfer import KVTransfer
from hybridkv.model.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv_bench.microbench.fixed_cost import LOAD_STEPS, STORE_STEPS, profile, small_pages
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools
from hybridkv_kernels import PagedLayers, build_plan, plan_pages

pytestmark = pytest.mark.benchmark

LAYOUT = small_pages(preset_layout("qwen3.6-27b", 8), 64)
CHUNKS = 2


@pytest.fixture(scope="module")
def endpoint():
    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    s = start_server(ServerConfig(endpoint=f"ipc://{d}/s.sock", l1_bytes=int(0.05 * GIB)))
    try:
        yield s.endpoint
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def kv(endpoint):
    pools = vllm_pools(LAYOUT, 4 * 2 * (CHUNKS + 1), "cpu")
    fill_random(pools, 0)
    with KVTransfer(endpoint, LAYOUT, pools) as t:
        yield t


@pytest.fixture(scope="module")
def blocks(kv):
    alloc = BlockAllocator(4 * 2 * (CHUNKS + 1))
    return [alloc.allocate(CHUNKS + 1) for _ in LAYOUT.groups]


_fresh = itertools.count()


def _prompt(kv: KVTransfer) -> np.ndarray:
    """A prompt no earlier round stored: every store moves all its objects."""
    t = np.random.default_rng(next(_fresh)).integers(0, 150_000, CHUNKS * kv.chunk_tokens + 1)
    t[0] = next(_fresh)
    return t


@pytest.mark.parametrize("prepared", [False, True], ids=["store_unprepared", "store_prepared"])
def test_store_fixed_cost_2_chunks(benchmark, kv, blocks, prepared):
    handles = []
    ended: list[str] = []

    def setup():
        while ended:  # the previous round's session, outside the timed store
            kv.end_session(ended.pop())
        tokens = _prompt(kv)
        rid = f"r{next(_fresh)}"
        prep = kv.prepare_store(rid, tokens, block_ids=blocks) if prepared else None
        if prep is not None:
            prep.wait(10)  # answered before the store is submitted, as after a prefill
        return (rid, tokens, prep), {}

    def store(rid, tokens, prep):
        handles.append(kv.store(rid, tokens, blocks, prepared=prep).wait_committed(10))
        ended.append(rid)

    benchmark.pedantic(store, setup=setup, rounds=50, warmup_rounds=2)
    assert handles and all(h.objects == CHUNKS + 3 and h.refused == 0 for h in handles)
    assert all((h.t_prepare < h.t_submit) == prepared for h in handles)


def test_load_fixed_cost_2_chunks(benchmark, kv, blocks):
    tokens = _prompt(kv)
    kv.store("stored", tokens, blocks).wait_committed(10)
    kv.end_session("stored")

    def load():
        hit = kv.lookup("l", tokens)
        h = kv.retrieve(hit, blocks).wait(10)
        kv.end_session("l")
        return hit, h

    hit, h = benchmark(load)
    assert hit.hit_chunks == CHUNKS and h.objects == CHUNKS + 3


def _qwen36_71_chunks():
    views = [[torch.empty(150, 64, dtype=torch.uint8)[:, :64] for _ in range(16)] for _ in range(4)]
    groups = [PagedLayers.from_views(v) for v in views]
    arena = torch.empty(74 * 16 * 64, dtype=torch.uint8)
    objs = list(torch.split(arena, 16 * 64))
    # a boundary store: 71 attention objects, the 3 recurrent groups' state at the last chunk
    return [(groups[0], np.array([2 * c]), objs[c]) for c in range(71)] + \
        [(groups[g], np.array([141]), objs[70 + g]) for g in range(1, 4)]


def test_plan_bind_71_chunks_qwen36(benchmark):
    """What is left of planning on a prepared store's critical path: binding slots to the engine half."""
    transfers = _qwen36_71_chunks()
    half = plan_pages("gather", [(layers, ids) for layers, ids, _ in transfers])
    plan = benchmark(half.bind, [obj for _, _, obj in transfers])
    ref = build_plan("gather", transfers)
    assert plan.num_pages == ref.num_pages == 74 * 16
    np.testing.assert_array_equal(plan.dst_addr, ref.dst_addr)


def test_fixed_cost_profile_times_every_step(endpoint):
    """The profiler behind the closing note's breakdown runs its steps for real (two rounds, one chunk)."""
    row = profile(endpoint, small_pages(preset_layout("qwen3-next-80b-a3b"), 64), chunks=1, rounds=2)
    steps = ("keys", "prepare_rt", "object_blocks", "build_plan", "run_plan", "commit_rt", "store",
             "store_prepared", "lookup_rt", "load", *(f"{w}.{s}" for w in ("store", "store_prepared")
                                                      for s in STORE_STEPS), *(f"load.{s}" for s in LOAD_STEPS))
    assert all(row[k] > 0 for k in steps), row
    for whole in ("store", "store_prepared", "load"):  # each step lies inside its whole, round by round
        for s in LOAD_STEPS if whole == "load" else STORE_STEPS:
            assert row[f"{whole}.{s}"] <= row[whole], (whole, s, row)


def test_idle_round_trips_time_every_gap(endpoint):
    """The idle-gap probe (why a commit after its copies costs more than a round trip in a loop) runs for real."""
    from hybridkv_bench.microbench.fixed_cost import IDLE_GAPS_S, idle_round_trips

    row = idle_round_trips(endpoint, rounds=2)
    assert len(row) == len(IDLE_GAPS_S) and all(v > 0 for v in row.values()), row


def test_commit_latencies_time_both_commits_after_every_copy_time(endpoint):
    """The protocol's part of a commit, classic (a round trip after the copies) and fenced (sent before them,
    answered once the fence word shows), runs for real: every store it makes is committed and visible."""
    from hybridkv_bench.microbench.fixed_cost import IDLE_GAPS_S, commit_latencies

    row = commit_latencies(endpoint, rounds=2)
    assert len(row) == 2 * len(IDLE_GAPS_S) and all(v > 0 for v in row.values()), row
    assert {k.split()[0] for k in row} == {"after_copies", "fenced"}


def test_issue_profile_profiles_the_library_s_queueing(endpoint):
    """--cprofile runs PageCopies.issue for a prepared store and a load, and reports it."""
    from hybridkv_bench.microbench.fixed_cost import profile_issue

    out = profile_issue(endpoint, small_pages(preset_layout("qwen3-next-80b-a3b"), 64), chunks=1, rounds=1,
                        device="cpu", top=40)
    assert "copies.py" in out and "(issue)" in out, out
