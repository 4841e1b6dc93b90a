"""Engines of a multi-engine workload as processes of their own (`engines_as = "processes"`), end to end on
CPU through the real runner and a real server: rows, verification and the aggregate metrics; an engine that
raises, and one that is killed, each fail their case at once with why; no engine process outlives its case.
Each case spawns its engines (each imports torch: about 2 s of CPU), so these scenarios are small."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import psutil
import pytest
from hybridkv_bench.engines.step import rank_overlap
from hybridkv_bench.results.folder import load_run
from hybridkv_bench.run.options import BenchOptions
from hybridkv_bench.run.runner import run_bench
from hybridkv_bench.scenario.load import ScenarioFile, load_scenario
from hybridkv_bench.scenario.spec import ScenarioError
from hybridkv_bench.workloads.base import Plan, Request

SCENARIO = """
name = "{name}"
description = "engines as processes on CPU"
seed = 1
repeats = {repeats}
warmup = {warmup}
device = "cpu"
engines_as = "{engines_as}"

[model]
preset = "tiny-hybrid"
tp = 2

[server]
l1_gib = 0.0625
client_timeout_s = 10.0

[prefill]
kind = "tokens_per_s"
rate = 5000.0

[[workloads]]
kind = "multi_engine"
engines = {engines}
prompt_tokens = 320       # 4 chunks of 80 tokens

[matrix]
wire_format = ["shm"]
copy_engine = ["kernel"]
store_policy = ["all"]
"""


def scenario(tmp_path: Path, name: str = "procs", *, engines: int = 2, repeats: int = 1, warmup: int = 0,
             engines_as: str = "processes") -> ScenarioFile:
    path = tmp_path / f"{name}.toml"
    path.write_text(SCENARIO.format(name=name, engines=engines, repeats=repeats, warmup=warmup,
                                    engines_as=engines_as))
    return load_scenario(path)


def engine_processes() -> list[psutil.Process]:
    """This process's engine children (multiprocessing's resource tracker is not one)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:  # exited while we looked
            pass
    return out


def test_engines_as_processes_run_the_case_verified_with_aggregate_rates(tmp_path: Path):
    # tp 2, three engines: ranks 0, 1, 0; engines 0 and 2 are replicas of one rank, so of one namespace
    sf = scenario(tmp_path, engines=3, repeats=2, warmup=1)
    t0 = time.perf_counter()
    outcome = run_bench(sf, BenchOptions(out=tmp_path / "run"))
    wall = time.perf_counter() - t0
    run = load_run(outcome.folder).require_complete()
    (case,) = run.cases
    assert case.status == "ok", case.error
    assert case.details["engines_as"] == "processes"
    m, rows = case.metrics, run.rows_of(case)
    assert m["corrupt_chunks"] == 0 and m["verified_chunks"] == 3 * 3 * 4  # 3 repeats x 3 warm requests x 4 chunks
    assert m["aggregate_store_gbps"] > 0 and m["aggregate_load_gbps"] > 0
    assert m["aggregate_store_ceiling_ratio"] is not None and m["aggregate_load_ceiling_ratio"] is not None
    assert len(rows) == 3 * 6 and {(r.repeat, r.engine) for r in rows} == {(p, e) for p in (-1, 0, 1) for e in range(3)}
    for r in rows:
        assert r.hit_tokens == (320 if r.phase == "warm" else 0) and r.gpu == -1
        assert r.step == (r.phase == "warm")
    # one origin for every process: each window starts inside its repeat, the aligned ones close together
    for rep in (-1, 0, 1):
        cold = [r.store_start_s for r in rows if r.repeat == rep and r.phase == "cold"]
        warm = [r.load_start_s for r in rows if r.repeat == rep and r.phase == "warm"]
        assert all(0 < t < wall for t in cold + warm)
        assert max(cold) - min(cold) < 1.0 and max(warm) - min(warm) < 1.0
    assert not engine_processes()


def failing(sf: ScenarioFile, engines_as: str) -> ScenarioFile:
    """The scenario with an L1 of 2.5 chunks: stores evict each other, so warm hits fall short of what the
    engines stored. `validate` refuses such an L1; the struct is replaced past it on purpose."""
    s = sf.scenario
    s = msgspec.structs.replace(s, engines_as=engines_as, server=msgspec.structs.replace(s.server, l1_gib=1e-4))
    return ScenarioFile(sf.path, sf.sha256, s)


