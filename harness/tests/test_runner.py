"""The runner end to end on CPU: real server processes, every shipped scenario shrunk by --quick."""

from __future__ import annotations

import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import torch
from benchkit import REPO, SCENARIOS
from hybridkv.cli import main
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv_bench.gate.checks import gate
from hybridkv_bench.results.folder import load_run
from hybridkv_bench.run.options import BenchOptions
from hybridkv_bench.run.runner import run_bench
from hybridkv_bench.scenario.load import load_scenario
from hybridkv_bench.scenario.spec import SERVER_IMPORTS_TORCH

# scenario -> (--quick factor, --cases glob): one or two cases each keeps the module to a few minutes on
# 2 cores; the smoke scenario runs whole in `nox -s bench`.
SHIPPED = {
    "smoke": (0.5, "*-kernel-single-boundary-all"),
    "seed_56k": (0.05, "shm-kernel-single-boundary-boundary"),
    "divergence": (0.05, "shm-dma-single-boundary-all"),
    "fan_out": (0.05, "shm-kernel-single-boundary-all"),
    "multi_turn": (0.05, "shm-kernel-single-boundary-boundary"),
    "l1_pressure": (0.05, "*"),
    "prefetch": (1.0, "*"),  # already CPU-sized; test_prefetch_bench runs it in the default suite
    "h200_prefetch": (0.05, "*"),
    "tp4_engines": (0.05, "raw-kernel-single-boundary-boundary"),
    "h200_zero_copy": (0.05, "shm-auto-per_group-boundary-all"),
    # issue 15/14 coverage: one workload each here; harness/tests/test_campaign.py runs the parts whole (slow)
    "h200_cov_qwen36_tp1": (0.01, "divergence/shm-auto-single-boundary-all"),
    "h200_cov_qwen36_tp4": (0.01, "doc100k/shm-auto-single-boundary-boundary"),
    "h200_cov_qwen36_tp8": (0.01, "multi_turn/shm-auto-single-boundary-all"),
    "h200_cov_qwen3next_tp1": (0.01, "fan_out/shm-auto-single-boundary-boundary"),
    "h200_cov_store_while_load": (0.01, "shm-auto-single-boundary-boundary"),
    "h200_cov_engines_one_gpu": (0.01, "shm-auto-single-boundary-all"),
    "h200x8_tp8_engines": (0.01, "shm-auto-single-boundary-boundary"),
    "h200_seed_formats": (0.05, "torch_save-dma-per_group-all-all"),
    "hf_oracle": (1.0, "long_doc_qa/pickle-*"),  # test_hf_engine runs its shm case
    "h200_hf_oracle": (0.05, "*"),  # a 27B-parameter model: skipped without CUDA
    "h200_hf_layerwise": (0.05, "*"),
    "h100_hf_layerwise": (0.05, "*"),  # the same on an 80 GB card (48 of 64 layers)
    "compare_cpu": (0.3, "*"),  # whole in test_compare_real.py
    "vllm_connector": (1.0, "shm-*"),  # needs vLLM: runs in `nox -s vllm`, skipped elsewhere
}


def bench(scenario: str, out: Path, *extra: str) -> int:
    return main(["bench", str(SCENARIOS / f"{scenario}.toml"), "--out", str(out), "--no-report", *extra])


def test_every_shipped_scenario_has_a_quick_setting():
    assert sorted(SHIPPED) == sorted(p.stem for p in SCENARIOS.glob("*.toml"))


