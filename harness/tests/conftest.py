"""Fixtures: run folders written through RunWriter from rows a stand-in runner makes up.

The rows are synthetic but shaped like a real run of scenarios/smoke.toml: sizes come from the
layout and policies, prefill from the scenario's model, transfer times from a per-format rate, so
report and gate are exercised on the same files a runner will write.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from benchkit import SCENARIOS, write_fake_run
from hybridkv_bench.scenario.load import ScenarioFile, load_scenario


@pytest.fixture(scope="session")
def smoke() -> ScenarioFile:
    return load_scenario(SCENARIOS / "smoke.toml")


@pytest.fixture
def run_folder(tmp_path: Path, smoke: ScenarioFile) -> Path:
    return write_fake_run(tmp_path / "run", smoke)
