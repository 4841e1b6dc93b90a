"""The kernel implementation: one Triton launch moves every page of a plan, across layers and groups.

The kernel gets one "anchor" pointer and two int64 tables of element offsets relative to it, so a
single launch reaches any layer tensor and any page-locked host mapping (through UVA) without a
pointer table per tensor. Program (p, c) copies elements [c*BLOCK, (c+1)*BLOCK) of page p.

Access width: the plan's alignment picks the element type. 16-byte alignment uses int64 elements
with offsets hinted as multiples of 2, which lets Triton emit 128-bit `ld/st.global.v2.b64` (checked
in the tests against the PTX for sm_90); narrower alignments use elements of exactly that width.
Loads are marked evict-first because every byte is read once.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from hybridkv_kernels.plan import PageCopyPlan

# alignment in bytes -> (element dtype, elements per aligned vector)
ELEMENT_TYPES = {
    16: (torch.int64, 2),
    8: (torch.int64, 1),
    4: (torch.int32, 1),
    2: (torch.int16, 1),
    1: (torch.uint8, 1),
}
# 16 KiB per program: 4 warps x 32 threads x 128 B, i.e. eight 16-byte accesses per thread in flight.
DEFAULT_BLOCK_BYTES = 16384
DEFAULT_NUM_WARPS = 4
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y


@triton.jit
def copy_pages_kernel(anchor, src_off, dst_off, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr,
                      VEC: tl.constexpr):
    """Copy BLOCK elements of page program_id(0) from anchor[src_off[p]:] to anchor[dst_off[p]:]."""
    page = tl.program_id(0)
    part = tl.program_id(1)
    src = tl.multiple_of(tl.load(src_off + page), VEC)
    dst = tl.multiple_of(tl.load(dst_off + page), VEC)
    cols = part.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < PAGE_ELEMS
    vals = tl.load(anchor + src + cols, mask=mask, eviction_policy="evict_first")
    tl.store(anchor + dst + cols, vals, mask=mask)


def _typed_anchor(plan: PageCopyPlan, dtype: torch.dtype) -> torch.Tensor:
    """A one-element `dtype` tensor at the plan anchor's address, in the anchor's own storage."""
    storage = plan.anchor.untyped_storage()
    item = torch.empty(0, dtype=dtype).element_size()
    offset = plan.anchor.data_ptr() - storage.data_ptr()
    assert offset % item == 0, f"anchor offset {offset} is not a multiple of {item} B"
    return torch.empty(0, dtype=dtype, device=plan.device).set_(storage, offset // item, (1,), (1,))


def launch_config(page_elems: int, item: int, block_bytes: int) -> tuple[int, int]:
    """BLOCK (elements per program, a power of two) and programs per page for a page size."""
    block = max(1, min(block_bytes // item, triton.next_power_of_2(page_elems)))
    assert block & (block - 1) == 0, f"block {block} must be a power of two"
    return block, triton.cdiv(page_elems, block)


def copy_pages_triton(plan: PageCopyPlan, block_bytes: int = DEFAULT_BLOCK_BYTES,
                      num_warps: int = DEFAULT_NUM_WARPS) -> None:
    """Run `plan` on the current stream as one Triton kernel launch."""
    if plan.num_pages == 0:
        return
    dtype, vec = ELEMENT_TYPES[plan.elem_bytes]
    anchor = _typed_anchor(plan, dtype)
    item = anchor.element_size()
    base = anchor.data_ptr()
    assert plan.page_bytes % (item * vec) == 0, f"page_bytes {plan.page_bytes} vs {item * vec} B accesses"
    page_elems = plan.page_bytes // item
    block, parts = launch_config(page_elems, item, block_bytes)
    assert block % vec == 0, f"block {block} is not a whole number of {vec}-element vectors"
    assert parts <= MAX_GRID_Y, f"{parts} programs per page exceed gridDim.y; raise block_bytes"
    # Offsets may be negative: the anchor is just one engine page, other tensors lie on either side.
    table = np.stack(((plan.src_addr - base) // item, (plan.dst_addr - base) // item))
    assert not (((plan.src_addr - base) % item).any() or ((plan.dst_addr - base) % item).any())
    tables = torch.from_numpy(table)
    if plan.device.type == "cuda":
        tables = tables.pin_memory().to(plan.device, non_blocking=True)
    assert tables.shape == (2, plan.num_pages) and tables.is_contiguous()
    copy_pages_kernel[(plan.num_pages, parts)](
        anchor, tables[0], tables[1], PAGE_ELEMS=page_elems, BLOCK=block, VEC=vec, num_warps=num_warps
    )
