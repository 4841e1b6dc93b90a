"""Choosing and running an implementation of a page copy plan, on a given stream or the current one."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Sequence

import torch

from hybridkv_kernels.copy_dma import copy_pages_dma
from hybridkv_kernels.copy_torch import copy_pages_torch
from hybridkv_kernels.plan import PageCopyPlan, PageTransfer, plan_gather, plan_scatter

IMPLS = ("torch", "triton", "dma")


def _triton_runner() -> Callable[[PageCopyPlan], None]:
    """The Triton implementation, imported only when asked for so a CPU install needs no Triton."""
    from hybridkv_kernels.copy_triton import copy_pages_triton

    return copy_pages_triton


def _triton_usable(device: torch.device) -> bool:
    """True when Triton is installed and can run on `device` (CUDA, or anywhere under its interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return False
    # TRITON_INTERPRET is Triton's own switch: when set, its jit runs kernels on the CPU in numpy.
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def available_impls(device: torch.device | str) -> list[str]:
    """Implementation names that can run plans whose engine pages are on `device`."""
    device = torch.device(device)
    return [name for name in IMPLS if name != "triton" or _triton_usable(device)]


def default_impl(device: torch.device | str) -> str:
    """The implementation to use on `device` when the caller has no preference."""
    device = torch.device(device)
    if device.type == "cuda":
        # One launch for all pages: beats per-page DMA for small pages and needs no staging buffer.
        return "triton" if _triton_usable(device) else "dma"
    return "torch"


def run_plan(plan: PageCopyPlan, impl: str | None = None, stream: torch.cuda.Stream | None = None) -> None:
    """Enqueue every copy of `plan` with `impl` on `stream` (or the current stream); never synchronizes.

    The caller orders `stream` after whatever produced the sources (e.g. `stream.wait_stream(...)`)
    and keeps the plan's tensors alive until the copies finish.
    """
    impl = impl or default_impl(plan.device)
    if impl not in available_impls(plan.device):
        raise ValueError(f"impl {impl!r} is not available on {plan.device}; "
                         f"available: {available_impls(plan.device)}")
    runner = {"torch": copy_pages_torch, "dma": copy_pages_dma}.get(impl) or _triton_runner()
    if stream is not None and plan.device.type != "cuda":
        raise ValueError(f"a CUDA stream was given for a plan on {plan.device}")
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        runner(plan)


def gather_pages(transfers: Sequence[PageTransfer | tuple], impl: str | None = None,
                 stream: torch.cuda.Stream | None = None) -> PageCopyPlan:
    """Plan and enqueue a gather of engine pages into objects; returns the plan (it holds the tensors)."""
    plan = plan_gather(transfers)
    run_plan(plan, impl, stream)
    return plan


def scatter_pages(transfers: Sequence[PageTransfer | tuple], impl: str | None = None,
                  stream: torch.cuda.Stream | None = None) -> PageCopyPlan:
    """Plan and enqueue a scatter of objects into engine pages; returns the plan (it holds the tensors)."""
    plan = plan_scatter(transfers)
    run_plan(plan, impl, stream)
    return plan
