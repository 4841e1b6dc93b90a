"""A warm request's load on the worker: it copies the objects the scheduler side's lookup pinned (no lookup of its
own), on a CPU within the step that starts it, and looks the hit up itself only where those pins cannot be read."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from vllmkit import C, counters, run, settle, tokens, worker_stats


def _stored(serve, make_engine):
    """A server holding A's 5 chunks and an engine whose local prefix cache forgot them; B shares A's chunks."""
    srv = serve("--admin")
    eng = make_engine(srv.endpoint, retention=0)
    a = tokens(5 * C + 17, 70)
    assert run(eng, "A", a).corrupt_pages == 0
    settle(eng)
    return srv, eng, a[:5 * C] + tokens(150, 71)


def test_a_warm_load_reads_the_scheduler_s_pins_and_ends_in_the_step_that_starts_it(serve, make_engine):
    srv, eng, b = _stored(serve, make_engine)
    before = counters(srv.endpoint)
    eng.add_request("B", b)
    so, _ = eng.step()  # vLLM takes the hit: B waits for its load, which this step's worker starts
    assert not so.scheduled_new_reqs
    # a CPU load copies in start_load: the step that started it reports it, and the next one schedules B
    assert worker_stats(eng).loads == 1 and worker_stats(eng).load_failures == 0
    so, rep = eng.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 5 * C
    assert rep.verified_pages > 0 and rep.corrupt_pages == 0
    # one round trip for the hit: the scheduler's lookup; the worker copied the objects it pinned
    assert counters(srv.endpoint)["lookups"] - before["lookups"] == 1
    assert worker_stats(eng).loads_pinned == 1
    assert eng.run().corrupt_pages == 0
    eng.worker.worker_side.wait_idle(10)
    eng.scheduler.connector.scheduler_side.wait_idle(10)
    assert counters(srv.endpoint)["leases"] == 0  # the scheduler's pins end with the request


def test_a_warm_request_stores_only_past_its_hit(serve, make_engine):
    """The hit's chunks are the server's: the warm request's first step prepares no store of them again (it would
    copy nothing, and its prepare of every chunk is on the request's time to first token)."""
    srv, eng, b = _stored(serve, make_engine)
    eng.add_request("B", b)
    eng.step()
    so, _ = eng.step_until_scheduled()
    stores = [job for job in so.kv_connector_metadata.stores if job.request_id == "B"]
    assert stores and all(job.start_chunk == 5 for job in stores)
    assert eng.run().corrupt_pages == 0


def test_pins_in_another_arena_are_looked_up_by_the_worker(serve, make_engine):
    """Offsets into an arena this rank does not map (a server restarted between the lookup and the load) would
    read other bytes: the worker pins the hit itself, in the arena it maps."""
    srv, eng, b = _stored(serve, make_engine)
    before = counters(srv.endpoint)
    eng.add_request("B", b)

    def elsewhere(so) -> None:
        for job in so.kv_connector_metadata.loads:
            assert job.pinned is not None
            job.pinned.arena = job.pinned.arena + ".another-server"

    eng.step(after_schedule=elsewhere)
    so, rep = eng.step_until_scheduled()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 5 * C
    assert rep.verified_pages > 0 and rep.corrupt_pages == 0
    assert counters(srv.endpoint)["lookups"] - before["lookups"] == 2  # the scheduler's, then the worker's
    assert worker_stats(eng).loads_pinned == 0 and worker_stats(eng).loads == 1
    assert eng.run().corrupt_pages == 0
