"""The engine's paged caches as the transfer library sees them: page views per group, checked against the
layout, and the comparison of block lists a prepared store uses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from hybridkv_kernels import PagedLayers

from hybridkv.model.layout import LayoutError, ModelLayout


def paged_groups(layout: ModelLayout, pages) -> list[PagedLayers]:
    """Page views per group, checked against the layout (layer count, names, page size)."""
    if isinstance(pages, Mapping):
        missing = [n for g in layout.groups for n in g.layer_names if n not in pages]
        if missing:
            raise LayoutError(f"no cache tensor for layers {missing[:4]}{'...' if len(missing) > 4 else ''}")
        per_group = [[pages[n] for n in g.layer_names] for g in layout.groups]
    else:
        per_group = [list(p) for p in pages]
    if len(per_group) != len(layout.groups):
        raise LayoutError(f"layout has {len(layout.groups)} groups, pages were given for {len(per_group)}")
    out = []
    for i, (g, views) in enumerate(zip(layout.groups, per_group, strict=True)):
        if len(views) != g.num_layers:
            raise LayoutError(f"group {i} has {g.num_layers} layers, {len(views)} page views were given")
        paged = PagedLayers.from_views(views)
        if paged.page_bytes != g.page_bytes:
            raise LayoutError(f"group {i}: pages of {paged.page_bytes} B, the layout says {g.page_bytes} B")
        out.append(paged)
    if len({p.device for p in out}) != 1:
        raise LayoutError("every group's pages must be on one device")
    return out


def engine_pages(layout: ModelLayout, caches: Mapping) -> list[list]:
    """Per group, per layer: a (blocks, page bytes) view of the engine's cache tensor `caches[layer]`.

    An attention backend may split each of the engine's blocks into several smaller kernel blocks (vLLM does
    when the backend's kernels take fewer tokens per block than the hybrid block). The tensor's rows are
    then kernel blocks and no row holds a whole page. That is refused by name: which layer, into how many
    kernel blocks, and which setting keeps one kernel block per block."""
    from hybridkv_kernels import page_view

    missing = [n for g in layout.groups for n in g.layer_names if n not in caches]
    if missing:
        raise LayoutError(f"vLLM registered no cache tensor for layers {missing[:4]}")
    out = []
    for g in layout.groups:
        views = []
        for name in g.layer_names:
            t = caches[name]
            row = t.stride(0) * t.element_size() if t.dim() else 0
            if g.kind == "attention" and 0 < row < g.page_bytes and g.page_bytes % row == 0:
                k = g.page_bytes // row
                raise LayoutError(
                    f"the attention backend splits layer {name}'s {g.block_tokens}-token blocks into {k} kernel "
                    f"blocks of {g.block_tokens // k} tokens; hybridkv moves whole blocks and needs one kernel block "
                    "per block: choose an attention backend that takes the hybrid block size as its kernel block "
                    "(FlashAttention: --attention-backend FLASH_ATTN)")
            try:
                views.append(page_view(t, g.page_bytes))
            except ValueError as e:
                raise LayoutError(f"vLLM's cache tensor of {name} does not hold the layout's pages: {e}") from None
        out.append(views)
    return out


def same_blocks(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> bool:
    """Whether two per-group block lists name the same blocks."""
    return a is b or (len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)))
