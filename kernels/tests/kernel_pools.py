"""Engine KV-cache pools laid out the ways engines lay them, with an oracle for where each page is.

Every pool keeps all its bytes in one uint8 `raw` tensor filled with random bytes, so a test can
say which raw bytes page (layer, block) is without asking the code under test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from hybridkv_kernels import PagedLayers

SENTINEL = 0xA5


@dataclass
class Pool:
    """A group's engine tensors, the raw bytes under them, and the byte offset of each page in raw."""

    name: str
    tensors: list[torch.Tensor]
    block_dim: int
    page_bytes: int
    num_blocks: int
    raw: torch.Tensor
    offset: Callable[[int, int], int]

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

    def layers(self) -> PagedLayers:
        """The pool's tensors as page views, through the public API."""
        return PagedLayers.from_tensors(self.tensors, self.page_bytes, self.block_dim)

    def page(self, layer: int, block: int) -> np.ndarray:
        """The page's bytes read straight from raw at the oracle's offset."""
        o = self.offset(layer, block)
        return self.raw.reshape(-1)[o : o + self.page_bytes].cpu().numpy()

    def expected_object(self, block_ids) -> np.ndarray:
        """Layer-major concatenation of the pages at block_ids: what a gather must produce."""
        pages = [self.page(layer, b) for layer in range(self.num_layers) for b in block_ids]
        return np.concatenate(pages) if pages else np.zeros(0, np.uint8)


def random_bytes(shape, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random uint8 bytes that are almost never the sentinel everywhere, and never all zero."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)


def dense_bf16(gen, layers=3, blocks=11, device="cpu") -> Pool:
    """One contiguous bf16 tensor per layer; a 222-byte page, so no access wider than 2 bytes."""
    pb = 3 * 37 * 2
    raw = random_bytes((layers, blocks, pb), gen, device)
    tensors = [raw[layer].view(torch.bfloat16).view(blocks, 3, 37) for layer in range(layers)]
    return Pool("dense_bf16", tensors, 0, pb, blocks, raw, lambda layer, b: (layer * blocks + b) * pb)


def shared_fp32(gen, layers=3, blocks=11, device="cpu") -> Pool:
    """Layers interleaved in one raw buffer (as vLLM shares it): page stride > page_bytes."""
    pb, pad = 100, 12
    stride = layers * pb + pad
    raw = random_bytes((blocks, stride), gen, device)
    as_f32 = raw.view(torch.float32)
    tensors = [as_f32[:, layer * pb // 4 : (layer + 1) * pb // 4] for layer in range(layers)]
    return Pool("shared_fp32", tensors, 0, pb, blocks, raw, lambda layer, b: b * stride + layer * pb)


def flash_bf16(gen, layers=2, blocks=9, device="cpu") -> Pool:
    """FlashAttention's (2, num_blocks, block, heads, dim) over a block-major buffer: K then V is a page."""
    shape = (blocks, 2, 4, 2, 8)  # physical: block, K/V, tokens, heads, dim
    pb = 2 * 4 * 2 * 8 * 2
    raw = random_bytes((layers, blocks, pb), gen, device)
    tensors = [raw[layer].view(torch.bfloat16).view(shape).permute(1, 0, 2, 3, 4) for layer in range(layers)]
    return Pool("flash_bf16", tensors, 1, pb, blocks, raw, lambda layer, b: (layer * blocks + b) * pb)


def padded_fp8(gen, layers=2, blocks=10, device="cpu") -> Pool:
    """fp8 (e4m3) pages of 128 B in 144-byte slots: 16-byte aligned, strided."""
    pb, slot = 128, 144
    raw = random_bytes((layers, blocks, slot), gen, device)
    tensors = [raw[layer][:, :pb].view(torch.float8_e4m3fn).view(blocks, 16, 8) for layer in range(layers)]
    return Pool("padded_fp8", tensors, 0, pb, blocks, raw, lambda layer, b: (layer * blocks + b) * slot)


POOLS = {f.__name__: f for f in (dense_bf16, shared_fp32, flash_bf16, padded_fp8)}


def qwen_like_groups(gen, layers=4, groups=4, blocks=24, page_bytes=256, device="cpu") -> list[Pool]:
    """vLLM's hybrid allocation: layer slot l of every group shares one raw tensor; groups own blocks."""
    raw = random_bytes((layers, blocks, page_bytes), gen, device)
    tensors = [raw[layer] for layer in range(layers)]
    return [
        Pool(f"group{g}", tensors, 0, page_bytes, blocks, raw,
             lambda layer, b: (layer * blocks + b) * page_bytes)
        for g in range(groups)
    ]


def guarded(
    nbytes: int, guard: int = 64, device="cpu", pin: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sentinel-filled buffer with `guard` bytes either side, and the object slice inside it."""
    buf = torch.full((nbytes + 2 * guard,), SENTINEL, dtype=torch.uint8, device=device)
    if pin:
        buf = buf.pin_memory()
    return buf, buf[guard : guard + nbytes]


def assert_guards(buf: torch.Tensor, guard: int) -> None:
    """The bytes around an object still hold the sentinel."""
    host = buf.cpu()
    assert bool((host[:guard] == SENTINEL).all()), "bytes before the object were written"
    assert bool((host[host.numel() - guard :] == SENTINEL).all()), "bytes after the object were written"
