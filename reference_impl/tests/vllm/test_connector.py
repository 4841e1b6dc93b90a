"""The connector end to end: vLLM's scheduler decides, the connector plans, KVTransfer moves bytes through a
real `hybridkv serve`, and every loaded page is checked against what the simulated forward wrote."""

from __future__ import annotations

import os
import signal
import time

import pytest

# "vllm.config", not "vllm": without vLLM, this folder would import as a namespace package named vllm
pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from hybridkv.engine.vllm.settings import ConnectorSettings
from hybridkv.model.layout import LayoutError
from hybridkv_bench import vllm_offline as offline
from vllmkit import C, counters, run, sched_stats, settle, tokens, worker_stats


def test_prefix_hit_loads_a_s_exact_bytes(serve, make_engine):
    srv = serve()
    # vLLM's default retention, and no state asked for by the connector: a state at the prompt's last boundary only
    eng = make_engine(srv.endpoint, retention=0, state_every_chunks=0)
    a = tokens(5 * C + 17, 0)
    assert run(eng, "A", a).corrupt_pages == 0
    assert worker_stats(eng).stores == 1 and worker_stats(eng).store_failures == 0
    settle(eng)
    b = a[:5 * C] + tokens(150, 1)
    eng.add_request("B", b)
    so, rep = eng.step_until_scheduled()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 5 * C  # the external hit, whole chunks
    # the 5 attention blocks and 3 state blocks were zeroed before the load: what verify found, the load wrote
    assert eng.zeroed_blocks == 5 + 3
    assert sched_stats(eng).hit_tokens == 5 * C
    # 5 attention blocks x 2 layers, plus the state of token 400 in block (400-1)//80 of 3 GDN groups x 2 layers
    assert (rep.verified_pages, rep.corrupt_pages) == (16, 0)
    # the check can fail: the state of token 400 one block early (where a positional off-by-one would put it)
    new = so.scheduled_new_reqs[0]
    gdn = eng.layout.recurrent_groups[0]
    wrong = [list(ids) for ids in new.block_ids]
    wrong[gdn][4], wrong[gdn][3] = wrong[gdn][3], wrong[gdn][4]
    bad = offline.StepReport()
    eng.verify("B", tuple(wrong), 5 * C, bad)
    assert bad.corrupt_pages == 2  # both layers of that GDN group
    assert eng.run().corrupt_pages == 0
    assert worker_stats(eng).loads == 1 and worker_stats(eng).load_failures == 0


@pytest.mark.parametrize("b_len,hit", [(5 * C, 4 * C), (5 * C + 1, 5 * C), (4 * C + 33, 4 * C), (3 * C - 1, 2 * C)])
def test_unaligned_lengths_and_the_n_minus_1_cap(serve, make_engine, b_len, hit):
    srv = serve()
    eng = make_engine(srv.endpoint)
    a = tokens(6 * C + 5, 2)
    run(eng, "A", a)
    settle(eng)
    eng.add_request("B", a[:b_len])  # a prompt that is all cached still computes its last token
    so, rep = eng.step_until_scheduled()
    assert so.scheduled_new_reqs[0].num_computed_tokens == hit
    assert rep.corrupt_pages == 0 and rep.verified_pages > 0
    assert eng.run().corrupt_pages == 0


def test_local_prefix_hit_plus_external_hit(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint)
    a = tokens(6 * C, 3)
    run(eng, "A", a)
    settle(eng)
    run(eng, "C", a[:2 * C] + tokens(30, 4))  # vLLM's own cache now holds A's first two chunks
    eng.worker.worker_side.wait_idle(10)
    loads, hits = worker_stats(eng).loads, sched_stats(eng).hit_tokens
    eng.add_request("B", a[:5 * C] + tokens(40, 5))
    so, rep = eng.step_until_scheduled()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 5 * C
    assert worker_stats(eng).loads == loads + 1
    # local 2 chunks, external 3: the connector reports (and loads) only the external ones
    assert sched_stats(eng).hit_tokens - hits == 3 * C
    assert rep.corrupt_pages == 0 and rep.verified_pages == 5 * 2 + 6
    assert eng.run().corrupt_pages == 0


