from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from benchkit import CALIBRATION, write_fake_run
from hybridkv_bench.metrics import METRICS, REQUEST_COLUMNS, RequestRow, case_metrics
from hybridkv_bench.results.folder import (
    SCHEMA,
    CaseResult,
    IncompleteRunError,
    NotARunFolder,
    RunFolderError,
    RunWriter,
    load_run,
)
from hybridkv_bench.workloads.hits import ExpectedHits


def row(repeat=0, phase="warm", ttft=1.0, **kw) -> RequestRow:
    base = dict(case="c", workload="w", repeat=repeat, request=0, phase=phase, prompt_tokens=100,
                hit_tokens=0, lookup_s=0.001, store_s=0.0, load_s=0.0, prefill_s=0.5, ttft_s=ttft,
                bytes_stored=0, bytes_loaded=0, verified_chunks=0, corrupt_chunks=0)
    return RequestRow(**{**base, **kw})


def test_hit_share_shows_the_hits_lost():
    """A prefix stored with its recurrent state at its last chunk only: a request parting from it two chunks in
    shares two chunks and hits none (DESIGN.md's hit rule), which hit_share shows; with a state at every chunk
    it hits what it shares."""
    a = np.arange(12)
    b = np.concatenate([a[:9], np.arange(100, 103)])
    for policy, hit in (("boundary", 0), ("all", 2)):
        oracle = ExpectedHits(4, True, policy, "boundary")
        oracle.stored(a)
        assert (oracle.shared(b), oracle.lookup(b)) == (2, hit)
    m = case_metrics([row(hit_tokens=0, shared_tokens=8), row(hit_tokens=8, shared_tokens=8),
                      row(phase="cold", repeat=-1, hit_tokens=0, shared_tokens=8)])
    assert (m["hit_tokens"], m["shared_tokens"], m["hit_share"]) == (8, 16, 0.5)
    assert case_metrics([row()])["hit_share"] is None  # nothing shared: no ratio, never 0


def test_case_metrics_by_hand():
    rows = [
        row(phase="cold", ttft=10.0, prefill_s=9.0, bytes_stored=4_000_000_000, store_s=2.0),
        row(phase="cold", ttft=12.0, prefill_s=11.0, bytes_stored=2_000_000_000, store_s=2.0),
        row(ttft=1.0, hit_tokens=80, bytes_loaded=1_000_000_000, load_s=0.1, verified_chunks=1),
        row(ttft=3.0, hit_tokens=80, bytes_loaded=1_000_000_000, load_s=0.4, verified_chunks=1),
        # warm-up: not timed, but its corruption counts
        row(repeat=-1, ttft=100.0, hit_tokens=999, bytes_loaded=5, load_s=9.0, verified_chunks=3,
            corrupt_chunks=1),
    ]
    m = case_metrics(rows, CALIBRATION, {"server_vram_mib": None, "server_cuda_mapped": False})
    assert tuple(m) == METRICS
    assert m["ttft_cold_s"] == 11.0 and m["ttft_warm_s"] == 2.0
    assert m["ttft_warm_s_p90"] == pytest.approx(2.8) and m["ttft_warm_s_p99"] == pytest.approx(2.98)
    assert m["store_gbps"] == pytest.approx(1.5)  # 6 GB in 4 s, bytes-weighted
    assert m["load_gbps"] == pytest.approx(4.0)  # 2 GB in 0.5 s, not the mean of 10 and 2.5
    assert m["store_s"] == 2.0 and m["load_s"] == pytest.approx(0.25) and m["prefill_s"] == 10.0
    assert m["hit_tokens"] == 160 and m["bytes_loaded"] == 2_000_000_000
    assert m["verified_chunks"] == 5 and m["corrupt_chunks"] == 1
    assert m["store_ceiling_ratio"] == pytest.approx(1.5 / 20)
    assert m["load_ceiling_ratio"] == pytest.approx(0.2)
    assert m["ttft_speedup"] == pytest.approx(5.5)
    assert m["server_vram_mib"] is None and m["server_cuda_mapped"] is False and m["server_rss_mib"] is None


def test_missing_phases_and_calibration_give_none_not_zero():
    m = case_metrics([row(phase="cold", ttft=2.0)])
    assert m["ttft_warm_s"] is None and m["ttft_speedup"] is None and m["load_gbps"] is None
    assert m["d2h_peak_gbps"] is None and m["store_ceiling_ratio"] is None


def test_round_trip(run_folder: Path, smoke):
    run = load_run(run_folder)
    assert run.complete and run.require_complete() is run
    assert run.record.schema == SCHEMA and run.scenario_name == "smoke"
    assert run.record.scenario["sha256"] == smoke.sha256 and run.record.calibration == CALIBRATION
    assert len(run.cases) == run.expected_cases() == 32
    assert run.record.context["finished_at"] is not None
    c = run.cases[0]
    rows = run.rows_of(c)
    assert rows and case_metrics(rows, CALIBRATION, c.metrics) == c.metrics  # CSV floats round-trip exactly
    assert Path(run_folder, "requests.csv").read_text().splitlines()[0] == ",".join(REQUEST_COLUMNS)


