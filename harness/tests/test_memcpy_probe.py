"""The batched memcpy probe: it refuses by name where it cannot run (no GPU, no batched memcpy) instead of crashing,
and the attributes it sets are checked before any reach the driver."""

from __future__ import annotations

import pytest
import torch
from hybridkv_bench.microbench import memcpy_probe
from hybridkv_kernels import cuda_batch


@pytest.mark.skipif(cuda_batch.available(), reason="this machine can run the probe")
def test_the_probe_says_why_it_cannot_run_and_exits_2(capsys):
    assert memcpy_probe.main(["--runs", "8", "--rounds", "1", "--compute"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memcpy_probe: ") and ("no CUDA device" in err or "no batched memcpy" in err)
    with pytest.raises(RuntimeError, match="no batched memcpy here"):
        cuda_batch.set_attributes("any", "prefer_overlap_with_compute")


def test_bad_attributes_are_refused_by_name():
    with pytest.raises(ValueError, match="src_access_order must be one of .*, got 'sideways'"):
        cuda_batch.set_attributes("sideways")
    with pytest.raises(ValueError, match="flags must be one of .*, got 'fast'"):
        cuda_batch.set_attributes("stream", "fast")


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        memcpy_probe.main(["--page-bytes", "10"])
    assert "--page-bytes a multiple of 16" in capsys.readouterr().err


@pytest.mark.cuda
def test_each_attribute_variant_moves_every_page():
    if not cuda_batch.available():
        pytest.skip("the driver has no batched memcpy")
    from hybridkv_kernels.copy_dma import copy_pages_dma

    try:
        for order, flags in memcpy_probe.VARIANTS:
            cuda_batch.set_attributes(order, flags)
            plan = memcpy_probe._plan("gather", 40, 4096, torch.device("cuda"))
            copy_pages_dma(plan, batched=True, stream=torch.cuda.current_stream())
            torch.cuda.synchronize()
            layers, ids, obj = plan.transfers[0]
            assert torch.equal(obj.view(40, 4096).cuda(), layers.views[0][torch.as_tensor(ids).cuda()])
    finally:
        cuda_batch.set_attributes()