@pytest.mark.slow  # 30-75 s each on 2 busy cores: the real runner end to end
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_scenario_runs_verified(name: str, tmp_path: Path, capsys):
    factor, cases = SHIPPED[name]
    if load_scenario(SCENARIOS / f"{name}.toml").scenario.device == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"{name} needs a CUDA device")
    if load_scenario(SCENARIOS / f"{name}.toml").scenario.engine == "vllm":
        pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` runs this scenario")
    assert bench(name, tmp_path / "run", "--quick", str(factor), "--cases", cases) == 0
    err = capsys.readouterr().err
    run = load_run(tmp_path / "run").require_complete()
    scenario = load_scenario(SCENARIOS / f"{name}.toml").scaled(factor).scenario
    chunk = scenario.model.resolved_chunk_tokens()
    assert run.record.scenario["scale"] == factor
    assert run.record.calibration["d2h_peak_gbps"] > 0
    assert run.cases and all(c.status == "ok" for c in run.cases)
    assert len(re.findall(r"^\[\d+/\d+\] .*: ok ", err, re.M)) == len(run.cases)
    for c in run.cases:
        m, rows = c.metrics, run.rows_of(c)
        assert m["corrupt_chunks"] == 0 and m["verified_chunks"] > 0, c.key
        assert m["server_rss_mib"] > 0, c.key
        if c.axes["wire_format"] not in SERVER_IMPORTS_TORCH:  # a legacy format loads torch (CUDA build: its libs)
            assert m["server_cuda_mapped"] is False, c.key
        # every loaded chunk was verified: bytes_loaded > 0 exactly where a hit was
        assert all((r.hit_tokens > 0) == (r.bytes_loaded > 0) for r in rows)
        assert sum(r.verified_chunks for r in rows) == sum(r.hit_tokens for r in rows) // chunk
        assert all(r.hit_tokens == 0 for r in rows if r.phase == "cold")
        w = next(w for w in scenario.workloads if w.label == c.workload)
        warm = [r for r in rows if r.phase == "warm"]
        if w.kind == "divergence":
            shared = (w.prompt_tokens // chunk // 2) * chunk  # whole shared chunks, inside or at the edge
            assert {r.hit_tokens for r in warm} == {shared}
            # what the warm request shares with the stored prompt, beside it: every case here stores a state at
            # every chunk, so no hit is lost
            assert {r.shared_tokens for r in warm} == {shared} and m["hit_share"] == 1.0
        elif w.kind == "l1_pressure":
            counters = c.details["server_counters"]
            assert counters["l2_spills"] > 0 and counters["l2_prefetches"] > 0
            assert counters["l2_prefetch_failures"] == 0
            assert {r.hit_tokens for r in warm} == {w.prompt_tokens}
        elif w.kind == "multi_turn":  # turn t resumes all of turn t-1's full chunks
            assert all(r.hit_tokens == (r.prompt_tokens - w.turn_tokens) // chunk * chunk for r in warm)
        else:
            assert all(r.hit_tokens > 0 for r in warm)
    assert not list((tmp_path / "run").glob(".tmp")), "the run's temp area was left behind"


def _flip(arena: str, offset: int) -> None:
    with open(arena, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        mm[offset] ^= 0xFF


def test_corrupted_arena_is_counted_and_fails_the_gate(tmp_path: Path):
    flipped: list[str] = []

    def corrupt_first_hit(hit, server):
        if hit.hit_chunks and not flipped:  # the first hit of each case: one chunk corrupt per case
            o = next(o for o in hit.objects if o.chunk == hit.hit_chunks - 1)
            _flip(server.arena_path, o.offset + o.length // 2)
            flipped.append(server.arena_path)

    sf = load_scenario(SCENARIOS / "smoke.toml").scaled(0.5)
    outcome = None
    for fmt in ("shm", "raw"):
        flipped.clear()
        outcome = run_bench(sf, BenchOptions(out=tmp_path / fmt, cases=f"long_doc_qa/{fmt}-kernel-single-boundary-all",
                                             before_retrieve=corrupt_first_hit))
        run = load_run(outcome.folder)
        (case,) = run.cases
        assert case.status == "ok" and case.metrics["corrupt_chunks"] == 1, fmt
        result = gate(run, None)
        assert result.exit_code == 1
        assert [c.check for c in result.failed] == ["corrupt_chunks"]


@pytest.mark.slow
def test_dead_server_fails_its_case_and_the_run_goes_on(tmp_path: Path):
    killed: list[int] = []

    def kill_once(hit, server):
        if hit.hit_chunks and not killed:
            killed.append(server.pid)
            os.kill(server.pid, signal.SIGKILL)
            server.proc.wait()

    sf = load_scenario(SCENARIOS / "smoke.toml").scaled(0.5)
    t0 = time.monotonic()
    outcome = run_bench(sf, BenchOptions(out=tmp_path / "run", cases="long_doc_qa/shm-*-boundary-all",
                                         before_retrieve=kill_once))
    assert time.monotonic() - t0 < 30, "a dead server must fail the case at once, not at a client timeout"
    run = load_run(outcome.folder).require_complete()
    first, second = run.cases
    assert first.status == "failed" and first.error.startswith("server exited with status -9")
    assert second.status == "ok" and second.metrics["corrupt_chunks"] == 0
    assert outcome.failed == [first.key]
    assert not Path(f"/proc/{killed[0]}").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="cuda_ipc runs on a GPU machine")
@pytest.mark.slow
def test_a_case_that_cannot_run_here_is_a_failed_case(tmp_path: Path, capsys):
    text = (SCENARIOS / "smoke.toml").read_text().replace('name = "smoke"', 'name = "ipc"')
    text = re.sub(r"wire_format = \[.*\]", 'wire_format = ["cuda_ipc", "shm"]', text)
    (tmp_path / "ipc.toml").write_text(text)
    rc = main(["bench", str(tmp_path / "ipc.toml"), "--quick", "0.5", "--cases", "long_doc_qa/*-kernel-*-boundary-all",
               "--out", str(tmp_path / "run")])
    assert rc == 1
    captured = capsys.readouterr()
    assert "1 of 2 cases failed: long_doc_qa/cuda_ipc-kernel-single-boundary-all" in captured.err
    assert f"report: {tmp_path / 'run' / 'report.md'}" in captured.out
    run = load_run(tmp_path / "run").require_complete()
    ipc, shm = run.cases
    assert ipc.status == "failed" and "cuda_ipc needs the engine's pages on a CUDA device" in ipc.error
    assert shm.status == "ok"


def test_external_server_is_used_and_its_probes_not_measured(tmp_path: Path):
    sock = Path(os.environ.get("TMPDIR", "/tmp")) / f"hkv-ext-{os.getpid()}"
    sock.mkdir(mode=0o700)
    # admin: the runner reads Stats
    server = start_server(ServerConfig(endpoint=f"ipc://{sock}/s.sock", l1_bytes=GIB // 16, admin=True))
    try:
        sf = load_scenario(SCENARIOS / "smoke.toml").scaled(0.5)
        outcome = run_bench(sf, BenchOptions(out=tmp_path / "run", server=server.endpoint,
                                             cases="fan_out/shm-kernel-single-boundary-all"))
        (case,) = load_run(outcome.folder).cases
        assert case.status == "ok" and case.metrics["verified_chunks"] > 0
        assert case.metrics["server_vram_mib"] is None and case.metrics["server_cuda_mapped"] is None
        assert "not measured" in case.details["server"]
        assert server.alive()
    finally:
        server.stop()
        server.close()
        shutil.rmtree(sock)


def test_user_errors_are_one_line_exit_2(tmp_path: Path, capsys):
    def error(*argv: str) -> str:
        assert main(["bench", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("hybridkv bench: error: "), err
        return err

    assert "cannot read scenario file" in error(str(tmp_path / "nope.toml"))
    (tmp_path / "bad.toml").write_text("name = 'bad'\n")
    assert "bad.toml" in error(str(tmp_path / "bad.toml"))
    smoke = str(SCENARIOS / "smoke.toml")
    assert "scale factor must lie in (0, 1]" in error(smoke, "--quick", "2")
    assert "matches no case" in error(smoke, "--cases", "nothing-*", "--out", str(tmp_path / "r1"))
    assert "no hybridkv server answered" in error(smoke, "--server", f"ipc://{tmp_path}/none.sock",
                                                  "--out", str(tmp_path / "r2"))
    assert "expected ipc://PATH" in error(smoke, "--server", "localhost:1", "--out", str(tmp_path / "r3"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "not overwriting" in error(smoke, "--quick", "--out", str(tmp_path / "full"))
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def _is_server(p: psutil.Process) -> bool:
    try:
        return "serve" in p.cmdline()
    except psutil.Error:  # exited while we looked
        return False


def _arenas() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("hybridkv-*.arena")}


@pytest.mark.slow  # a real smoke bench until its second case (about 60 s on 2 busy cores)
def test_interrupt_stops_servers_and_leaves_an_incomplete_run(tmp_path: Path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("reference_impl", "kernels",
                                                                                 "harness"))}
    # A suite started in the background (`pytest &`) inherits SIGINT ignored, and Python keeps it ignored:
    # the child puts the default back before exec so that its Ctrl-C handling is what this test sees.
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "bench", str(SCENARIOS / "smoke.toml"),
                             "--out", str(out)], stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:  # wait until a case finished, so that one is recorded and another runs
        lines.append(line)
        if line.startswith("[1/"):
            break
    servers: set[int] = set()
    deadline = time.monotonic() + 90  # the next case's server may take a while to start (CUDA machines)
    while not servers and time.monotonic() < deadline:
        time.sleep(0.1)
        servers = {c.pid for c in psutil.Process(proc.pid).children() if _is_server(c)}
    assert servers, "a case's server should be running"
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(60) == 130, lines + [rest]
    assert "interrupted" in rest and "Traceback" not in rest
    record = msgspec.json.decode((out / "run.json").read_bytes())
    assert record["complete"] is False and 1 <= len(record["cases"]) < 32
    assert not [p for p in servers if psutil.pid_exists(p)]  # stopped, and their arenas removed
    assert not [a for a in _arenas() if any(f"-{pid}-" in a for pid in servers)]
    assert not (out / ".tmp").exists()
    assert main(["gate", str(out), "--baseline", str(REPO / "results/baselines/smoke-cpu.toml")]) == 1


def test_page_contents_differ_per_page_and_are_never_constant():
    import torch
    from hybridkv_bench.engines.pools import PagePattern, page_seed

    key_a, key_b = bytes(range(16)), bytes(range(1, 17))
    seeds = [page_seed(k, g, layer, j)
             for k in (key_a, key_b) for g in range(2) for layer in range(2) for j in range(2)]
    assert len(set(seeds)) == len(seeds)
    pages = PagePattern(10240, torch.device("cpu")).pages(seeds)
    assert pages.shape == (len(seeds), 10240)
    words = pages.view(torch.int64)
    for i in range(len(seeds)):
        assert len(set(words[i].tolist())) == words.shape[1]  # no repeated word inside a page
        for j in range(i):
            assert bool((words[i] != words[j]).all())  # two pages differ in every word
    assert torch.equal(PagePattern(10240, torch.device("cpu")).pages(seeds[:1]), pages[:1])  # deterministic
