"""One engine's paged KV cache (`EnginePools`: vLLM-shaped page views over shared per-layer buffers and a block
allocator, `hybridkv_bench.pools`) and the known contents its pages get (`PagePattern`, from a `page_seed` of chunk
key, group, layer and block): what the simulated and transformers engines allocate and the runner hands out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hybridkv.model.layout import ModelLayout

from hybridkv_bench.pools import BlockAllocator, vllm_pools

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd: word index * GOLDEN is a bijection, so words of one page all differ
_MIX = 0xBF58476D1CE4E5B9     # odd: multiplying by it is a bijection, so pages of different seeds differ in every word


def _int64(x: int) -> int:
    """An unsigned 64-bit value as the signed int64 torch stores (same bits)."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def page_seed(key: bytes, group: int, layer: int, block: int) -> int:
    """The seed of one page: chunk key, group, layer within the group, block within the chunk."""
    base = int.from_bytes(key[:8], "little")
    return _int64(_splitmix64(base ^ _splitmix64((group << 40) | (layer << 20) | block)))


class PagePattern:
    """Page contents from a seed: int64 word w is (w * GOLDEN ^ seed) * MIX mod 2**64."""

    def __init__(self, page_bytes: int, device: torch.device):
        self.page_bytes = page_bytes
        words = -(-page_bytes // 8)
        self._index = torch.arange(words, dtype=torch.int64, device=device).mul_(_int64(_GOLDEN))

    def pages(self, seeds: Sequence[int]) -> torch.Tensor:
        """(len(seeds), page_bytes) uint8 pages, one per seed."""
        s = torch.tensor(list(seeds), dtype=torch.int64, device=self._index.device)
        x = torch.bitwise_xor(self._index.unsqueeze(0), s.unsqueeze(1)).mul_(_int64(_MIX))
        return x.view(torch.uint8)[:, :self.page_bytes]


class EnginePools:
    """One engine's paged KV cache: page views per group per layer over shared buffers, and its allocator."""

    def __init__(self, layout: ModelLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.device = device
        self.num_blocks = num_blocks
        self.pages = vllm_pools(layout, num_blocks, device)
        self.allocator = BlockAllocator(num_blocks)
        self.pattern = PagePattern(layout.groups[0].page_bytes, device)

    @staticmethod
    def blocks_for(layout: ModelLayout, tokens: int) -> list[int]:
        """Blocks a `tokens`-long prompt takes in each group."""
        return [-(-tokens // g.block_tokens) for g in layout.groups]

    @classmethod
    def for_prompts(cls, layout: ModelLayout, max_tokens: int, device: torch.device) -> EnginePools:
        """Pools large enough for one request of `max_tokens` at a time."""
        return cls(layout, sum(cls.blocks_for(layout, max_tokens)), device)
