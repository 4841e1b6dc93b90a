"""Several engines at once: working sets checked at load time, engines placed on GPUs, store-while-load
plans, and the aggregate / bidirectional rates computed from request windows."""

from __future__ import annotations

import pytest
from hybridkv_bench.metrics import RequestRow, case_metrics
from hybridkv_bench.scenario.load import decode_scenario
from hybridkv_bench.scenario.spec import ScenarioError
from hybridkv_bench.workloads.base import build_plan, engine_gpus
from hybridkv_bench.workloads.multi_engine import MultiEngine
from hybridkv_bench.workloads.store_while_load import StoreWhileLoad

TP8_EIGHT_ENGINES = """
name = "t"
[model]
preset = "qwen3.6-27b"
tp = 8
[server]
l1_gib = 24.0
{l2}
[prefill]
kind = "tokens_per_s"
rate = 1000.0
[[workloads]]
kind = "multi_engine"
engines = 8
prompt_tokens = 60000
[matrix]
store_policy = ["boundary", "all"]
"""


def test_eight_tp8_engines_of_60k_tokens_do_not_fit_24_gib_without_l2():
    # Issue 15: this scenario was accepted and every case then failed with a 0-token hit.
    with pytest.raises(ScenarioError) as e:
        decode_scenario(TP8_EIGHT_ENGINES.format(l2=""), "t.toml")
    msg = str(e.value)
    assert "workloads[0] (multi_engine)" in msg and "store_policy 'all' is 29.30 GiB" in msg
    assert "server.l1_gib 24 (no L2)" in msg and "GiB" in msg


def test_the_same_working_set_fits_once_an_l2_stands_behind_l1():
    s = decode_scenario(TP8_EIGHT_ENGINES.format(l2="l2_gib = 64.0"), "t.toml")
    assert s.server.l2_gib == 64.0


def test_boundary_store_fits_where_all_does_not():
    text = TP8_EIGHT_ENGINES.format(l2="").replace('["boundary", "all"]', '["boundary"]')
    assert decode_scenario(text, "t.toml").matrix.store_policy == ("boundary",)
    with pytest.raises(ScenarioError, match=r"l1_gib 24 \+ l2_gib 4 = 28.00 GiB"):
        decode_scenario(TP8_EIGHT_ENGINES.format(l2="l2_gib = 4.0"), "t.toml")


@pytest.mark.parametrize("engines,gpus,visible,want", [
    (8, (), 1, [0] * 8),                      # one GPU: every engine shares cuda:0
    (8, (), 8, list(range(8))),               # eight GPUs: engine i on cuda:i
    (4, (), 2, [0, 1, 0, 1]),
    (4, (3, 2, 1, 0), 4, [3, 2, 1, 0]),       # the scenario's own mapping
])
def test_engines_are_placed_on_gpus(engines, gpus, visible, want):
    w = MultiEngine(engines=engines, prompt_tokens=100, gpus=gpus)
    assert engine_gpus(w, visible) == want


def test_a_mapping_naming_a_missing_gpu_or_the_wrong_count_is_refused():
    with pytest.raises(ValueError, match=r"gpus \[3\] do not exist; 2 GPUs are visible"):
        engine_gpus(MultiEngine(engines=2, prompt_tokens=100, gpus=(0, 3)), 2)
    with pytest.raises(ValueError, match="names 1 devices for 2 engines"):
        MultiEngine(engines=2, prompt_tokens=100, gpus=(0,))
    with pytest.raises(ValueError, match="no CUDA device"):
        engine_gpus(MultiEngine(engines=2, prompt_tokens=100), 0)


