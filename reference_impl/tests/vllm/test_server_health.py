"""The cache server stalls or restarts under vLLM's real scheduler: no hit offered after the server answers again
is lost. Both halves of the connector register again the moment the server answers (no `retry_s` wait: it is
set to a minute here), a restarted server is registered with at once, and a load planned while a worker is
still registering waits for it."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv.engine.client import CacheClient
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P
from vllmkit import C, run, sched_stats, settle, tokens, worker_stats

FAST = dict(lookup_timeout_s=0.3, timeout_s=1.0, retry_s=60.0)


def answering(endpoint: str) -> None:
    """Wait until the server answers (it resumed, or its restart is listening)."""
    with CacheClient(endpoint, timeout_s=30) as c:
        c.call(P.Health())


def hit_of(eng, rid: str, toks: list[int]) -> int:
    """The tokens request `rid` resumed from (vLLM's prefix cache dropped first: only hybridkv can give them)."""
    settle(eng)
    eng.add_request(rid, toks)
    so, _ = eng.step_until_scheduled()
    eng.run()
    return so.scheduled_new_reqs[0].num_computed_tokens


def test_a_stall_after_the_lookup_costs_no_load_and_no_later_hit(serve, make_engine):
    """The server stops after the scheduler offered a hit, before the worker's load: the worker reads the objects
    the scheduler's lookup pinned straight from the arena, so the stall fails no load; the next hits load."""
    srv = serve()
    eng = make_engine(srv.endpoint, **FAST)
    a = tokens(3 * C + 3, 20)
    run(eng, "A", a)
    settle(eng)
    cont = threading.Timer(0.6, os.kill, (srv.pid, signal.SIGCONT))
    eng.add_request("B", a)
    try:
        eng.step(after_schedule=lambda so: (os.kill(srv.pid, signal.SIGSTOP), cont.start()))
        eng.run()
    finally:
        cont.join()
        os.kill(srv.pid, signal.SIGCONT)
    assert worker_stats(eng).load_failures == 0 and worker_stats(eng).loads_pinned == 1
    answering(srv.endpoint)
    assert hit_of(eng, "C", a) == 3 * C
    assert hit_of(eng, "D", a) == 3 * C
    assert worker_stats(eng).load_failures == 0


def test_a_stall_that_fails_a_lookup_loses_no_later_hit(serve, make_engine):
    """The scheduler's own lookup times out while the server is stopped (a miss); once it resumes the next
    request hits."""
    srv = serve()
    eng = make_engine(srv.endpoint, **FAST)
    a = tokens(3 * C + 3, 21)
    run(eng, "A", a)
    settle(eng)
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        run(eng, "B", a)
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    assert sched_stats(eng).hit_tokens == 0 and sched_stats(eng).lookup_failures == 1
    answering(srv.endpoint)
    if (attempt := eng.scheduler.connector.scheduler_side.link._reconnecting) is not None:
        attempt.result(timeout=30)  # its probe heard the server (on a busy machine its thread may lag the test's)
    assert hit_of(eng, "C", a) == 3 * C
    assert worker_stats(eng).load_failures == 0


@pytest.fixture
def fixed_endpoint(sock_dir):
    """start() -> a server at one endpoint, again after each stop; all stopped at the end."""
    procs, dirs = [], []
    endpoint = f"ipc://{sock_dir}/restarted.sock"

    def start():
        dirs.append(tempfile.mkdtemp(prefix="hkv-", dir="/dev/shm"))
        procs.append(start_server(parse([f"--endpoint={endpoint}", "--l1-dir", dirs[-1], "--l1-gib=0.05"])))
        return procs[-1]

    yield start
    for s in procs:
        s.close()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def test_hits_come_back_on_the_next_request_after_a_restart(fixed_endpoint, make_engine):
    srv = fixed_endpoint()
    eng = make_engine(srv.endpoint, **FAST)
    a = tokens(3 * C + 3, 22)
    run(eng, "A", a)
    settle(eng)
    srv.close()
    fixed_endpoint()  # empty, at the same endpoint: it knows neither side's registration
    answering(srv.endpoint)
    b = tokens(4 * C + 5, 23)
    run(eng, "B", b)  # the first request after the restart: a miss (empty server), its stores kept
    assert hit_of(eng, "C", b) == 4 * C
    assert worker_stats(eng).load_failures == 0


def test_no_hit_offered_while_a_worker_is_refused(serve, make_engine):
    """The server forgets the worker's registration and, at its engine limit, refuses the next one while the
    scheduler's stays: the hit offered before the scheduler could know still loads (from the scheduler's pins),
    the worker's stores meet the refusal, it reports its state, and the scheduler offers no further hit."""
    srv = serve("--max-engines", "2")  # the scheduler's registration and the worker's
    eng = make_engine(srv.endpoint, **FAST)
    a = tokens(3 * C + 3, 25)
    run(eng, "A", a)
    settle(eng)
    ws = eng.worker.worker_side
    ws.transfer.client.call(P.Unregister(engine=ws.transfer.engine_id))
    with CacheClient(srv.endpoint, timeout_s=10) as other:
        other.call(P.Register(layout=ws.layout, chunk_tokens=ws.chunk_tokens, name="takes-the-last-slot"))
        # offered before the scheduler could know: it loads from the scheduler's pins, and stores a chunk of its
        # own past them (a warm request stores nothing of its hit: the server holds it)
        run(eng, "B", a[:3 * C] + tokens(C + 3, 26))
        assert worker_stats(eng).load_failures == 0 and worker_stats(eng).loads_pinned == 1
        # B's stores met the refusal: the worker dropped its connection, registers again (refused) and reports
        # it with its next step's output, which may come after the scheduler offered C: at most that one
        # load fails (a recompute); from then on no hit is offered
        planned = sched_stats(eng).loads_planned
        hit_of(eng, "C", a)
        assert sched_stats(eng).loads_planned - planned == worker_stats(eng).load_failures <= 1
        planned = sched_stats(eng).loads_planned
        for rid in ("D", "E"):
            assert hit_of(eng, rid, a) == 0
        assert sched_stats(eng).loads_planned == planned
