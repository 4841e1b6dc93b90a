"""Helpers shared by the harness tests (imported by name: a module called conftest would collide with the
other components' conftest files when the whole suite runs)."""

from __future__ import annotations

import random
from pathlib import Path

from hybridkv_bench.metrics import RequestRow, case_metrics
from hybridkv_bench.prefill import prefill_seconds
from hybridkv_bench.results.folder import CaseResult, RunWriter
from hybridkv_bench.scenario.load import ScenarioFile
from hybridkv_bench.scenario.sizes import prefix_bytes
from hybridkv_bench.scenario.spec import expand_matrix

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "scenarios"
CALIBRATION = {"method": "cpu-memcpy", "device": "test", "bytes": 1 << 28, "iterations": 5,
               "d2h_peak_gbps": 20.0, "h2d_peak_gbps": 20.0}
RATE_GBPS = {"shm": 15.0, "raw": 8.0, "pickle": 0.7, "torch_save": 0.9, "cuda_ipc": 12.0}


def fake_rows(sf: ScenarioFile, case_name: str, axes: dict, workload, seed: int = 0,
              rate_scale: float = 1.0, noise: float = 0.05) -> list[RequestRow]:
    """Cold then warm requests per repeat (warm-up repeats negative), like a long_doc_qa runner; transfers at
    RATE_GBPS x rate_scale, each time with up to `noise` (5%) jitter."""
    s = sf.scenario
    layout = s.model.layout()
    chunk = s.model.resolved_chunk_tokens(layout)
    cfg = s.model.config()
    prompt = getattr(workload, "prompt_tokens", None) or workload.system_tokens
    tail = getattr(workload, "question_tokens", None) or getattr(workload, "user_tokens", 1)
    total = prompt + tail
    hit = prompt // chunk * chunk
    stored = prefix_bytes(layout, chunk, total, axes["store_policy"])
    loaded = prefix_bytes(layout, chunk, hit, axes["retrieve_policy"])
    rate = RATE_GBPS[axes["wire_format"]] * 1e9 * rate_scale
    rng = random.Random(f"{seed}-{case_name}-{workload.label}")
    rows = []
    for rep in range(-s.warmup, s.repeats):
        jitter = lambda: 1 + noise * rng.random()  # noqa: E731
        lookup = 2e-4 * jitter()
        prefill_cold = prefill_seconds(s.prefill, cfg, s.model.tp, total)
        rows.append(RequestRow(case=case_name, workload=workload.label, repeat=rep, request=0, phase="cold",
                               prompt_tokens=total, hit_tokens=0, lookup_s=lookup,
                               store_s=stored / rate * jitter(),
                               load_s=0.0, prefill_s=prefill_cold, ttft_s=lookup + prefill_cold,
                               bytes_stored=stored, bytes_loaded=0, verified_chunks=0, corrupt_chunks=0))
        load = loaded / rate * jitter()
        prefill_warm = prefill_seconds(s.prefill, cfg, s.model.tp, total - hit, hit)
        rows.append(RequestRow(case=case_name, workload=workload.label, repeat=rep, request=1, phase="warm",
                               prompt_tokens=total, hit_tokens=hit, shared_tokens=hit, lookup_s=lookup, store_s=0.0,
                               load_s=load,
                               prefill_s=prefill_warm, ttft_s=lookup + load + prefill_warm, bytes_stored=0,
                               bytes_loaded=loaded, verified_chunks=hit // chunk, corrupt_chunks=0))
    return rows


def server_metrics(wire: str) -> dict:
    torch_in_server = wire in ("pickle", "torch_save", "cuda_ipc")
    return {"server_vram_mib": 612.0 if wire == "cuda_ipc" else 0.0, "server_cuda_mapped": torch_in_server,
            "server_rss_mib": 900.0 if torch_in_server else 120.0, "server_cpu_s": 0.5}


def write_fake_run(folder: Path, sf: ScenarioFile, *, finish: bool = True, fail: set[str] = frozenset(),
                   tamper: dict | None = None, max_cases: int | None = None, seed: int = 0,
                   rate_scale: dict[str, float] | None = None, noise: float = 0.05, drift: float = 1.0) -> Path:
    """A run folder for `sf`; cases named in `fail` fail; `tamper` overrides metrics in run.json; `rate_scale`
    scales the transfer rate of the cases it names; `seed` draws other jitter, of up to `noise` each time; `drift`
    scales every case's rate (a machine a little faster or slower as a whole)."""
    context = {"git_sha": "0" * 40, "git_dirty": False, "host": "test",
               "started_at": "2026-01-01T00:00:00+00:00", "finished_at": None, "argv": ["test"]}
    writer = RunWriter(folder, sf.record(), context, CALIBRATION)
    n = 0
    for workload in sf.scenario.workloads:
        for case in expand_matrix(sf.scenario):
            if max_cases is not None and n >= max_cases:
                break
            n += 1
            if case.name in fail:
                writer.add_case(CaseResult(name=case.name, workload=workload.label, axes=case.axes,
                                           status="failed", error="server went away"))
                continue
            rows = fake_rows(sf, case.name, case.axes, workload, seed, drift * (rate_scale or {}).get(case.name, 1.0),
                             noise)
            writer.add_requests(rows)
            metrics = case_metrics(rows, CALIBRATION, server_metrics(case.axes["wire_format"]))
            metrics.update((tamper or {}).get(case.name, {}))
            writer.add_case(CaseResult(name=case.name, workload=workload.label, axes=case.axes, status="ok",
                                       metrics=metrics))
    if finish:
        writer.finish()
    else:
        writer.close()
    return folder


