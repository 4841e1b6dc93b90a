"""load_mode "layerwise" with vLLM 0.33's real scheduler (a simulated forward whose attention layers call
wait_for_layer_load before reading): the attention pages of a hit are copied in the step in which vLLM takes the
request out of WAITING_FOR_REMOTE_KVS, a step the scheduler side marks as having loads to wait for before the
forward; the GDN states were loaded before it."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv_bench import vllm_offline as offline
from vllmkit import C, run, sched_stats, settle, tokens, worker_stats


def test_attention_pages_load_in_the_promotion_step_and_states_before_it(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint, load_mode="layerwise")
    a = tokens(5 * C + 17, 40)
    assert run(eng, "A", a).corrupt_pages == 0
    settle(eng)
    eng.add_request("B", a[:5 * C] + tokens(150, 41))
    seen = []

    def before_loads(so) -> None:
        """Right after vLLM's schedule(), before the step's loads: what B's blocks hold."""
        meta = so.kv_connector_metadata
        req = eng.scheduler.requests["B"]
        if meta.step_loads:
            blocks = tuple(list(b) for b in eng.scheduler.kv_cache_manager.get_block_ids("B"))
            rep = offline.StepReport()
            eng.verify("B", blocks, 5 * C, rep)
            seen.append((list(meta.step_loads), so.has_sync_kv_loads, rep.verified_pages, rep.corrupt_pages,
                         req.status.name))

    until = time.monotonic() + 30  # the asynchronous phase ends on the worker's threads: poll as vLLM does
    so, rep = eng.step(after_schedule=before_loads)
    while not so.scheduled_new_reqs:
        assert time.monotonic() < until, "B was never scheduled"
        time.sleep(0.002)
        so, rep = eng.step(after_schedule=before_loads)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 5 * C
    # before its step: the 3 GDN groups x 2 layers hold the state of token 400, the 5 attention blocks x 2 layers
    # nothing yet (the engine zeroed them before the asynchronous phase, which left them alone)
    assert seen == [(["B"], True, 6, 10, "RUNNING")], seen
    # after it, the forward read every page right (the layers waited for the in-step copies)
    assert (rep.verified_pages, rep.corrupt_pages) == (16, 0)
    st = worker_stats(eng)
    assert (st.loads, st.step_loads, st.load_failures) == (1, 1, 0)
    assert st.layer_waits == len(eng.attention_layers) == 2
    assert 0 < st.loaded_bytes < st.step_loaded_bytes
    assert eng.run().corrupt_pages == 0


def test_a_request_aborted_before_its_step_loads_nothing_there(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint, load_mode="layerwise")
    a = tokens(4 * C + 3, 42)
    run(eng, "A", a)
    settle(eng)
    eng.add_request("B", a[:4 * C] + tokens(90, 43))
    eng.step()  # B's asynchronous phase is planned and started
    eng.abort("B")
    for _ in range(50):
        so, _ = eng.step()
        assert not so.kv_connector_metadata.step_loads, "an in-step load of an aborted request"
    assert worker_stats(eng).step_loads == 0
    eng.add_request("C", a[:4 * C] + tokens(90, 44))
    so, rep = eng.step_until_scheduled()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 * C and rep.corrupt_pages == 0
    assert worker_stats(eng).step_loads == 1
    assert eng.run().corrupt_pages == 0


def test_preemption_after_a_layerwise_load_reloads_on_resume(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint, load_mode="layerwise")
    a = tokens(4 * C + 9, 45)
    run(eng, "A", a)
    settle(eng)
    eng.add_request("B", a[:4 * C] + tokens(250, 46))
    so, rep = eng.step_until_scheduled()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 * C and rep.corrupt_pages == 0
    eng.step(after_schedule=lambda so: eng.scheduler.reset_prefix_cache(reset_running_requests=True))
    assert eng.scheduler.requests["B"].num_preemptions == 1
    assert eng.run().corrupt_pages == 0
    assert sched_stats(eng).loads_planned == 2 and worker_stats(eng).step_loads == 2
    assert worker_stats(eng).load_failures == 0
