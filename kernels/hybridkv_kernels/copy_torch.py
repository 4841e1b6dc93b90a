"""The reference implementation: per layer `index_select` / `index_copy_` on the page views.

It trusts nothing but torch's own indexing, so it is what the kernel and DMA paths are checked
against. It issues L ops per object (plus a staging tensor when the object is on the host), so it
is launch-bound for small pages on a GPU; on a CPU it is the fastest of the three.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv_kernels.plan import HOLE, PageCopyPlan


def _device_block_ids(plan: PageCopyPlan) -> list[torch.Tensor]:
    """Every transfer's block ids on the plan's device, moved with one host-to-device copy."""
    ids = [np.asarray(t.block_ids) for t in plan.transfers]  # build_plan normalized them to int64 arrays
    host = torch.from_numpy(np.concatenate(ids))
    if plan.device.type == "cuda":
        host = host.pin_memory().to(plan.device, non_blocking=True)
    return list(torch.split(host, [a.size for a in ids]))


def copy_pages_torch(plan: PageCopyPlan) -> None:
    """Run `plan` on the current stream with torch indexing ops, one per layer of each object (on a CPU, numpy's:
    `_copy_host`)."""
    if plan.part:
        _copy_part(plan)
        return
    if plan.device.type == "cpu" and all(obj.device.type == "cpu" for _, _, obj in plan.transfers):
        _copy_host(plan)
        return
    gather = plan.direction == "gather"
    for (layers, ids, obj), idx in zip(plan.transfers, _device_block_ids(plan), strict=True):
        n = len(ids)
        if n == 0:
            continue
        rows = obj.view(layers.num_layers, n, layers.page_bytes)
        holes = np.asarray(ids) == HOLE
        if holes.any():  # a scatter's holes (plan_pages allows them nowhere else): those pages go nowhere
            keep = torch.from_numpy(np.flatnonzero(~holes)).to(idx.device)
            idx, rows = idx[keep], rows[:, keep.to(rows.device)]
        for view, row in zip(layers.views, rows, strict=True):
            if gather and row.device == view.device:
                torch.index_select(view, 0, idx, out=row)
            elif gather:
                # Host object: stage on the device, then one async copy into page-locked memory.
                row.copy_(view.index_select(0, idx), non_blocking=True)
            else:
                view.index_copy_(0, idx, row.to(view.device, non_blocking=True))


def _copy_host(plan: PageCopyPlan) -> None:
    """A plan whose pages and objects are all in host memory: numpy's fancy indexing, a row copy per page on the
    calling thread. torch's CPU index ops copy byte by byte in its intra-op thread pool, whose barrier after every
    op stalls for as long as another process holds a core: many times a memcpy's time on a busy machine."""
    gather = plan.direction == "gather"
    for layers, ids, obj in plan.transfers:
        n = len(ids)
        if n == 0:
            continue
        idx = np.asarray(ids)
        rows = obj.view(layers.num_layers, n, layers.page_bytes).numpy()
        keep = idx != HOLE
        if not keep.all():  # a scatter's holes (plan_pages allows them nowhere else): those pages go nowhere
            idx, rows = idx[keep], rows[:, keep]
        for view, row in zip(layers.views, rows, strict=True):
            pages = view.numpy()
            if gather:
                np.take(pages, idx, axis=0, out=row, mode="clip")  # ids checked by the plan: "raise" would buffer
            else:
                pages[idx] = row


def _copy_part(plan: PageCopyPlan) -> None:
    """A part of a plan (`PageCopyPlan.take`: e.g. one layer of a layer-wise load): one op per (object,
    layer) it holds pages of, over those pages alone."""
    gather = plan.direction == "gather"
    pb = plan.page_bytes
    obj_ptr = np.array([t.obj.data_ptr() for t in plan.transfers], dtype=np.int64)[plan.page_transfer]
    k = ((plan.dst_addr if gather else plan.src_addr) - obj_ptr) // pb  # page index inside its object
    order = np.lexsort((plan.page_layer, plan.page_transfer))
    pairs = np.stack((plan.page_transfer[order], plan.page_layer[order]))
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(pairs, axis=1) != 0).any(axis=0))))
    for lo, hi in zip(starts.tolist(), [*starts[1:].tolist(), len(order)], strict=True):
        tr, layer = int(pairs[0, lo]), int(pairs[1, lo])
        layers, ids, obj = plan.transfers[tr]
        n = len(ids)
        j = k[order[lo:hi]] - layer * n
        view, row = layers.views[layer], obj.view(layers.num_layers, n, pb)[layer]
        idx = torch.from_numpy(np.asarray(ids)[j]).to(view.device)
        jj = torch.from_numpy(j).to(row.device)
        if gather:
            row.index_copy_(0, jj, view.index_select(0, idx).to(row.device))
        else:
            view.index_copy_(0, idx, row.index_select(0, jj).to(view.device))
