"""Paged multi-group gather/scatter between an engine's KV-cache pages and contiguous objects.

The copy-engine names load eagerly (no torch); everything else loads torch on first use, so a
scenario can name a copy engine without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hybridkv_kernels.engines import COPY_ENGINES, DMA_MIN_PAGE_BYTES, IMPLS, CopyEngine, Impl

if TYPE_CHECKING:
    from hybridkv_kernels.dispatch import available_impls, choose_impl, gather_pages, run_plan, scatter_pages
    from hybridkv_kernels.pages import PagedLayers, page_view, storage_bytes
    from hybridkv_kernels.plan import (
        HOLE,
        EnginePages,
        PageCopyPlan,
        PageTransfer,
        build_plan,
        plan_gather,
        plan_pages,
        plan_scatter,
    )

_LAZY = {
    "available_impls": "dispatch", "choose_impl": "dispatch", "gather_pages": "dispatch", "run_plan": "dispatch",
    "scatter_pages": "dispatch", "PagedLayers": "pages", "page_view": "pages", "storage_bytes": "pages",
    "HOLE": "plan", "PageCopyPlan": "plan", "PageTransfer": "plan", "build_plan": "plan", "plan_gather": "plan",
    "plan_scatter": "plan", "EnginePages": "plan", "plan_pages": "plan",
}


def __getattr__(name: str):
    """Import the torch-backed names on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridkv_kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridkv_kernels.{module}"), name)


__all__ = [
    "COPY_ENGINES",
    "DMA_MIN_PAGE_BYTES",
    "HOLE",
    "IMPLS",
    "EnginePages",
    "CopyEngine",
    "Impl",
    "PageCopyPlan",
    "PageTransfer",
    "PagedLayers",
    "available_impls",
    "build_plan",
    "choose_impl",
    "gather_pages",
    "page_view",
    "plan_gather",
    "plan_pages",
    "plan_scatter",
    "run_plan",
    "scatter_pages",
    "storage_bytes",
]
