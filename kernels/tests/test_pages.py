"""page_view: the right bytes for each engine layout, and a named error for every layout it cannot page."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybridkv_kernels import PagedLayers, page_view
from kernel_pools import POOLS


@pytest.mark.parametrize("pool_name", sorted(POOLS))
def test_page_rows_are_the_oracle_pages(pool_name):
    pool = POOLS[pool_name](torch.Generator().manual_seed(3))
    for layer, t in enumerate(pool.tensors):
        v = page_view(t, pool.page_bytes, pool.block_dim)
        assert v.shape == (pool.num_blocks, pool.page_bytes) and v.dtype == torch.uint8
        for b in (0, pool.num_blocks // 2, pool.num_blocks - 1):
            np.testing.assert_array_equal(v[b].numpy(), pool.page(layer, b))


def test_view_shares_memory_with_the_engine_tensor():
    t = torch.zeros(4, 8, dtype=torch.float32)
    page_view(t, 32)[2].fill_(0xFF)
    assert torch.isnan(t[2]).all() and not torch.isnan(t[[0, 1, 3]]).any()


def test_padded_page_reaches_into_the_slot():
    # A recurrent state smaller than its page (vLLM pads it): the page covers the padding too.
    raw = torch.arange(5 * 64, dtype=torch.int32).view(torch.uint8).view(5, 256)
    state = raw[:, :200]
    v = page_view(state, 256)
    assert torch.equal(v, raw)


def test_unrestrided_flash_layout_is_rejected():
    kv = torch.zeros(2, 6, 4, 2, 8, dtype=torch.bfloat16)  # K for all blocks, then V: not one page
    with pytest.raises(ValueError, match="not contiguous bytes along block_dim 1"):
        page_view(kv, 2 * 4 * 2 * 8 * 2, block_dim=1)


def test_page_larger_than_block_stride_is_rejected():
    t = torch.zeros(6, 10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="page_bytes 24 does not fit inside the block stride of 20 B"):
        page_view(t, 24)


def test_page_smaller_than_block_content_is_rejected():
    t = torch.zeros(6, 10, dtype=torch.float32)
    with pytest.raises(ValueError, match="page_bytes 16 is smaller than one block's content of 40 B"):
        page_view(t, 16)


def test_last_page_past_storage_is_rejected():
    raw = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="the last page ends at byte 264, past the storage's 256 B"):
        page_view(raw[:, 32:48], 40)


@pytest.mark.parametrize(("page_bytes", "block_dim"), [(0, 0), (-4, 0), (16, 3)])
def test_bad_arguments_are_named(page_bytes, block_dim):
    with pytest.raises(ValueError, match=str(page_bytes) if page_bytes <= 0 else "block_dim 3"):
        page_view(torch.zeros(4, 4), page_bytes, block_dim)


def test_paged_layers_reject_mixed_shapes():
    a, b = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(5, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\(4, 64\).*\(5, 64\)"):
        PagedLayers.from_views([a, b])


def test_paged_layers_reject_typed_views():
    with pytest.raises(ValueError, match="must be uint8, got torch.float32"):
        PagedLayers.from_views([torch.zeros(4, 16)])
