"""vLLM's cache tensors as page views (`hybridkv.engine.paged.engine_pages`): a block-outermost attention
tensor gives one page per block; one whose rows are smaller kernel blocks (an attention backend that splits
vLLM's blocks) is refused at start-up, naming the layer, the split and the setting to change."""

from __future__ import annotations

import pytest
import torch
from hybridkv.engine.paged import engine_pages
from hybridkv.model.layout import LayoutError
from hybridkv.model.presets import model_config, preset_layout

BLOCKS = 6


def _caches(split: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(per layer: the tensor vLLM would register, per layer: its raw bytes) for the tiny hybrid; attention as
    (blocks x split, K/V, tokens / split, heads, head dim) in bf16, recurrent states as raw pages."""
    layout = preset_layout("tiny-hybrid")
    cfg = model_config("tiny-hybrid")
    caches, raw = {}, {}
    gen = torch.Generator().manual_seed(0)
    for g in layout.groups:
        for name in g.layer_names:
            buf = torch.randint(0, 256, (BLOCKS * g.page_bytes,), dtype=torch.uint8, generator=gen)
            raw[name] = buf
            if g.kind == "attention":
                caches[name] = buf.view(torch.bfloat16).view(BLOCKS * split, 2, g.block_tokens // split,
                                                             cfg.num_kv_heads, cfg.head_dim)
            else:
                caches[name] = buf.view(BLOCKS, g.page_bytes)
    return caches, raw


def test_one_page_per_block():
    layout = preset_layout("tiny-hybrid")
    caches, raw = _caches()
    pages = engine_pages(layout, caches)
    for g, views in zip(layout.groups, pages, strict=True):
        for name, v in zip(g.layer_names, views, strict=True):
            assert tuple(v.shape) == (BLOCKS, g.page_bytes)
            assert torch.equal(v[3], raw[name][3 * g.page_bytes:4 * g.page_bytes])


@pytest.mark.parametrize("split", [2, 4])
def test_a_kernel_block_split_is_refused_by_name(split):
    layout = preset_layout("tiny-hybrid")
    caches, _ = _caches(split)
    attn = layout.groups[layout.attention_groups[0]]
    with pytest.raises(LayoutError, match=rf"splits layer {attn.layer_names[0]}'s {attn.block_tokens}-token blocks "
                                          rf"into {split} kernel blocks of {attn.block_tokens // split} tokens.*"
                                          r"--attention-backend FLASH_ATTN"):
        engine_pages(layout, caches)


def test_a_missing_layer_is_refused():
    layout = preset_layout("tiny-hybrid")
    caches, _ = _caches()
    caches.pop(layout.groups[0].layer_names[0])
    with pytest.raises(LayoutError, match="registered no cache tensor"):
        engine_pages(layout, caches)
