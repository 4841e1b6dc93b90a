from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from benchkit import write_fake_run
from hybridkv_bench.gate.baseline import Baseline, BaselineCheck, BaselineError, OrderCheck, load_baseline
from hybridkv_bench.gate.checks import format_table, gate, repeat_spread
from hybridkv_bench.gate.write import baseline_from_run
from hybridkv_bench.results.folder import load_run


def fails(result) -> set[tuple[str, str]]:
    return {(c.case, c.check) for c in result.failed}


def check(**kw) -> BaselineCheck:
    return BaselineCheck(**{"metric": "load_ceiling_ratio", "direction": "higher", "tolerance": 0.3,
                            "value": 0.1, **kw})


def test_a_good_run_passes_invariants_and_a_baseline(run_folder: Path):
    run = load_run(run_folder)
    result = gate(run, Baseline(scenario="smoke", check=(check(case="shm-*"),)))
    assert result.exit_code == 0 and not result.failed
    matched = [c for c in result.checks if c.check == "load_ceiling_ratio"]
    assert len(matched) == 8  # 4 shm cases x 2 workloads
    # legacy formats load torch in the server: reported as info, never failed
    info = {(c.case.split("-")[0], c.check) for c in result.checks if c.status == "info"}
    assert ("pickle", "server_cuda_mapped") in info and ("torch_save", "server_cuda_mapped") in info
    assert all(c.status == "pass" for c in result.checks
               if c.case.startswith(("shm", "raw")) and c.check == "server_cuda_mapped")
    assert "status  workload" in format_table(result)


def test_regression_fails(run_folder: Path):
    run = load_run(run_folder)
    result = gate(run, Baseline(scenario="smoke", check=(check(case="pickle-*", value=0.9),)))
    assert result.exit_code == 1
    assert {case for case, _ in fails(result)} == {c.name for c in run.cases if c.name.startswith("pickle")}
    lower = gate(run, Baseline(scenario="smoke", check=(
        check(metric="ttft_warm_s", direction="lower", value=1e-9, tolerance=0.5),)))
    assert lower.exit_code == 1 and len(lower.failed) == len(run.cases)


def test_a_check_that_matches_nothing_or_an_unmeasured_metric_fails(run_folder: Path):
    run = load_run(run_folder)
    result = gate(run, Baseline(scenario="smoke", check=(check(case="cuda_ipc-*"),)))
    assert fails(result) == {("cuda_ipc-*", "load_ceiling_ratio")}
    assert result.failed[0].actual == "no such case"
    result = gate(run, Baseline(scenario="smoke", check=(check(metric="server_vram_mib", direction="lower",
                                                               value=0.0, tolerance=0.0, case="nothere"),)))
    assert result.exit_code == 1


def test_invariants_fail_whatever_the_baseline(tmp_path: Path, smoke):
    folder = write_fake_run(tmp_path / "r", smoke, fail={"raw-dma-single-all-all"}, tamper={
        "shm-kernel-single-boundary-all": {"corrupt_chunks": 2},
        "shm-dma-single-boundary-all": {"server_vram_mib": 612.0},
        "raw-kernel-single-boundary-all": {"server_cuda_mapped": True},
        "pickle-kernel-single-boundary-all": {"server_vram_mib": 600.0},
        "torch_save-dma-single-all-all": {"corrupt_chunks": None},
    })
    result = gate(load_run(folder), None)
    assert fails(result) == {
        ("shm-kernel-single-boundary-all", "corrupt_chunks"),
        ("shm-dma-single-boundary-all", "server_vram_mib"),
        ("raw-kernel-single-boundary-all", "server_cuda_mapped"),
        # pickle loads torch but must still not hold VRAM: the server runs with no GPU visible
        ("pickle-kernel-single-boundary-all", "server_vram_mib"),
        ("torch_save-dma-single-all-all", "corrupt_chunks"),  # not reported is not 0
        ("raw-dma-single-all-all", "case ran"),
    }
    assert result.exit_code == 1


def test_cuda_ipc_may_hold_vram_by_design(tmp_path: Path, smoke):
    import msgspec

    matrix = msgspec.structs.replace(smoke.scenario.matrix, wire_format=("cuda_ipc", "shm"))
    sf = dataclasses.replace(smoke, scenario=msgspec.structs.replace(smoke.scenario, matrix=matrix))
    run = load_run(write_fake_run(tmp_path / "r", sf))
    result = gate(run, None)
    assert result.exit_code == 0
    vram = [c for c in result.checks if c.check == "server_vram_mib" and c.case.startswith("cuda_ipc")]
    assert vram and all(c.status == "info" and c.actual == "612" for c in vram)


def test_incomplete_run_and_unmeasurable_vram(tmp_path: Path, smoke):
    folder = write_fake_run(tmp_path / "r", smoke, finish=False, max_cases=2,
                            tamper={"shm-kernel-single-boundary-all": {"server_vram_mib": None}})
    result = gate(load_run(folder), None)
    assert fails(result) == {("*", "run complete")}
    assert any(c.check == "server_vram_mib" and c.actual == "not measurable" and c.status == "info"
               for c in result.checks)


def test_baseline_from_another_scenario_or_scale_is_a_user_error(run_folder: Path):
    run = load_run(run_folder)
    with pytest.raises(BaselineError, match="baseline is for scenario 'seed_56k', the run is of 'smoke'"):
        gate(run, Baseline(scenario="seed_56k"))
    with pytest.raises(BaselineError, match="taken at scale 0.1"):
        gate(run, Baseline(scenario="smoke", scale=0.1))
    note = gate(run, Baseline(scenario="smoke", scenario_sha256="f" * 64)).notes
    assert note and "scenario file changed" in note[0]


