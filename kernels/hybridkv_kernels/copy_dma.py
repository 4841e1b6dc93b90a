"""The copy-engine implementation: every run of pages adjacent on both sides is one memcpy.

Consecutive block ids of a layer whose page stride equals the page size are one run, so a
well-allocated sequence moves in few large copies. On CUDA a plan's runs go to the copy engines in batched
driver calls (`cuda_batch`, CUDA 12.8+) on two streams, which keeps two copy engines busy back to back, in slices
of `SLICE_RUNS` so the first copies start while the rest is queued; without it
(an older driver, or `cuda_batch.set_enabled(False)`) each run is its own `copy_`, and the gaps between copies make
small pages launch-bound (kernels/README.md has the figures).
On a CPU the same code runs as plain memcpy.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from hybridkv_kernels import cuda_batch
from hybridkv_kernels.pages import storage_bytes
from hybridkv_kernels.plan import PageCopyPlan


def copy_runs(plan: PageCopyPlan) -> tuple[np.ndarray, np.ndarray]:
    """Start page and length of each run of pages contiguous in source and destination alike."""
    p = plan.num_pages
    if p == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    obj_storage = plan.object_storage
    if obj_storage is None:
        obj_storage = np.array([t.obj.untyped_storage().data_ptr() for t in plan.transfers], dtype=np.int64)
    pb = plan.page_bytes
    # A run may cross layers or objects, but never allocations: a copy must stay inside one storage.
    cont = np.diff(plan.src_addr) == pb
    cont &= np.diff(plan.dst_addr) == pb
    if not cont.any():  # no two pages adjacent (one block per layer and object): every page is its own run
        return np.arange(p, dtype=np.int64), np.ones(p, dtype=np.int64)
    cont &= np.diff(plan.engine_storage) == 0
    cont &= np.diff(obj_storage[plan.page_transfer]) == 0
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.diff(np.append(starts, p))
    return starts, lengths


DmaRuns = tuple[np.ndarray, np.ndarray, np.ndarray]  # uint64 destinations, sources, byte sizes: one per run


def dma_runs(plan: PageCopyPlan) -> DmaRuns:
    """The driver's arguments for `plan`'s runs (`copy_runs`), made ahead of the copies: a caller that binds a
    plan before its copies are due (a prepared store) passes them to `copy_pages_dma`, off the critical path."""
    starts, lengths = copy_runs(plan)
    if starts.size == plan.num_pages:  # one run per page: the plan's own addresses, reread as the driver's type
        return (plan.dst_addr.view(np.uint64), plan.src_addr.view(np.uint64),
                np.full(starts.size, plan.page_bytes, dtype=np.uint64))
    return (plan.dst_addr[starts].view(np.uint64), plan.src_addr[starts].view(np.uint64),
            (lengths * plan.page_bytes).view(np.uint64))


_local = threading.local()
# Runs per batched driver call. A call's copies can start only once it returns, and the driver's time in it grows
# with its copies: one call per stream for a long store leaves the copy engines idle for milliseconds
# (kernels/README.md, "Batched DMA"). Slices of this many runs, the two streams' taking turns, start the copy
# engines after the first slice while the rest is queued.
SLICE_RUNS = 512


# Plans of fewer runs than this go on the caller's stream alone, in one driver call, without the side stream's fork
# and join (two event records, two waits): a short plan queues faster that way and its copies end no later, while
# long plans finish alike either way (stores measured with issue_parts: results/h100/2026-12-07/README.md).
SPLIT_MIN_RUNS = 256
# A plan's first this many runs go in a driver call of their own, and the calls after it grow from there (`slices`;
# 0: calls of the cap from the start; a plan of fewer than twice as many runs: one call). The copy engines start only
# once a call returns (kernels/README.md, "Batched DMA") and the driver's time in a call grows with its copies (a
# 2-chunk TP8 plan's one call is most of its queueing: results/h100/2026-12-07/profile/issue_parts.txt; a long
# plan's first calls held SLICE_RUNS runs each): a first call of a few runs starts them sooner, and each later call
# is queued while the one before copies. Off (0) until a GPU run shows it pays and its CUDA tests pass there:
# `fixed_cost --first-slice-runs 16` compares (results/h100/2026-12-08/PLAN.md).
FIRST_SLICE_RUNS = 0
SLICE_GROWTH = 4  # each call after the first this many times the one before (up to the cap): queued while it copies


def slices(n: int, cap: int) -> list[tuple[int, int]]:
    """The (start, end) runs of each driver call for `n` runs: `FIRST_SLICE_RUNS` first, each next call
    `SLICE_GROWTH` times the one before, none over `cap`; calls of `cap` runs from the start where the first slice
    is off or the plan is short (fewer than twice its runs)."""
    size = FIRST_SLICE_RUNS if 0 < 2 * FIRST_SLICE_RUNS <= n else cap
    out: list[tuple[int, int]] = []
    lo = 0
    while lo < n:
        out.append((lo, min(n, lo + size)))
        lo += size
        size = min(cap, size * SLICE_GROWTH)
    return out


class _Side:
    """This thread's side stream for one main stream, with the two events that fork and join it: recorded again
    for every plan (a wait queued earlier keeps the record it saw), so no event is made or destroyed per plan."""

    __slots__ = ("stream", "fork", "join")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = torch.cuda.Stream(stream.device)
        self.fork = torch.cuda.Event()
        self.join = torch.cuda.Event()


def _side_stream(stream: torch.cuda.Stream) -> _Side:
    """This thread's side stream for main stream `stream`: stores and loads (their own main streams) never
    share one, whichever thread queues them, so a store and a load keep overlapping (both directions of
    the link at once)."""
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    side = streams.get(stream.cuda_stream)
    if side is None:
        side = streams[stream.cuda_stream] = _Side(stream)
    return side


def copy_pages_dma(plan: PageCopyPlan, batched: bool | None = None, stream: torch.cuda.Stream | None = None,
                   runs: DmaRuns | None = None) -> None:
    """Run `plan` in order with `stream` (None: the current stream): on CUDA, when the driver batches memcpys
    (`batched=None`: whenever available), its runs of pages in batched driver calls of up to `SLICE_RUNS`, half on
    the stream and half on a side stream joined back to it, the two taking turns (two copy engines at work,
    closer to the ceiling than one batch: kernels/README.md, "Batched DMA"); else one async `copy_` per run.
    `runs`: `dma_runs(plan)`, made earlier (else made here)."""
    if stream is not None and plan.device.type != "cuda":
        raise ValueError(f"a CUDA stream was given for a plan on {plan.device}")
    batch = cuda_batch.get() if plan.device.type == "cuda" and batched is not False else None
    if batch is not None and stream is None:
        stream = torch.cuda.current_stream(plan.device)
    # The driver refuses batches on the legacy default stream (handle 0): copies queued there go one by one.
    if batch is not None and stream is not None and stream.cuda_stream != 0:
        device = plan.device.index if plan.device.index is not None else torch.cuda.current_device()
        dst, src, sizes = runs if runs is not None else dma_runs(plan)  # uint64, contiguous: sliced as they are
        if len(dst) < max(2, SPLIT_MIN_RUNS):
            for lo, hi in slices(len(dst), 2 * SLICE_RUNS):
                batch(dst[lo:hi], src[lo:hi], sizes[lo:hi], stream.cuda_stream, device)
            return
        side = _side_stream(stream)
        side.fork.record(stream)
        side.stream.wait_event(side.fork)  # the side half starts after what the caller queued, as the main half does
        halves = ((dst[1::2].copy(), src[1::2].copy(), sizes[1::2].copy(), side.stream.cuda_stream),
                  (dst[0::2].copy(), src[0::2].copy(), sizes[0::2].copy(), stream.cuda_stream))
        for lo, hi in slices(len(halves[1][0]), SLICE_RUNS):  # the main half is the longer one
            for d, s, n, handle in halves:
                if lo < len(d):
                    batch(d[lo:hi], s[lo:hi], n[lo:hi], handle, device)
        side.join.record(side.stream)
        stream.wait_event(side.join)  # the plan is done on the caller's stream when both halves are
        return
    starts, lengths = copy_runs(plan)
    if batched:
        raise RuntimeError("batched memcpy was asked for but cannot run here (not a CUDA plan, no driver entry "
                           "point, cuda_batch.set_enabled(False), or the legacy default stream)")
    if stream is not None:
        with torch.cuda.stream(stream):
            _copy_runs_one_by_one(plan, starts, lengths)
    else:
        _copy_runs_one_by_one(plan, starts, lengths)


def _copy_runs_one_by_one(plan: PageCopyPlan, starts: np.ndarray, lengths: np.ndarray) -> None:
    """One async `copy_` per run, on the current stream (on a CPU: memcpy)."""
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
