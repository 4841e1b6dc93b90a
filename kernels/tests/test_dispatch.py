"""The one copy-engine knob: what each choice runs, by page size and device, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from hybridkv_kernels import DMA_MIN_PAGE_BYTES, available_impls, choose_impl, cuda_batch


@pytest.mark.parametrize("page_bytes,want_cpu,want_cuda", [
    (DMA_MIN_PAGE_BYTES, "dma", "dma"),
    (3_211_264, "dma", "dma"),
    (DMA_MIN_PAGE_BYTES - 16, "torch", "triton"),
    (65_536, "torch", "triton"),
])
def test_auto_picks_dma_for_large_pages_and_the_kernel_below(page_bytes, want_cpu, want_cuda):
    assert choose_impl("auto", page_bytes, "cpu") == want_cpu
    if torch.cuda.is_available() and "triton" in available_impls("cuda"):
        # a driver that batches memcpys makes DMA the choice at every page size: the kernel takes the model's SMs
        assert choose_impl("auto", page_bytes, "cuda") == ("dma" if cuda_batch.available() else want_cuda)


def test_the_batch_switch_is_an_explicit_setting(monkeypatch):
    """`cuda_batch.set_enabled(False)` (what a benchmark's `--dma-batch off` calls) turns the batched path off and
    `auto` then picks as on a driver without it; the environment no longer does (nothing below the edge reads it)."""
    monkeypatch.setenv("HYBRIDKV_DMA_BATCH", "0")
    on = cuda_batch.available()
    assert on == (cuda_batch._driver() is not None)  # the old variable changes nothing
    cuda_batch.set_enabled(False)
    try:
        assert cuda_batch.get() is None and not cuda_batch.available()
        if torch.cuda.is_available() and "triton" in available_impls("cuda"):
            assert choose_impl("auto", 65_536, "cuda") == "triton"
    finally:
        cuda_batch.set_enabled(True)
    assert cuda_batch.available() == on


def test_kernel_is_the_torch_reference_on_cpu_even_under_the_interpreter():
    # Triton's CPU interpreter is a test tool; a CPU engine asking for the kernel gets torch.
    assert choose_impl("kernel", 4096, "cpu") == "torch"
    assert choose_impl("dma", 4096, "cpu") == "dma"
    assert choose_impl("torch", 1 << 22, "cpu") == "torch"


def test_pinned_triton_needs_triton_on_that_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        choose_impl("triton", 4096, "cpu")


@pytest.mark.parametrize("engine,pages,match", [("fast", 4096, "copy engine must be one of"),
                                                ("auto", 0, "page_bytes must be positive")])
def test_bad_choices_are_named(engine, pages, match):
    with pytest.raises(ValueError, match=match):
        choose_impl(engine, pages, "cpu")
