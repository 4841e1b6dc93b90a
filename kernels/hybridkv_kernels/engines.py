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
# With the driver's batched memcpy (hybridkv_kernels.cuda_batch) `auto` takes DMA at every page size: the copy
# engines leave the SMs to the model, the Triton kernel does not. On the H200 (results/h200/2026-12-01-night/)
# bf16 matmuls kept 0.98-0.99 of their rate beside batched DMA and 0.20-0.25 beside the kernel, decode attention
# 0.92-0.99 and 0.01, at every page size from 64 KiB to 3.2 MB; batched DMA held 0.99-1.00 of the PCIe ceiling
# alone there, the kernel 0.92-0.98.