def test_write_baseline_round_trip(run_folder: Path, tmp_path: Path):
    run = load_run(run_folder)
    path = tmp_path / "smoke.toml"
    path.write_text(baseline_from_run(run))
    baseline = load_baseline(path)
    assert baseline.scenario == "smoke" and baseline.scale == 1.0
    assert {c.metric for c in baseline.check} == {"ttft_speedup", "hit_tokens", "shared_tokens", "hit_share",
                                                  "verified_chunks", "bytes_stored", "bytes_loaded"}
    assert all(c.direction == "equal" for c in baseline.check if c.metric != "ttft_speedup")
    speedups = [c for c in baseline.check if c.metric == "ttft_speedup"]
    assert {c.case for c in speedups} == {"shm-*", "raw-*"} and all(c.value == 1.0 and c.spread for c in speedups)
    assert not any(c.metric.endswith("_s") for c in baseline.check), "absolute times are never gated"
    assert {(o.better, o.worse) for o in baseline.order} == {("shm-*", "pickle-*"), ("shm-*", "torch_save-*")}
    result = gate(run, baseline)
    assert result.exit_code == 0
    # each ordering is judged once per workload
    assert len([c for c in result.checks if " vs " in c.case]) == 2 * 2 * 3


def test_counts_are_exact(run_folder: Path):
    run = load_run(run_folder)
    n = run.cases[0].metrics["hit_tokens"]
    exact = lambda value: Baseline(scenario="smoke", check=(  # noqa: E731
        BaselineCheck(case=run.cases[0].name, workload=run.cases[0].workload, metric="hit_tokens",
                      direction="equal", tolerance=0.0, value=value),))
    assert gate(run, exact(n)).exit_code == 0
    assert gate(run, exact(n - 80)).exit_code == 1  # more than expected is as wrong as fewer
    assert gate(run, exact(n + 80)).exit_code == 1
    with pytest.raises(ValueError, match="an equal check is exact"):
        BaselineCheck(metric="hit_tokens", direction="equal", tolerance=0.1, value=1.0)


def test_a_noisy_case_widens_its_own_tolerance(run_folder: Path):
    run = load_run(run_folder)
    case = max(run.cases, key=lambda c: repeat_spread(run, c, "load_gbps") or 0)
    rel = repeat_spread(run, case, "load_gbps")
    assert rel is not None and 0.005 < rel < 0.2  # the fixture's load times jitter by up to 5%
    actual = case.metrics["load_gbps"]
    one = lambda spread: Baseline(scenario="smoke", check=(  # noqa: E731
        check(case=case.name, workload=case.workload, metric="load_gbps", value=actual * 1.25, tolerance=0.1,
              spread=spread),))
    assert gate(run, one(0.0)).exit_code == 1  # 20% below the value, 10% allowed
    wide = gate(run, one(0.25 / rel + 1))
    assert wide.exit_code == 0, format_table(wide)
    assert "x repeat spread" in next(c.expected for c in wide.checks if c.check == "load_gbps")


def test_orderings_inside_the_run(run_folder: Path):
    run = load_run(run_folder)
    order = lambda better, worse, metric="load_gbps", direction="higher": Baseline(  # noqa: E731
        scenario="smoke", order=(OrderCheck(metric=metric, direction=direction, better=better, worse=worse),))
    assert gate(run, order("shm-*", "pickle-*")).exit_code == 0
    assert gate(run, order("shm-*", "pickle-*", "ttft_warm_s", "lower")).exit_code == 0
    backwards = gate(run, order("pickle-*", "shm-*"))
    assert {(c.workload, c.case) for c in backwards.failed} == {("long_doc_qa", "pickle-* vs shm-*"),
                                                                ("fan_out", "pickle-* vs shm-*")}
    missing = gate(run, order("shm-*", "cuda_ipc-*"))
    assert missing.exit_code == 1 and "no measured cuda_ipc-* case" in missing.failed[0].actual


def test_write_baseline_refuses_a_broken_run(tmp_path: Path, smoke):
    tamper = {"shm-kernel-single-all-all": {"corrupt_chunks": 1}}
    run = load_run(write_fake_run(tmp_path / "r", smoke, tamper=tamper))
    with pytest.raises(BaselineError, match="refusing to baseline a run that fails its invariants"):
        baseline_from_run(run)


CHECK = "scenario = 'smoke'\n[[check]]\ntolerance = 0.1\nvalue = 1.0\n"


@pytest.mark.parametrize("text, message", [
    (CHECK + "metric = 'load_gbs'\ndirection = 'higher'\n", "unknown metric 'load_gbs'"),
    (CHECK + "metric = 'load_gbps'\ndirection = 'up'\n", "Invalid enum value 'up'"),
    ("scenario = 'smoke'\ntolerence = 1\n", "unknown field `tolerence`"),
    ("scenario = \n", "invalid TOML"),
    ("scenario = 'smoke'\nscale = ", r"at end of document: line 2, column 9"),
])
def test_bad_baseline_files(tmp_path: Path, text: str, message: str):
    path = tmp_path / "b.toml"
    path.write_text(text)
    with pytest.raises(BaselineError, match=message):
        load_baseline(path)