def test_run_json_is_incomplete_until_finish(tmp_path: Path, smoke):
    w = RunWriter(tmp_path / "r", smoke.record(), {"argv": []})
    assert json.loads((tmp_path / "r" / "run.json").read_text())["complete"] is False
    w.add_requests([row()])
    w.add_case(CaseResult(name="c", workload="w", axes={}, status="ok", metrics={"corrupt_chunks": 0}))
    on_disk = json.loads((tmp_path / "r" / "run.json").read_text())
    assert on_disk["complete"] is False and len(on_disk["cases"]) == 1
    with pytest.raises(RunFolderError, match="already recorded"):
        w.add_case(CaseResult(name="c", workload="w", axes={}, status="ok"))
    run = load_run(tmp_path / "r")
    assert not run.complete
    with pytest.raises(IncompleteRunError, match=r"^incomplete run: .*\(1 of 32 case results written"):
        run.require_complete()
    w.finish()
    assert load_run(tmp_path / "r").complete
    assert not list((tmp_path / "r").glob(".run.json.*")), "temporary files left behind"


def test_an_exception_leaves_an_incomplete_run(tmp_path: Path, smoke):
    with pytest.raises(KeyboardInterrupt), RunWriter(tmp_path / "r", smoke.record(), {}) as w:
        w.add_case(CaseResult(name="c", workload="w", axes={}, status="failed", error="boom"))
        raise KeyboardInterrupt
    run = load_run(tmp_path / "r")
    assert not run.complete and run.cases[0].error == "boom"


def test_refuses_to_overwrite_a_run(run_folder: Path, smoke):
    with pytest.raises(RunFolderError, match="not overwriting"):
        RunWriter(run_folder, smoke.record(), {})


def test_case_status_and_error_agree():
    with pytest.raises(ValueError, match="failed without an error"):
        CaseResult(name="c", workload="w", axes={}, status="failed")


EMPTY = {"schema": SCHEMA, "complete": True, "context": {}, "scenario": {}, "calibration": {}, "cases": []}


@pytest.mark.parametrize("setup, reason", [
    (lambda d: None, "no such directory"),
    (lambda d: d.mkdir(), "no run.json"),
    (lambda d: (d.mkdir(), (d / "run.json").write_text("{not json")), "run.json is not valid JSON"),
    (lambda d: (d.mkdir(), (d / "run.json").write_text('{"schema": "other/9"}')), "schema is 'other/9'"),
    (lambda d: (d.mkdir(), (d / "run.json").write_text(json.dumps(EMPTY))),
     "a complete run without requests.csv"),
    (lambda d: (d.mkdir(), (d / "run.json").write_text(json.dumps({**EMPTY, "complete": "yes"}))),
     "Expected `bool`"),
])
def test_not_a_run_folder(tmp_path: Path, setup, reason):
    folder = tmp_path / "x"
    setup(folder)
    with pytest.raises(NotARunFolder) as e:
        load_run(folder)
    assert str(e.value).startswith(f"not a run folder: {folder} (")
    assert reason in str(e.value)


def test_bad_csv_is_rejected(run_folder: Path):
    csv_path = run_folder / "requests.csv"
    lines = csv_path.read_text().splitlines()
    csv_path.write_text("\n".join([lines[0], lines[1].replace(",cold,", ",lukewarm,")]) + "\n")
    with pytest.raises(NotARunFolder, match=r"requests.csv line 2: Invalid enum value 'lukewarm'"):
        load_run(run_folder)
    csv_path.write_text("case,workload\n")
    with pytest.raises(NotARunFolder, match="requests.csv header"):
        load_run(run_folder)


def test_incomplete_fake_run_loads_but_says_so(tmp_path: Path, smoke):
    run = load_run(write_fake_run(tmp_path / "r", smoke, finish=False, max_cases=3))
    assert not run.complete and len(run.cases) == 3
    assert "3 of 32" in run.incomplete_detail()


def test_published_gpu_runs_stay_readable():
    """Run folders committed under results/ load with today's code (older CSVs lack newer optional columns)."""
    root = Path(__file__).resolve().parents[2] / "results" / "h200"
    folders = sorted(p.parent for p in root.glob("*/*/run.json"))
    assert folders, "no published run folder found"
    for folder in folders:
        run = load_run(folder).require_complete()
        for case in run.cases:
            assert case.metrics["corrupt_chunks"] == 0
            again = case_metrics(run.rows_of(case), run.record.calibration)
            assert again["store_gbps"] == case.metrics["store_gbps"]
