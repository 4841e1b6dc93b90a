"""The engine's paged caches as the transfer library sees them: page views per group, checked against the
layout, and the comparison of block lists a prepared store uses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from hybridkv_kernels import PagedLayers

from hybridkv.layout import LayoutError, ModelLayout


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


def same_blocks(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> bool:
    """Whether two per-group block lists name the same blocks."""
    return a is b or (len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)))