def test_store_while_load_overlaps_one_load_with_one_store_per_round():
    plan = build_plan(StoreWhileLoad(prompt_tokens=160, rounds=3), 80, seed=0)
    assert plan.ranks == (0, 0)  # one namespace: engine 0 loads what engine 1 stored
    assert [[(r.name, r.engine, r.phase) for r in p] for p in plan.phases] == [
        [("doc0-store", 1, "cold")],
        [("doc0-load", 0, "warm"), ("doc1-store", 1, "cold")],
        [("doc1-load", 0, "warm"), ("doc2-store", 1, "cold")],
        [("doc2-load", 0, "warm"), ("doc3-store", 1, "cold")],
    ]
    stored = {r.name.split("-")[0]: r.tokens for r in plan.requests if r.name.endswith("store")}
    for r in plan.requests:
        if r.name.endswith("load"):  # the loaded prompt is a stored document plus one token
            doc = stored[r.name.split("-")[0]]
            assert (r.tokens[:len(doc)] == doc).all() and len(r.tokens) == len(doc) + 1


def row(engine: int, step: int, *, stored: int = 0, loaded: int = 0, store_at: float = 0.0, store_s: float = 0.0,
        load_at: float = 0.0, load_s: float = 0.0, gpu: int = 0) -> RequestRow:
    return RequestRow(case="c", workload="w", repeat=0, request=engine + 10 * step, phase="warm", prompt_tokens=1,
                      hit_tokens=0, lookup_s=0.0, store_s=store_s, load_s=load_s, prefill_s=0.0, ttft_s=0.0,
                      bytes_stored=stored, bytes_loaded=loaded, verified_chunks=0, corrupt_chunks=0,
                      engine=engine, step=step, gpu=gpu, store_start_s=store_at, load_start_s=load_at)


CAL = {"d2h_peak_gbps": 50.0, "h2d_peak_gbps": 50.0, "bidir_peak_gbps": 80.0,
       "aggregate_d2h_gbps": 400.0, "aggregate_h2d_gbps": 400.0}


def test_aggregate_rate_is_bytes_over_the_span_of_concurrent_windows():
    # Two engines store 10 GB each in overlapping windows [0, 0.5] and [0.25, 0.75]: 20 GB in 0.75 s.
    rows = [row(0, 0, stored=10 * 10**9, store_at=0.0, store_s=0.5),
            row(1, 0, stored=10 * 10**9, store_at=0.25, store_s=0.5)]
    m = case_metrics(rows, CAL)
    assert m["aggregate_store_gbps"] == pytest.approx(20 / 0.75)
    assert m["store_gbps"] == pytest.approx(20.0)  # per engine: each moved 10 GB in 0.5 s
    assert m["engine_store_gbps_min"] == m["engine_store_gbps_max"] == pytest.approx(20.0)
    assert m["aggregate_store_ceiling_ratio"] == pytest.approx(20 / 0.75 / 50.0)  # one GPU: one link
    assert m["aggregate_load_gbps"] is None and m["bidir_gbps"] is None


def test_engines_on_several_gpus_are_measured_against_the_all_gpus_ceiling():
    rows = [row(e, 0, loaded=10**9, load_at=0.0, load_s=0.1 * (1 + (e == 3)), gpu=e) for e in range(4)]
    m = case_metrics(rows, CAL)
    assert m["engine_load_gbps_min"] == pytest.approx(5.0) and m["engine_load_gbps_max"] == pytest.approx(10.0)
    m = case_metrics([row(e, 0, loaded=10**9, load_at=0.0, load_s=0.1, gpu=e) for e in range(4)], CAL)
    assert m["aggregate_load_gbps"] == pytest.approx(40.0)
    assert m["aggregate_load_ceiling_ratio"] == pytest.approx(40.0 / 400.0)


def test_bidir_counts_only_steps_where_one_engine_stores_while_another_loads():
    rows = [row(1, 0, stored=10**9, store_at=0.0, store_s=0.1),                      # alone: not bidir
            row(0, 1, loaded=3 * 10**9, load_at=0.0, load_s=0.1),
            row(1, 1, stored=10**9, store_at=0.05, store_s=0.15)]                     # span 0.2 s, 4 GB
    m = case_metrics(rows, CAL)
    assert m["bidir_gbps"] == pytest.approx(20.0)
    assert m["bidir_peak_gbps"] == 80.0 and m["bidir_ceiling_ratio"] == pytest.approx(0.25)
