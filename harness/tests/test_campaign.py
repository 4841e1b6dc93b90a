"""The coverage campaign script: every part names scenarios that exist and validate, a bad part is
refused, and (slow) a part runs end to end on CPU at --quick size with every byte verified."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchkit import REPO, SCENARIOS
from hybridkv_bench.results.folder import load_run
from hybridkv_bench.scenario.load import load_scenario
from hybridkv_bench.scenario.spec import expand_matrix
from hybridkv_bench.workloads.multi_engine import MultiEngine
from hybridkv_bench.workloads.store_while_load import StoreWhileLoad

SCRIPT = REPO / "harness" / "campaign" / "h200_coverage.sh"


def parts() -> dict[str, list[str]]:
    """part -> scenario names, read from the script's case table."""
    text = SCRIPT.read_text()
    return {m["part"]: [r.split(":")[0] for r in re.findall(r'"([^"]+)"', m["runs"])]
            for m in re.finditer(r"^\s+(?P<part>\w+)\) runs=\((?P<runs>[^)]*)\)", text, re.M)}


def test_every_part_names_scenarios_that_validate():
    table = parts()
    assert set(table) == {"tp1", "tp1w", "tp4", "tp8", "next", "concurrent", "x8", "prefetch"}
    for part, names in table.items():
        for name in names:
            s = load_scenario(SCENARIOS / f"{name}.toml").scenario
            assert expand_matrix(s), (part, name)
    # issue 15's coverage: four layouts, both store policies, every named workload kind
    covered = {(load_scenario(SCENARIOS / f"{n}.toml").scenario.model.preset,
                load_scenario(SCENARIOS / f"{n}.toml").scenario.model.tp) for n in sum(table.values(), [])}
    assert {("qwen3.6-27b", 1), ("qwen3.6-27b", 4), ("qwen3.6-27b", 8), ("qwen3-next-80b-a3b", 1)} <= covered
    tp1 = load_scenario(SCENARIOS / "h200_cov_qwen36_tp1.toml").scenario
    assert {w.kind for w in tp1.workloads} == {"long_doc_qa", "multi_turn", "divergence", "fan_out"}
    assert max(getattr(w, "prompt_tokens", 0) for w in tp1.workloads) >= 100_000
    assert set(tp1.matrix.store_policy) == {"boundary", "all"} and tp1.matrix.copy_engine == ("auto",)
    x8 = load_scenario(SCENARIOS / "h200x8_tp8_engines.toml").scenario
    (w,) = x8.workloads
    assert isinstance(w, MultiEngine) and w.engines == 8 and x8.model.tp == 8 and not w.gpus  # engine i on cuda:i
    swl = load_scenario(SCENARIOS / "h200_cov_store_while_load.toml").scenario
    assert isinstance(swl.workloads[0], StoreWhileLoad)


def test_an_unknown_part_is_refused(tmp_path: Path):
    r = subprocess.run(["bash", str(SCRIPT), "tp16", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown part tp16" in r.stderr


@pytest.mark.slow
def test_the_concurrent_part_runs_on_cpu_at_quick_size(tmp_path: Path):
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(SCRIPT), "concurrent", str(tmp_path), "--quick", "0.01", "--device", "cpu",
                        "--no-report"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    folders = sorted((tmp_path / "concurrent").iterdir())
    assert [f.name for f in folders] == ["h200_cov_engines_one_gpu", "h200_cov_store_while_load", "tp4_engines-shm"]
    for folder in folders:
        name = folder.name.split("-")[0]
        run = load_run(folder).require_complete()
        assert run.cases and all(c.status == "ok" for c in run.cases), name
        for c in run.cases:
            assert c.metrics["corrupt_chunks"] == 0 and c.metrics["verified_chunks"] > 0
            if name == "h200_cov_store_while_load":
                assert c.metrics["bidir_gbps"] and c.metrics["bidir_peak_gbps"]
            else:
                assert c.metrics["aggregate_store_gbps"] and c.metrics["aggregate_load_gbps"]


EXTRAS = REPO / "harness" / "campaign" / "h200_extras.sh"


def test_extras_name_files_that_exist_and_refuse_a_bad_part(tmp_path):
    text = EXTRAS.read_text()
    named = r"(scenarios/\S+\.toml|kernels/bench/\S+\.py|(?:harness|reference_impl)/tests/\S+\.py)"
    for path in re.findall(named, text):
        assert (REPO / path).exists(), path
    r = subprocess.run(["bash", str(EXTRAS), "nonsense", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown part nonsense" in r.stderr
