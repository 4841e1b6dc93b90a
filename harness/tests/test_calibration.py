"""The copy ceilings: every figure present and plausible on CPU; bad requests named; CUDA ones on a GPU."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hybridkv_bench.calibration.copies import Calibration, ProbeError, calibrate


def test_cpu_calibration_has_every_ceiling_the_metrics_divide_by():
    cal = calibrate("cpu", nbytes=32 << 20, iterations=3)
    assert cal.method == "cpu-memcpy" and cal.iterations == 3 and len(cal.d2h_samples_gbps) == 3
    assert 0.2 < cal.d2h_peak_gbps < 500 and cal.h2d_peak_gbps == cal.d2h_peak_gbps
    assert cal.host_memcpy_gbps == cal.d2h_peak_gbps
    assert cal.bidir_peak_gbps is not None and 0.2 < cal.bidir_peak_gbps < 1000
    assert cal.gpus == 0 and cal.aggregate_d2h_gbps is None and cal.per_gpu_d2h_gbps == []
    # run.json holds it as plain data and reads it back
    assert msgspec.convert(msgspec.to_builtins(cal), Calibration) == cal


@pytest.mark.parametrize("kwargs,match", [(dict(device="tpu"), "unknown device"),
                                          (dict(device="cpu", iterations=0), "iterations must be >= 1")])
def test_bad_calibration_requests_are_named(kwargs, match):
    with pytest.raises(ProbeError, match=match):
        calibrate(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_calibrate_cuda_without_a_gpu_is_an_error():
    with pytest.raises(ProbeError, match="torch sees no CUDA device"):
        calibrate("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_calibration_measures_both_directions_at_once_and_all_gpus():
    cal = calibrate("cuda", nbytes=256 << 20, iterations=2, all_gpus=True)
    assert cal.method == "cuda-pinned-events" and cal.gpus == torch.cuda.device_count()
    assert cal.bidir_peak_gbps is not None and cal.bidir_peak_gbps > max(cal.d2h_peak_gbps, cal.h2d_peak_gbps) * 0.5
    assert len(cal.per_gpu_d2h_gbps) == cal.gpus and cal.aggregate_h2d_gbps is not None
