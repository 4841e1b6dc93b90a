"""The copy-engine names and `auto`'s threshold, importable without torch (scenarios validate them)."""

from __future__ import annotations

from typing import Literal, get_args

Impl = Literal["torch", "triton", "dma"]
IMPLS: tuple[Impl, ...] = get_args(Impl)
CopyEngine = Literal["auto", "kernel", "dma", "triton", "torch"]
COPY_ENGINES: tuple[CopyEngine, ...] = get_args(CopyEngine)
# Where the driver cannot batch memcpys, `auto` takes DMA from pages of this size up and the kernel below: one
# copy per page is launch-bound on small pages, while on large ones DMA comes closer to the PCIe ceiling than the
# kernel (kernels/README.md, "The copy engine: one knob" and "H200 results").
DMA_MIN_PAGE_BYTES = 1 << 20
# With the driver's batched memcpy (hybridkv_kernels.cuda_batch) `auto` takes DMA at every page size: the copy
# engines leave the SMs to the model, the Triton kernel does not (kernels/README.md, "Compute beside the copies").
