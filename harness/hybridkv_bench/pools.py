"""Paged KV-cache pools laid out as vLLM lays out a hybrid model's cache, and a block allocator.

vLLM gives every group the same number of layers and allocates one raw buffer per layer index,
shared by the i-th layer of every group; a block id belongs to one group at a time. So a page of
group g, layer i, block b is bytes [b * page, (b + 1) * page) of buffer i, whatever g is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hybridkv.model.layout import ModelLayout


def vllm_pools(layout: ModelLayout, num_blocks: int, device: torch.device | str = "cpu") -> list[list[torch.Tensor]]:
    """Per group, per layer: a (num_blocks, page_bytes) uint8 page view over shared raw buffers."""
    pages = {g.page_bytes for g in layout.groups}
    if len(pages) != 1:
        raise ValueError(f"vLLM's hybrid layout has one page size; this layout has {sorted(pages)}")
    page = pages.pop()
    width = max(g.num_layers for g in layout.groups)
    raw = [torch.empty(num_blocks, page, dtype=torch.uint8, device=device) for _ in range(width)]
    return [[raw[i] for i in range(g.num_layers)] for g in layout.groups]


def fill_random(pools: list[list[torch.Tensor]], seed: int) -> None:
    """Random bytes (never zeros) in every buffer of `pools`, from a seeded generator on their device."""
    buffers = {id(t): t for group in pools for t in group}.values()
    gen = torch.Generator(device=pools[0][0].device).manual_seed(seed)
    for t in buffers:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device, generator=gen))


class BlockAllocator:
    """Free block ids shared by all groups (their pages share buffers), handed out lowest first."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} blocks asked for, {len(self._free)} of {self.num_blocks} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)
        self._free.sort(reverse=True)
