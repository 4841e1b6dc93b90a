"""The runner's L2 directories: a case whose L2 its disk cannot hold fails saying so (a full disk would drop objects
and fail the hit checks with nothing saying why), and each case's L2 files go when its server stops."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
from benchkit import SCENARIOS
from hybridkv_bench.results.folder import load_run
from hybridkv_bench.run.options import BenchOptions
from hybridkv_bench.run.runner import run_bench
from hybridkv_bench.scenario.load import ScenarioFile, load_scenario
from hybridkv_bench.scenario.spec import Matrix


def prefetch_scenario(l2_dir: Path, **server) -> ScenarioFile:
    """The CPU prefetch scenario, one repeat, two cases (kernel and dma copies), its L2 under `l2_dir`."""
    sf = load_scenario(SCENARIOS / "prefetch.toml")
    s = sf.scenario
    s = msgspec.structs.replace(s, repeats=1, server=msgspec.structs.replace(s.server, l2_dir=str(l2_dir), **server),
                                matrix=msgspec.structs.replace(s.matrix, copy_engine=["kernel", "dma"]))
    assert isinstance(s.matrix, Matrix)
    return ScenarioFile(sf.path, sf.sha256, s, sf.scale)


def test_an_l2_larger_than_its_disk_fails_the_case_saying_so(tmp_path: Path):
    l2_dir = tmp_path / "l2"
    l2_dir.mkdir()
    free_gib = shutil.disk_usage(l2_dir).free / 2**30
    outcome = run_bench(prefetch_scenario(l2_dir, l2_gib=round(free_gib + 64)), BenchOptions(out=tmp_path / "run"))
    run = load_run(outcome.folder).require_complete()
    assert len(run.cases) == 2 and len(outcome.failed) == 2
    for case in run.cases:
        assert case.status == "failed"
        assert f"server.l2_gib {round(free_gib + 64)} needs" in case.error and "GiB free" in case.error, case.error
        assert "lower server.l2_gib" in case.error
    assert list(l2_dir.iterdir()) == []


@pytest.mark.slow  # 13 s on the 2-core VM: `nox -s tests_slow` runs it
def test_each_case_removes_its_l2_files_when_its_server_stops(tmp_path: Path):
    l2_dir = tmp_path / "l2"
    seen: list[list[str]] = []

    def look(hit, server) -> None:
        seen.append(sorted(p.name for p in l2_dir.iterdir()))

    outcome = run_bench(prefetch_scenario(l2_dir), BenchOptions(out=tmp_path / "run", before_retrieve=look))
    assert not outcome.failed
    first, second = load_run(outcome.folder).require_complete().cases
    assert first.details["server_counters"]["l2_spills"] > 0 and second.details["server_counters"]["l2_spills"] > 0
    names = {n for s in seen for n in s}
    assert len(names) == 2, names  # one L2 directory per case
    assert all(len(s) == 1 for s in seen), "a case's L2 directory outlived its server"
    assert list(l2_dir.iterdir()) == []
