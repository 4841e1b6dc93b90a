"""Compute beside offload (issue 26) on a CPU: the code path the H200 measures, at tiny sizes.

The ratios themselves mean nothing on a 2-core VM; what is checked is that every case measures its
compute alone and beside the copies, reports both against the run's ceiling, and verifies every byte.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from hybridkv_bench.microbench.compute_beside import (
    BenchConfig,
    compute_windows,
    main,
    make_compute,
    make_copy,
    run_matrix,
    table,
    verify,
)

TINY = dict(device="cpu", pages=(4096,), impls=("dma", "torch"), plan_bytes=16 * 4096 * 8, matmul_n=64,
            attn_batch=1, attn_heads=2, attn_len=128, attn_head_dim=16, windows=2, window_s=0.002,
            transfer_alone_s=0.01)


def test_matrix_reports_compute_ratio_beside_the_ceiling(tmp_path) -> None:
    cfg = BenchConfig(**TINY)
    run = run_matrix(cfg, tmp_path, log=lambda _: None)
    cases = run["cases"]
    assert len(cases) == 2 * 2 * 2  # computes x directions x impls
    ceiling = run["calibration"]
    for c in cases:
        assert c["verified"]
        assert c["compute_alone"] > 0 and c["compute_during"] > 0
        assert c["compute_ratio"] == pytest.approx(c["compute_during"] / c["compute_alone"])
        want = ceiling["d2h_peak_gbps"] if c["direction"] == "store" else ceiling["h2d_peak_gbps"]
        assert c["ceiling_gbps"] == want
        assert c["transfer_ratio"] == pytest.approx(c["transfer_gbps"] / want)
        assert c["transfer_gbps"] > 0 and c["transfer_alone_gbps"] > 0
        assert c["plan_pages"] == 16 * 8 and c["ran_impl"] == c["impl"]
    assert {c["compute_unit"] for c in cases} == {"TFLOP/s", "GB/s"}
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["context"]["git_sha"] and saved["cases"] == cases
    rows = list(csv.DictReader((tmp_path / "cases.csv").open()))
    assert len(rows) == len(cases) and "compute_ratio" in rows[0]
    assert table(run).count("\n") == len(cases) + 1


@pytest.mark.parametrize("direction", ["store", "load"])
def test_verify_finds_bytes_the_copy_did_not_move(direction) -> None:
    setup = make_copy(direction, 4096, 16 * 4096 * 4, torch.device("cpu"), seed=1)
    assert verify(setup, "torch", direction)
    # the plan still copies the old block ids: the check, asked about other blocks, must fail
    setup.ids = [(i + 1) % 8 for i in setup.ids]
    assert not verify(setup, "torch", direction)


def test_compute_loads_count_their_work() -> None:
    cfg = BenchConfig(**TINY)
    mm = make_compute("matmul", cfg, torch.device("cpu"))
    assert mm.work == 2 * 64**3 and mm.unit == "TFLOP/s"
    attn = make_compute("attention", cfg, torch.device("cpu"))
    assert attn.work == 2 * 1 * 2 * 128 * 16 * 4 and attn.unit == "GB/s"  # K and V, fp32 on a CPU
    assert attn.step().shape == (1, 2, 1, 16)


@pytest.mark.parametrize("bad", [dict(impls=("cuda",)), dict(pages=(100,)), dict(windows=0),
                                 dict(launch="graph"), dict(plan_bytes=4096), dict(link_fractions=(0.0,)),
                                 dict(link_fractions=(1.5,)), dict(link_fractions=())])
def test_config_rejects_bad_values(bad) -> None:
    with pytest.raises(ValueError):
        BenchConfig(**{**TINY, **bad})


def test_cli_runs_quick_on_cpu_and_plots(tmp_path, capsys) -> None:
    assert main(["--device", "cpu", "--quick", "--pages", "4096", "--computes", "matmul", "--directions", "load",
                 "--out", str(tmp_path)]) == 0
    assert "compute_ratio" in capsys.readouterr().out
    assert main(["--plot", str(tmp_path)]) == 0
    assert (tmp_path / "compute_ratio.png").stat().st_size > 1000


def test_a_starved_measurement_stops_at_its_time_limit() -> None:
    cfg = BenchConfig(**TINY)
    mm = make_compute("matmul", cfg, torch.device("cpu"))
    assert len(compute_windows(mm, 1, 50, torch.device("cpu"), None, max_s=0.0)) == 1
    assert len(compute_windows(mm, 1, 4, torch.device("cpu"), None)) == 4


def test_a_paced_copy_loop_queues_no_plan_before_its_time() -> None:
    """At a pace of two plans a second the loop has queued at most 1 + 2 x elapsed plans (plus the one it may be
    queueing), however fast the copies run; unpaced it runs ahead of that."""
    import time

    from hybridkv_bench.microbench.copy_loop import CopyLoop

    setup = make_copy("load", 4096, 16 * 4096 * 8, torch.device("cpu"), seed=1)
    t0 = time.perf_counter()
    with CopyLoop(setup, "torch", torch.device("cpu"), rate_gbps=2 * setup.nbytes / 1e9) as loop:
        time.sleep(0.5)
    elapsed = time.perf_counter() - t0
    assert 1 <= loop.bytes // setup.nbytes <= 2 + 2 * elapsed
    with CopyLoop(setup, "torch", torch.device("cpu")) as fast:
        time.sleep(0.5)
    assert fast.bytes // setup.nbytes > 2 + 2 * elapsed
    with pytest.raises(ValueError, match="rate_gbps"):
        CopyLoop(setup, "torch", torch.device("cpu"), rate_gbps=-1.0)


def test_link_fractions_give_one_case_each(tmp_path) -> None:
    run = run_matrix(BenchConfig(**{**TINY, "impls": ("torch",), "computes": ("matmul",), "directions": ("load",),
                                    "link_fractions": (1.0, 0.5)}), tmp_path, log=lambda s: None)
    assert [c["link_fraction"] for c in run["cases"]] == [1.0, 0.5]
    assert all(c["verified"] for c in run["cases"])