def test_abort_during_a_load_then_hit_again(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint)
    a = tokens(4 * C + 9, 6)
    run(eng, "A", a)
    settle(eng)
    eng.add_request("B", a)
    eng.step(after_schedule=lambda so: eng.abort("B"))  # the load is planned, the request goes away
    eng.run()
    assert "B" not in eng.scheduler.requests
    eng.add_request("D", a[:4 * C] + tokens(20, 7))
    so, rep = eng.step_until_scheduled()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 * C
    assert rep.corrupt_pages == 0 and rep.verified_pages > 0
    assert eng.run().corrupt_pages == 0


def test_preemption_after_a_load_reloads_on_resume(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint)
    a = tokens(4 * C + 9, 8)
    run(eng, "A", a)
    settle(eng)
    eng.add_request("B", a[:4 * C] + tokens(250, 9))  # several steps past the hit
    so, rep = eng.step_until_scheduled()  # the load ran while B waited in vLLM's queue
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 * C and rep.corrupt_pages == 0
    # vLLM preempts every running request (its own path, as under memory pressure), dropping its prefix cache
    eng.step(after_schedule=lambda so: eng.scheduler.reset_prefix_cache(reset_running_requests=True))
    assert eng.scheduler.requests["B"].num_preemptions == 1
    total = eng.run()
    assert total.corrupt_pages == 0
    assert sched_stats(eng).loads_planned == 2  # the resumed request looked up and loaded again
    assert worker_stats(eng).load_failures == 0


def test_server_down_costs_hits_not_requests(sock_dir, make_engine):
    eng = make_engine(f"ipc://{sock_dir}/nobody.sock", lookup_timeout_s=0.3, timeout_s=1.0)
    a = tokens(3 * C + 3, 10)
    assert run(eng, "A", a).corrupt_pages == 0
    eng.add_request("B", a)
    so, _ = eng.step_until_scheduled()
    assert so.scheduled_new_reqs[0].num_computed_tokens in (0, 3 * C)  # vLLM's own cache may hit, never ours
    eng.run()
    assert sched_stats(eng).hit_tokens == 0 and worker_stats(eng).stores == 0


def test_server_killed_midway_costs_hits_not_requests(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint, lookup_timeout_s=0.3, timeout_s=1.0)
    a = tokens(3 * C + 3, 11)
    run(eng, "A", a)
    settle(eng)
    srv.stop()
    eng.add_request("B", a)
    eng.run()
    assert sched_stats(eng).hit_tokens == 0
    assert not eng.scheduler.has_requests()


def test_stalled_server_costs_hits_not_requests(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint, lookup_timeout_s=0.3, timeout_s=1.0, retry_s=60.0)
    a = tokens(3 * C + 3, 12)
    run(eng, "A", a)
    settle(eng)
    os.kill(srv.pid, signal.SIGSTOP)  # alive but answering nothing: a slow server, at its limit
    try:
        t0 = time.monotonic()
        eng.add_request("B", a)
        eng.run()
        assert time.monotonic() - t0 < 10  # one lookup timeout, then no further tries for retry_s
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    assert sched_stats(eng).hit_tokens == 0 and sched_stats(eng).lookup_failures == 1
    assert not eng.scheduler.has_requests()


def test_layout_mismatch_with_a_preset_is_a_startup_error(serve, make_engine):
    srv = serve()
    with pytest.raises(LayoutError, match="qwen3.6-27b"):
        make_engine(srv.endpoint, expect_preset="qwen3.6-27b")


def test_server_refusing_the_layout_is_a_startup_error(serve, make_engine):
    srv = serve("--chunk-tokens", str(3 * C))
    with pytest.raises(LayoutError, match="refused"):
        make_engine(srv.endpoint)


def test_bad_extra_config_names_the_key(serve, make_engine):
    with pytest.raises(ValueError, match="wire_fromat"):
        make_engine("ipc:///tmp/x.sock", wire_fromat="shm")
    with pytest.raises(ValueError, match="store_policy"):
        make_engine("ipc:///tmp/x.sock", store_policy="sometimes")
    with pytest.raises(ValueError, match="retrieve_policy 'all' is not supported"):
        make_engine("ipc:///tmp/x.sock", retrieve_policy="all")