@pytest.mark.slow  # end to end: two bench runs, engine processes that import torch (53 s at load 20-40)
def test_an_engine_process_that_raises_fails_the_case_with_its_error(tmp_path: Path):
    sf = scenario(tmp_path)
    # the same case with engines in threads fails the same way: the hit check is as strict in both
    threads = run_bench(failing(sf, "threads"), BenchOptions(out=tmp_path / "threads"))
    (case,) = load_run(threads.folder).cases
    assert case.status == "failed" and case.error.startswith("HitMismatch: engine"), case.error
    t0 = time.monotonic()
    outcome = run_bench(failing(sf, "processes"), BenchOptions(out=tmp_path / "procs"))
    assert time.monotonic() - t0 < 30
    run = load_run(outcome.folder).require_complete()
    (case,) = run.cases
    assert outcome.failed == [case.key]
    assert case.status == "failed"
    assert case.error.startswith("EngineFailed: engine ") and "(process " in case.error, case.error
    assert "HitMismatch: engine" in case.error and "the stored prefixes allow exactly 320" in case.error, case.error
    assert not engine_processes()


@pytest.mark.slow  # end to end: a bench run of engine processes killed midway (44 s at load 20-40)
def test_a_killed_engine_process_fails_the_case_at_once(tmp_path: Path):
    sf = scenario(tmp_path, repeats=400)  # minutes of repeats: the kill lands while they run
    killed: list[tuple[int, float]] = []
    stop = threading.Event()

    def kill_one_once_both_mapped_the_arena() -> None:
        while not stop.wait(0.05):
            children = engine_processes()
            try:
                mapped = [p for p in children if "/dev/shm/hybridkv-" in Path(f"/proc/{p.pid}/maps").read_text()]
            except OSError:
                continue
            if len(mapped) == 2:
                time.sleep(0.3)  # into the repeats
                mapped[1].kill()
                killed.append((mapped[1].pid, time.monotonic()))
                return

    killer = threading.Thread(target=kill_one_once_both_mapped_the_arena, daemon=True)
    killer.start()
    try:
        outcome = run_bench(sf, BenchOptions(out=tmp_path / "run"))
    finally:
        stop.set()
        killer.join()
    done = time.monotonic()
    assert killed, "the engines never mapped the arena"
    (pid, at), = killed
    assert done - at < 10, "a dead engine must fail the case at once, not at a barrier or a client timeout"
    (case,) = load_run(outcome.folder).require_complete().cases
    assert case.status == "failed" and case.error.startswith("EngineFailed: engine ")
    assert f"(process {pid}) was killed by SIGKILL" in case.error, case.error
    assert not engine_processes()


def test_engines_as_is_validated_and_auto_means_processes_for_the_sim_engine_on_cuda(tmp_path: Path):
    s = scenario(tmp_path, engines_as="auto").scenario
    assert s.engines_in_processes("cuda", 8) and not s.engines_in_processes("cpu", 8)
    assert not s.engines_in_processes("cuda", 1)  # one engine runs in the runner's process
    threads = msgspec.structs.replace(s, engines_as="threads")
    assert not threads.engines_in_processes("cuda", 8)
    with pytest.raises(ScenarioError, match=r"procs.toml: invalid enum value 'fork' at \$.engines_as"):
        scenario(tmp_path, engines_as="fork")
    text = (tmp_path / "procs.toml").read_text()
    (tmp_path / "procs.toml").write_text(text.replace('engines_as = "fork"', 'engines_as = "processes"\n'
                                                      'engine = "vllm"'))
    with pytest.raises(ScenarioError, match="engines_as = 'processes' runs engines of the sim kind only"):
        load_scenario(tmp_path / "procs.toml")


def test_a_plan_whose_replicas_share_a_prefix_within_a_phase_is_refused():
    a, b = np.arange(160), np.arange(1000, 1160)
    ok = Plan((0, 0), ((Request("x", a, "cold", 0), Request("y", b, "cold", 1)),))
    assert rank_overlap(ok, 80) == ""
    shared = Plan((0, 0), ((Request("x", a, "cold", 0), Request("y", a[:80].copy(), "cold", 1)),))
    assert "x (engine 0) and y (engine 1) of rank 0 share a chunk prefix" in rank_overlap(shared, 80)
    other_ranks = Plan((0, 1), shared.phases)  # different ranks: different namespaces
    assert rank_overlap(other_ranks, 80) == ""
