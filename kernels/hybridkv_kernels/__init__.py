"""Paged multi-group gather/scatter between an engine's KV-cache pages and contiguous objects."""

from hybridkv_kernels.dispatch import (
    COPY_ENGINES,
    DMA_MIN_PAGE_BYTES,
    IMPLS,
    CopyEngine,
    Impl,
    available_impls,
    choose_impl,
    gather_pages,
    run_plan,
    scatter_pages,
)
from hybridkv_kernels.pages import PagedLayers, page_view, storage_bytes
from hybridkv_kernels.plan import PageCopyPlan, PageTransfer, build_plan, plan_gather, plan_scatter

__all__ = [
    "COPY_ENGINES",
    "DMA_MIN_PAGE_BYTES",
    "IMPLS",
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
    "plan_scatter",
    "run_plan",
    "scatter_pages",
    "storage_bytes",
]
