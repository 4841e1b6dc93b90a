"""The copy-engine choice, and running a page copy plan with it on a given stream or the current one.

One knob, `CopyEngine`: `auto` (the default everywhere) picks `dma` on CUDA whenever the driver batches
memcpys (`cuda_batch`), at every page size, because the copy engines cost the model's compute little and the
kernel takes SMs from it (`engines.py` has the figures); without batching `dma` for pages of at least
`DMA_MIN_PAGE_BYTES` and `kernel` below, where one copy per page is launch-bound (kernels/README.md); `kernel` is
the one-launch Triton gather/scatter on CUDA and the torch reference elsewhere (Triton compiles for
no CPU; its interpreter is a test tool, far slower than torch there); `dma`, `triton` and
`torch` pin one implementation (benchmarks, tests, comparisons).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Sequence

import torch

from hybridkv_kernels import cuda_batch
from hybridkv_kernels.copy_dma import DmaRuns, copy_pages_dma
from hybridkv_kernels.copy_torch import copy_pages_torch
from hybridkv_kernels.engines import COPY_ENGINES, DMA_MIN_PAGE_BYTES, IMPLS, Impl
from hybridkv_kernels.plan import PageCopyPlan, PageTransfer, plan_gather, plan_scatter


def _triton_runner() -> Callable[[PageCopyPlan], None]:
    """The Triton implementation, imported only when asked for so a CPU install needs no Triton."""
    from hybridkv_kernels.copy_triton import copy_pages_triton

    return copy_pages_triton


@functools.cache
def _triton_installed() -> bool:
    """Looked up once: run_plan asks on every call, on the transfer's critical path."""
    return importlib.util.find_spec("triton") is not None


def _triton_usable(device: torch.device) -> bool:
    """True when Triton is installed and can run on `device` (CUDA, or anywhere under its interpreter)."""
    if not _triton_installed():
        return False
    # TRITON_INTERPRET is Triton's own switch, read by Triton itself when `@triton.jit` runs: set, its kernels run
    # on the CPU in numpy. This read is the edge, not a setting of ours read deep inside: it only mirrors what
    # Triton will do in this process, so a pinned `triton` on a CPU engine is refused by name rather than failing
    # inside Triton. A parameter passed down instead could disagree with the variable Triton acts on. It changes
    # no automatic choice: `auto` and `kernel` pick Triton on CUDA only, whatever the variable says.
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def available_impls(device: torch.device | str) -> list[Impl]:
    """Implementation names that can run plans whose engine pages are on `device`."""
    device = torch.device(device)
    return [name for name in IMPLS if name != "triton" or _triton_usable(device)]


def choose_impl(engine: str, page_bytes: int, device: torch.device | str) -> Impl:
    """The implementation copy engine `engine` uses for pages of `page_bytes` on `device`."""
    device = torch.device(device)
    if engine not in COPY_ENGINES:
        raise ValueError(f"copy engine must be one of {COPY_ENGINES}, got {engine!r}")
    if page_bytes < 1:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    if engine == "auto":
        batched = device.type == "cuda" and cuda_batch.available()
        engine = "dma" if batched or page_bytes >= DMA_MIN_PAGE_BYTES else "kernel"
    if engine == "kernel":
        return "triton" if device.type == "cuda" and _triton_usable(device) else "torch"
    impl: Impl = "dma" if engine == "dma" else "triton" if engine == "triton" else "torch"
    if impl not in available_impls(device):
        raise ValueError(f"copy engine {engine!r} cannot run on {device}; available: {available_impls(device)}")
    return impl


_RUNNERS: dict[str, Callable[[PageCopyPlan], None]] = {"torch": copy_pages_torch, "dma": copy_pages_dma}


def run_plan(plan: PageCopyPlan, engine: str = "auto", stream: torch.cuda.Stream | None = None,
             runs: DmaRuns | None = None) -> None:
    """Enqueue every copy of `plan` with copy engine `engine` on `stream` (or the current stream);
    never synchronizes. `runs`: the plan's `dma_runs`, made ahead (used when the engine is DMA).

    The caller orders `stream` after whatever produced the sources (e.g. `stream.wait_stream(...)`)
    and keeps the plan's tensors alive until the copies finish.
    """
    impl = choose_impl(engine, plan.page_bytes, plan.device)
    if impl == "dma":  # takes the stream itself: no switch of the thread's current stream on the hot path
        copy_pages_dma(plan, stream=stream, runs=runs)
        return
    runner = _RUNNERS.get(impl) or _triton_runner()
    if stream is not None and plan.device.type != "cuda":
        raise ValueError(f"a CUDA stream was given for a plan on {plan.device}")
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        runner(plan)


def gather_pages(transfers: Sequence[PageTransfer | tuple], engine: str = "auto",
                 stream: torch.cuda.Stream | None = None) -> PageCopyPlan:
    """Plan and enqueue a gather of engine pages into objects; returns the plan (it holds the tensors)."""
    plan = plan_gather(transfers)
    run_plan(plan, engine, stream)
    return plan


def scatter_pages(transfers: Sequence[PageTransfer | tuple], engine: str = "auto",
                  stream: torch.cuda.Stream | None = None) -> PageCopyPlan:
    """Plan and enqueue a scatter of objects into engine pages; returns the plan (it holds the tensors)."""
    plan = plan_scatter(transfers)
    run_plan(plan, engine, stream)
    return plan
