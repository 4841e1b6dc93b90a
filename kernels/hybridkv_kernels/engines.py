"""The copy-engine names and `auto`'s threshold, importable without torch (scenarios validate them)."""

from __future__ import annotations

from typing import Literal, get_args

Impl = Literal["torch", "triton", "dma"]
IMPLS: tuple[Impl, ...] = get_args(Impl)
CopyEngine = Literal["auto", "kernel", "dma", "triton", "torch"]
COPY_ENGINES: tuple[CopyEngine, ...] = get_args(CopyEngine)
# auto's rule, from the H200 runs of 2026-11-29 (results/h200/2026-11-29/kernels/): on 3.2 MB pages
# per-page DMA reaches 0.94-0.96 of the PCIe ceiling and the Triton kernel 0.90-0.94; on 64 KiB pages
# DMA is launch-bound (0.07-0.13) and the kernel holds 0.89-0.93.
DMA_MIN_PAGE_BYTES = 1 << 20
# With the driver's batched memcpy (hybridkv_kernels.cuda_batch) DMA keeps the copy engines busy back to back:
# on the H200 (2026-12-01, kernels/bench/bench_copy_variants.py) it held 0.92-0.97 of the ceiling on pages of
# 409,600 B (a Qwen3.6-27B TP8 rank) to 3.2 MB, ahead of the kernel (0.82-0.95). Below the smallest page measured,
# the kernel stays the choice.
BATCHED_DMA_MIN_PAGE_BYTES = 409_600
