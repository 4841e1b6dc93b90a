"""A request whose cached prefix was pushed out to L2: the scheduler side starts the reads (Prefetch) and
answers vLLM "not yet", so the request waits in vLLM's queue while the scheduler goes on; a later step's
lookup finds the prefix in L1 and the load is exact. With `l2_wait_s = 0` the lookup waits on L2 itself."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv.engine.client import CacheClient
from hybridkv.wire import protocol as P
from serverkit import Engine
from vllmkit import C, counters, hits_by_source, run, sched_stats, settle, tokens, worker_stats

L1_GIB = 1 / 1024  # 1 MiB: a few dozen objects of the tiny model and of the filler


def push_out_to_l2(endpoint: str) -> None:
    """Another engine stores enough to evict everything older from L1 (spilled to L2 first), then its reads
    and spills settle."""
    with CacheClient(endpoint, timeout_s=20) as c:
        filler = Engine(c, salt="filler")
        keys = filler.keys(48, seed=7)
        for i in range(0, len(keys), 4):
            assert not filler.store(keys[i:i + 4], request=f"fill{i}").refused
        deadline = time.monotonic() + 20
        while (s := c.call(P.Stats())[0].counters)["workers_inflight"] or s["parked"]:
            assert time.monotonic() < deadline, s
            time.sleep(0.01)


@pytest.mark.parametrize("l2_wait_s", [30.0, 0.0], ids=["waits-in-queue", "waits-in-lookup"])
def test_a_prefix_in_l2_waits_in_vllm_s_queue_not_in_the_lookup(serve, make_engine, tmp_path, l2_wait_s):
    srv = serve("--l2-dir", str(tmp_path / "l2"), "--l2-gib", "0.25", "--admin", l1_gib=L1_GIB)
    eng = make_engine(srv.endpoint, retention=0, state_every_chunks=0, l2_wait_s=l2_wait_s)
    a = tokens(5 * C + 17, 31)
    assert run(eng, "A", a).corrupt_pages == 0 and worker_stats(eng).stores == 1
    settle(eng)
    push_out_to_l2(srv.endpoint)
    before = counters(srv.endpoint)
    assert before["l1_evictions"] > 0 and before["l2_spills"] > 0
    eng.add_request("B", a[:5 * C] + tokens(40, 32))
    steps_unscheduled = 0
    deadline = time.monotonic() + 30
    while True:
        so, rep = eng.step()
        if so.scheduled_new_reqs:
            break
        steps_unscheduled += 1
        assert time.monotonic() < deadline, "B was never scheduled"
        time.sleep(0.005)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 5 * C  # the whole prefix came back from L2
    assert rep.corrupt_pages == 0 and rep.verified_pages > 0
    assert eng.run().corrupt_pages == 0
    after = counters(srv.endpoint)
    assert after["l2_prefetches"] > before["l2_prefetches"], "the prefix was read back from L2"
    if l2_wait_s:
        # the steps B waited: the deferred lookups, then its asynchronous load
        assert sched_stats(eng).lookups_deferred >= 1 and steps_unscheduled > sched_stats(eng).lookups_deferred
        assert after["lookup_l2_waits"] == before["lookup_l2_waits"], "the lookup did not wait on L2"
        # vLLM's hits-by-source metric names the disk (A's own run looked up nothing: it had no prefix)
        assert hits_by_source(eng) == {"disk": 5 * C} and sched_stats(eng).hit_tokens_l2 == 5 * C
    else:
        assert sched_stats(eng).lookups_deferred == 0
        assert after["lookup_l2_waits"] > before["lookup_l2_waits"]
        # the lookup read L2 itself: the connector cannot tell which tier, and says so
        assert hits_by_source(eng) == {"external_unspecified": 5 * C} and sched_stats(eng).hit_tokens_unknown == 5 * C


def test_a_server_without_l2_costs_no_prefetch_round_trip(serve, make_engine):
    """Nothing can be on disk: the scheduler side looks up at once, with no Prefetch before it."""
    srv = serve("--admin")
    eng = make_engine(srv.endpoint, retention=0, state_every_chunks=0)
    a = tokens(4 * C + 9, 33)
    assert run(eng, "A", a).corrupt_pages == 0
    settle(eng)
    eng.add_request("B", a[:4 * C] + tokens(20, 34))
    so, rep = eng.step_until_scheduled()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 * C and rep.corrupt_pages == 0
    eng.run()
    assert counters(srv.endpoint)["prefetch_requests"] == 0 and sched_stats(eng).lookups_deferred == 0
    assert hits_by_source(eng) == {"host": 4 * C}  # nothing can be on disk: every hit is from memory
