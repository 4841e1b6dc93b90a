"""The copy-engine implementation: one `copy_` per run of pages adjacent on both sides.

Consecutive block ids of a layer whose page stride equals the page size are one run, so a
well-allocated sequence moves in few large copies; scattered blocks cost one copy each, which
makes small pages launch-bound (4-7 GB/s for 64 KiB pages on an H200, kernels/README.md).
On a CPU the same code runs as plain memcpy.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv_kernels.pages import storage_bytes
from hybridkv_kernels.plan import PageCopyPlan


def copy_runs(plan: PageCopyPlan) -> tuple[np.ndarray, np.ndarray]:
    """Start page and length of each run of pages contiguous in source and destination alike."""
    p = plan.num_pages
    if p == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    obj_storage = np.array([t.obj.untyped_storage().data_ptr() for t in plan.transfers], dtype=np.int64)
    obj_storage = obj_storage[plan.page_transfer]
    pb = plan.page_bytes
    # A run may cross layers or objects, but never allocations: a copy must stay inside one storage.
    cont = (
        (np.diff(plan.src_addr) == pb)
        & (np.diff(plan.dst_addr) == pb)
        & (np.diff(plan.engine_storage) == 0)
        & (np.diff(obj_storage) == 0)
    )
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.diff(np.append(starts, p))
    return starts, lengths


def copy_pages_dma(plan: PageCopyPlan) -> None:
    """Run `plan` on the current stream as one async `copy_` per contiguous run of pages."""
    starts, lengths = copy_runs(plan)
    flats: dict[tuple[int, int], torch.Tensor] = {}  # (address, size) -> flat byte view of a storage
    gather = plan.direction == "gather"
    pb = plan.page_bytes
    for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        layers, _, obj = plan.transfers[int(plan.page_transfer[s])]
        engine = layers.views[int(plan.page_layer[s])]
        src, dst = (engine, obj) if gather else (obj, engine)
        src_flat, so = _flat(flats, src, int(plan.src_addr[s]))
        dst_flat, do = _flat(flats, dst, int(plan.dst_addr[s]))
        dst_flat[do : do + n * pb].copy_(src_flat[so : so + n * pb], non_blocking=True)


def _flat(flats: dict[tuple[int, int], torch.Tensor], t: torch.Tensor, addr: int) -> tuple[torch.Tensor, int]:
    """The flat byte view of `t`'s storage and the offset of `addr` in it."""
    storage = t.untyped_storage()
    # Keyed by size too: two frombuffer tensors over one mmap are distinct storages at one address.
    key = (storage.data_ptr(), storage.nbytes())
    flat = flats.get(key)
    if flat is None:
        flat = flats[key] = storage_bytes(t)
    return flat, addr - key[0]
