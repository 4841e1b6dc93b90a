"""Engine cache tensors seen as pages: `(num_blocks, page_bytes)` uint8 views and their addresses.

A page is opaque bytes. What makes a tensor pageable is only where its bytes live: block b's page is
`page_bytes` contiguous bytes starting at the first byte of `t[block b]`, and pages sit `stride`
bytes apart, where the stride may exceed the page (vLLM shares one raw buffer between layers of
different groups, and FlashAttention's K/V tensor can be restrided so K-then-V is one page).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole untyped storage that `t` lives in."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(t.untyped_storage())


def _is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """True when a tensor with these sizes/strides covers one gap-free, overlap-free run of elements."""
    dims = sorted((st, sz) for sz, st in zip(sizes, strides, strict=True) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def page_view(t: torch.Tensor, page_bytes: int, block_dim: int = 0) -> torch.Tensor:
    """A uint8 `(num_blocks, page_bytes)` view of `t` whose row b is block b's page."""
    if not isinstance(page_bytes, int) or page_bytes <= 0:
        raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
    if not -t.dim() <= block_dim < t.dim():
        raise ValueError(f"block_dim {block_dim} is out of range for a {t.dim()}-d tensor")
    block_dim %= t.dim()
    item = t.element_size()
    num_blocks = t.shape[block_dim]
    if num_blocks == 0:
        raise ValueError(f"tensor has no blocks along dim {block_dim} (shape {tuple(t.shape)})")
    block_stride = t.stride(block_dim) * item
    if num_blocks > 1 and block_stride <= 0:
        raise ValueError(f"block stride {block_stride} B along dim {block_dim} aliases every block")
    # The bytes of one block must be one contiguous run, or the page would interleave other blocks.
    inner_sizes = [s for d, s in enumerate(t.shape) if d != block_dim]
    inner_strides = [s for d, s in enumerate(t.stride()) if d != block_dim]
    if not _is_dense(inner_sizes, inner_strides):
        raise ValueError(
            f"per-block region of a tensor with shape {tuple(t.shape)} and strides {t.stride()} "
            f"is not contiguous bytes along block_dim {block_dim}"
        )
    content = item * int(np.prod(inner_sizes, dtype=np.int64))
    if page_bytes < content:
        raise ValueError(f"page_bytes {page_bytes} is smaller than one block's content of {content} B")
    if num_blocks > 1 and page_bytes > block_stride:
        raise ValueError(f"page_bytes {page_bytes} does not fit inside the block stride of {block_stride} B")
    # The per-block region starts at t[block]'s first byte: with all inner indices 0, that is t's origin
    # only when no inner stride is negative, which torch does not allow.
    start = t.storage_offset() * item
    end = start + (num_blocks - 1) * block_stride + page_bytes
    nbytes = t.untyped_storage().nbytes()
    if end > nbytes:
        raise ValueError(f"the last page ends at byte {end}, past the storage's {nbytes} B")
    return torch.as_strided(storage_bytes(t), (num_blocks, page_bytes), (block_stride, 1), start)


def _check_page_view(v: torch.Tensor) -> None:
    """Reject a tensor that is not a uint8 `(num_blocks, page_bytes)` page view."""
    if v.dtype != torch.uint8:
        raise ValueError(f"a page view must be uint8, got {v.dtype}; build it with page_view()")
    if v.dim() != 2 or v.stride(1) != 1:
        raise ValueError(f"a page view must be 2-d with unit byte stride, got shape {tuple(v.shape)} "
                         f"strides {v.stride()}")
    if v.shape[0] > 1 and v.stride(0) < v.shape[1]:
        raise ValueError(f"page stride {v.stride(0)} B is smaller than page_bytes {v.shape[1]}")


@dataclass(frozen=True, slots=True, eq=False)
class PagedLayers:
    """The L layers of one KV-cache group as page views, with addresses cached for plan building."""

    views: tuple[torch.Tensor, ...]
    page_bytes: int
    num_blocks: int
    device: torch.device
    base: np.ndarray  # int64 (L,): address of block 0's page in each layer
    stride: np.ndarray  # int64 (L,): bytes between consecutive blocks in each layer
    storage_base: np.ndarray  # int64 (L,): address of each layer's storage, which names the allocation

    @classmethod
    def from_views(cls, views: Sequence[torch.Tensor]) -> PagedLayers:
        """Wrap page views (as page_view returns) of one group's layers."""
        views = tuple(views)
        if not views:
            raise ValueError("a group needs at least one layer")
        for v in views:
            _check_page_view(v)
        shapes = {tuple(v.shape) for v in views}
        if len(shapes) != 1:
            raise ValueError(f"layers of one group must share (num_blocks, page_bytes), got {sorted(shapes)}")
        devices = {v.device for v in views}
        if len(devices) != 1:
            raise ValueError(f"layers of one group must be on one device, got {sorted(map(str, devices))}")
        num_blocks, page_bytes = views[0].shape
        return cls(
            views=views,
            page_bytes=int(page_bytes),
            num_blocks=int(num_blocks),
            device=views[0].device,
            base=np.array([v.data_ptr() for v in views], dtype=np.int64),
            stride=np.array([v.stride(0) for v in views], dtype=np.int64),
            storage_base=np.array([v.untyped_storage().data_ptr() for v in views], dtype=np.int64),
        )

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[torch.Tensor], page_bytes: int, block_dim: int = 0
    ) -> PagedLayers:
        """Page-view each engine cache tensor of a group and wrap them."""
        return cls.from_views([page_view(t, page_bytes, block_dim) for t in tensors])

    @property
    def num_layers(self) -> int:
        return len(self.views)

    def object_bytes(self, num_pages: int) -> int:
        """Bytes of one object holding `num_pages` blocks of every layer."""
        return self.num_layers * num_pages * self.page_bytes
