"""Conversation prefetch in the harness: the multi_turn workload's think time, hint and tier passes, the
scenario checks that keep a comparison meaningful, and the CPU scenario run end to end (real server, L2
on disk, every byte verified). Figures are printed, never asserted: under load a think time may be too
short for a read, and that is what the run reports, not a failed behaviour."""

from __future__ import annotations

import msgspec
import pytest
from benchkit import SCENARIOS
from hybridkv_bench.metrics import PREFETCH_METRICS, PREFETCH_TIERS, case_metrics
from hybridkv_bench.results.folder import load_run
from hybridkv_bench.run.options import BenchOptions
from hybridkv_bench.run.runner import run_bench
from hybridkv_bench.scenario.load import ScenarioFile, decode_scenario, load_scenario
from hybridkv_bench.scenario.spec import ScenarioError
from hybridkv_bench.workloads.base import build_plan
from hybridkv_bench.workloads.multi_turn import MultiTurn

TEXT = (SCENARIOS / "prefetch.toml").read_text()


def decode(replace: dict[str, str]):
    text = TEXT
    for a, b in replace.items():
        assert a in text, a
        text = text.replace(a, b)
    return decode_scenario(text, "scenarios/prefetch.toml")


def test_compare_plans_three_passes_of_fresh_conversations_with_hints_only_in_the_last():
    w = load_scenario(SCENARIOS / "prefetch.toml").scenario.workloads[0]
    assert isinstance(w, MultiTurn)
    plan = build_plan(w, 784, seed=0)
    reqs = plan.requests
    assert len(reqs) == 3 * w.conversations * w.turns
    warm = [r for r in reqs if r.phase == "warm"]
    assert {r.tier for r in warm} == set(PREFETCH_TIERS) and all(r.tier == "" for r in reqs if r.phase == "cold")
    assert all(r.think_s == w.think_s for r in warm)
    for r in warm:  # the hint names the conversation so far: the previous turn's prompt
        assert r.hint_tokens == (len(r.tokens) - w.turn_tokens if r.tier == "l2_prefetch" else 0)
    # l1: one conversation after another; l2 passes: round-robin. Every pass has its own prompts.
    l1 = [r.name for r in reqs if r.name.startswith("l1-")]
    assert l1[:w.turns] == [f"l1-conv0-turn{t}" for t in range(w.turns)]
    assert [r.name for r in reqs if r.name.startswith("l2-")][:2] == ["l2-conv0-turn0", "l2-conv1-turn0"]
    firsts = {r.tokens[:8].tobytes() for r in reqs if r.name.endswith("conv0-turn0")}
    assert len(firsts) == 3


def test_without_prefetch_the_multi_turn_plan_is_unchanged():
    w = MultiTurn(system_tokens=160, turn_tokens=80, turns=3, conversations=2)
    reqs = build_plan(w, 80, seed=3).requests
    assert [r.name for r in reqs] == [f"conv{c}-turn{t}" for t in range(3) for c in range(2)]
    assert all(r.tier == "" and r.think_s == 0 and r.hint_tokens == 0 for r in reqs)
    on = build_plan(msgspec.structs.replace(w, prefetch="on", think_s=0.5), 80, seed=3).requests
    assert [r.tokens.tolist() for r in on] == [r.tokens.tolist() for r in reqs]
    assert [r.hint_tokens for r in on if r.phase == "warm"] == [160 + 80 * t for t in (1, 1, 2, 2)]


def test_the_shipped_prefetch_scenarios_validate_and_scale():
    for name in ("prefetch", "h200_prefetch"):
        sf = load_scenario(SCENARIOS / f"{name}.toml")
        small = sf.scaled(0.05).scenario  # validated again inside: still pushes L1 out to L2
        assert small.workloads[0].prefetch == "compare" and small.server.l2_gib > 0


@pytest.mark.parametrize(("replace", "expected"), [
    ({"l2_gib = 0.5": "l2_gib = 0.0"}, "server.l2_gib is 0"),
    ({"conversations = 4": "conversations = 2"}, "fits in server.l1_gib"),  # the l2 tiers would be L1 hits
    ({"l1_gib = 0.05078125": "l1_gib = 0.0225"}, "the l1 tier would not come from L1"),
    ({"conversations = 4": "conversations = 1"}, "needs conversations >= 2"),
    ({"turns = 3": "turns = 1"}, "needs turns >= 2"),
    ({"think_s = 0.1": "think_s = -1.0"}, "think_s must lie in [0, 60]"),
    ({"think_s = 0.1": "think_s = 3600.0"}, "think_s must lie in [0, 60]"),
    ({'prefetch = "compare"': 'prefetch = "always"'}, "invalid enum value 'always'"),
    ({'device = "cpu"': 'device = "cpu"\nengine = "vllm"'}, "the vllm engine sends none"),
    ({"l2_gib = 0.5": "l2_gib = 0.1"}, "more than server.l1_gib"),  # three passes outgrow L1 + L2
])
def test_a_comparison_that_cannot_measure_what_it_is_for_is_rejected(replace, expected):
    with pytest.raises(ScenarioError) as e:
        decode(replace)
    assert expected in str(e.value)


@pytest.mark.slow  # 7 s on the 2-core VM: `nox -s tests_slow` runs it
def test_cpu_prefetch_scenario_runs_verified_and_reports_each_tier(tmp_path, capsys):
    sf = load_scenario(SCENARIOS / "prefetch.toml")
    one = ScenarioFile(sf.path, sf.sha256, msgspec.structs.replace(sf.scenario, repeats=1), sf.scale)
    outcome = run_bench(one, BenchOptions(out=tmp_path / "run"))
    assert not outcome.failed
    run = load_run(outcome.folder).require_complete()
    (case,) = run.cases
    m, rows = case.metrics, run.rows_of(case)
    assert m["corrupt_chunks"] == 0 and m["verified_chunks"] > 0
    assert all(m[k] is not None and m[k] > 0 for k in PREFETCH_METRICS)
    assert m == case_metrics(rows, run.record.calibration, {k: m[k] for k in m if k.startswith("server_")})
    counters = case.details["server_counters"]
    warm = {t: sum(r.phase == "warm" and r.tier == t for r in rows) for t in PREFETCH_TIERS}
    assert counters["prefetch_requests"] == warm["l2_prefetch"] and counters["prefetch_objects_refused"] == 0
    assert counters["prefetch_objects_started"] > 0, "the hints found their prefixes in L2"
    assert counters["lookup_l2_waits"] >= warm["l2"] // 2, "without a hint, lookups waited on L2"
    assert counters["l2_prefetch_failures"] == 0
    err = capsys.readouterr().err
    assert "warm TTFT from L1" in err and "with prefetch" in err
    print(f"\nCPU prefetch: warm TTFT L1 {m['ttft_warm_l1_s']:.4f} s, L2 {m['ttft_warm_l2_s']:.4f} s, "
          f"L2 + prefetch {m['ttft_warm_l2_prefetch_s']:.4f} s; ratio {m['prefetch_ttft_ratio']:.3f} "
          f"(restore {m['prefetch_restore_ratio']:.3f}, without prefetch {m['l2_ttft_ratio']:.3f})")