@pytest.mark.parametrize(("extra", "says"), [
    ({"wire_format": "shmm"}, r"wire_format must be one of \('shm', .*\), got 'shmm'"),
    ({"wire_format": "cuda_ipc"}, "wire_format cuda_ipc is a baseline"),
    ({"copy_engine": "dmaa"}, r"copy_engine must be one of \('auto', .*\), got 'dmaa'"),
    ({"streams": "two"}, r"streams must be one of \('single', 'per_group'\), got 'two'"),
    ({"timeout_s": True}, "timeout_s must be float, got True"),
    ({"chunk_tokens": "16"}, "chunk_tokens must be int, got '16'"),
    ({"lookup_timeout_s": 0}, "lookup_timeout_s must be > 0"),
    ({"endpoint": "http://x"}, "endpoint must be ipc:// or tcp://"),
    ({"state_every_chunks": -1}, "state_every_chunks must be >= 0, got -1"),
    ({"max_link_fraction": 0.01}, r"max_link_fraction must lie in \[0.05, 1\], got 0.01"),
    ({"max_link_fraction": 1.5}, r"max_link_fraction must lie in \[0.05, 1\], got 1.5"),
    ({"max_compute_cost": 1}, r"max_compute_cost must lie in \[0, 1\) \(0: no cap\), got 1.0"),
    ({"max_compute_cost": 0.001}, "max_compute_cost 0.001 would pace copies to 0.014 of the link"),
    ({"link_gbps": -3}, "link_gbps must be a finite rate >= 0 \\(0: measured\\), got -3.0"),
    ({"max_link_fraction": "half"}, "max_link_fraction must be float, got 'half'"),
])
def test_extra_config_errors_name_the_key_and_value(extra, says):
    with pytest.raises(ValueError, match="kv_connector_extra_config " + says):
        ConnectorSettings.from_extra(extra)


def test_extra_config_takes_ints_for_floats():
    s = ConnectorSettings.from_extra({"timeout_s": 5, "wire_format": "raw", "copy_engine": "dma"})
    assert (s.timeout_s, s.wire_format, s.copy_engine) == (5.0, "raw", "dma") and isinstance(s.timeout_s, float)


def test_pacing_reaches_the_ranks_transfer_config(serve, make_engine):
    """The pacing settings are the engine rank's TransferConfig's (each direction's share of the link as that
    config derives it), and the variables HYBRIDKV_<KEY> set them as the extra-config keys do."""
    srv = serve()
    eng = make_engine(srv.endpoint, max_link_fraction=0.5, max_compute_cost=0.03, link_gbps=40)
    run(eng, "A", tokens(2 * C + 5, 70))
    cfg = eng.worker.worker_side.link.transfer.config
    assert (cfg.max_link_fraction, cfg.max_compute_cost, cfg.link_gbps) == (0.5, 0.03, 40.0)
    assert cfg.link_fraction("load") == pytest.approx(0.03 / 0.07) and cfg.link_fraction("store") == 0.5
    s = ConnectorSettings.from_extra({}, environ={"HYBRIDKV_MAX_LINK_FRACTION": "0.25", "HYBRIDKV_LINK_GBPS": "50"})
    assert (s.max_link_fraction, s.max_compute_cost, s.link_gbps) == (0.25, 0.0, 50.0)


def test_one_pin_set_per_request_however_often_vllm_asks(serve, make_engine):
    """vLLM asks again every step for a request it could not admit (no free blocks): one lookup, one lease."""
    srv = serve("--admin")
    eng = make_engine(srv.endpoint, num_blocks=60, step_tokens=4000)
    a = tokens(5 * C + 17, 60)
    run(eng, "A", a)
    settle(eng)
    eng.add_request("big", tokens(48 * C, 61), max_tokens=40)  # holds most blocks while it decodes 40 steps
    eng.step()
    before = counters(srv.endpoint)
    eng.add_request("B", a[:5 * C] + tokens(40, 62))
    waited = 0
    while "B" not in {r.req_id for r in eng.step()[0].scheduled_new_reqs} and eng.scheduler.has_requests():
        waited += 1
    after = counters(srv.endpoint)
    assert waited >= 3, "B was admitted at once: the test did not make vLLM ask again"
    # the scheduler's one lookup: the worker loads the objects it pinned, with no lookup of its own
    assert after["lookups"] - before["lookups"] == 1, "a lookup (and a pin set) per step vLLM asked, or the worker's"
    assert worker_stats(eng).loads_pinned == 1
    assert eng.run().corrupt_pages == 0
    eng.worker.worker_side.wait_idle(10)
    eng.scheduler.connector.scheduler_side.wait_idle(10)
    assert counters(srv.endpoint)["leases"] == 0
