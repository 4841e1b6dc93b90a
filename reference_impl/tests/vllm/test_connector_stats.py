"""The connector's statistics through vLLM's own path: the worker's and the scheduler's counters ride vLLM's
SchedulerStats, vLLM's KV-transfer logger sums and reduces them, and its Prometheus wrapper counts them."""

from __future__ import annotations

from functools import partial

import pytest

# "vllm.config", not "vllm": without vLLM, this folder would import as a namespace package named vllm
pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllmkit import C, hits_by_source, run, sched_stats, settle, tokens, worker_stats


def test_hits_bytes_latency_and_failures_reach_vllm_s_metrics(serve, make_engine):
    srv = serve()
    eng = make_engine(srv.endpoint, lookup_timeout_s=0.3, timeout_s=1.0)
    a = tokens(4 * C + 9, 50)
    run(eng, "A", a)
    settle(eng)
    eng.add_request("B", a[:4 * C] + tokens(30, 51))
    eng.run()
    eng.worker.worker_side.wait_idle(10)
    srv.stop()  # the next request's stores fail: counted, never a failed request
    run(eng, "D", tokens(2 * C + 5, 52))
    eng.step()  # the worker reports what it counted since its last step
    payloads = [s.kv_connector_stats for s in eng.scheduler_stats if s.kv_connector_stats]
    assert len(payloads) > 1  # per step, not once

    # vLLM's logger rebuilds each payload with the connector's class and sums the interval
    log = KVConnectorLogging(eng.vc.kv_transfer_config)
    for p in payloads:
        log.observe(p)
    assert log.transfer_stats_accumulator is not None
    total = log.transfer_stats_accumulator.reduce()
    w, s = worker_stats(eng), sched_stats(eng)
    assert total["hit_tokens_l1"] == 4 * C and total["hit_tokens_l2"] == total["hit_tokens_unknown"] == 0
    assert (total["loads"], total["load_failures"], total["loaded_bytes"]) == (1, 0, w.loaded_bytes)
    lay = eng.layout  # 4 chunks of attention and the GDN states at the hit's end
    assert w.loaded_bytes == sum(lay.object_bytes(g, C) * (4 if g in lay.attention_groups else 1)
                                 for g in range(len(lay.groups)))
    assert (total["stores"], total["stored_bytes"]) == (w.stores, w.stored_bytes) and w.stores >= 2
    # the server went away mid-store: the copy is cancelled, or the store fails
    assert (total["store_failures"], total["stores_cancelled"]) == (w.store_failures, w.stores_cancelled)
    assert w.store_failures + w.stores_cancelled >= 1
    assert total["lookups"] == s.lookups >= 2 and total["lookup_failures"] == s.lookup_failures >= 1
    assert total["load_mean_s"] > 0 and total["store_mean_s"] > 0
    assert hits_by_source(eng) == {"host": 4 * C}  # vLLM's own hits-by-source metric

    # vLLM's Prometheus wrapper registers the connector's counters and feeds them every payload
    reg = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = (partial(m, registry=reg) for m in (Gauge, Counter, Histogram))

    prom = Prom(eng.vc, ["engine"], {0: ["0"]})
    for p in payloads:
        prom.observe(p, 0)
    assert reg.get_sample_value("vllm:hybridkv_hit_tokens_l1_total", {"engine": "0"}) == 4 * C
    assert reg.get_sample_value("vllm:hybridkv_loaded_bytes_total", {"engine": "0"}) == w.loaded_bytes
    assert reg.get_sample_value("vllm:hybridkv_stores_cancelled_total", {"engine": "0"}) == w.stores_cancelled
    assert reg.get_sample_value("vllm:hybridkv_lookup_failures_total", {"engine": "0"}) == s.lookup_failures
