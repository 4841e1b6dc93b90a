"""The page copies of one engine rank's transfers: plans over its paged groups, queued on its streams.

A transfer's copies are planned per stream (one stream for every group, or one per group), queued after an
optional event (the engine's work that produced the pages), and waited for through one event per stream.
`issue` only queues on CUDA, so a caller may queue on its own thread and leave the wait to a worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from hybridkv_kernels import PagedLayers, build_plan, plan_pages, run_plan

from hybridkv import protocol as P
from hybridkv.engine.handles import TransferHandle
from hybridkv.engine.wire import ObjectJob

Direction = Literal["gather", "scatter"]
# What `issue` queued: per stream, the event recorded after its copies and the plan (it holds the tensors).
Issued = list[tuple["torch.cuda.Event | None", Any]]
# Per stream: the engine half of a plan, and the (chunk, group) objects it lists in order.
PlannedPages = dict[int, tuple[Any, list[tuple[int, int]]]]


class PageCopies:
    """Plans and queues one engine's page copies; stores and loads each have their own streams."""

    def __init__(self, groups: Sequence[PagedLayers], impl: str, n_streams: int):
        self.groups = groups
        self.impl = impl
        self.device = device = groups[0].device
        self.streams: dict[str, list[torch.cuda.Stream | None]] = {
            k: [torch.cuda.Stream(device) for _ in range(n_streams)] if device.type == "cuda" else [None]
            for k in ("store", "load")}

    def plan_pages(self, direction: Direction, jobs: list[ObjectJob]) -> PlannedPages:
        """Per stream: the engine half of the copy plan over `jobs`' blocks, and the (chunk, group) it lists."""
        n = len(self.streams["store" if direction == "gather" else "load"])
        by_stream: dict[int, list[ObjectJob]] = {}
        for o, ids in jobs:
            by_stream.setdefault(o.group % n, []).append((o, ids))
        return {i: (plan_pages(direction, [(self.groups[o.group], ids) for o, ids in js]),
                    [(o.chunk, o.group) for o, _ in js]) for i, js in by_stream.items()}

    def copier(self, h: TransferHandle, direction: Direction, ready: torch.cuda.Event | None = None,
               pages: PlannedPages | None = None) -> Callable[[list], None]:
        """The page-copy step a wire strategy runs: `issue`, then `wait`."""
        return lambda items: self.wait(h, self.issue(h, direction, items, ready, pages))

    def issue(self, h: TransferHandle, direction: Direction, items: list[tuple[P.ObjectLoc, np.ndarray, torch.Tensor]],
              ready: torch.cuda.Event | None = None, pages: PlannedPages | None = None) -> Issued:
        """Queue the page copies of (object, blocks, host bytes) `items`, grouped per stream, after `ready`;
        timed into `h`. With `pages` (from `plan_pages`) the plans' engine halves exist: only the objects
        are bound. On a CPU the copies are done when this returns."""
        if not h.t_copy_start:
            h.t_copy_start = time.perf_counter()
        streams = self.streams[h.kind]
        if pages is not None:
            hosts = {(o.chunk, o.group): host for o, _, host in items}
            plans = [(i, half.bind([hosts.get(k) for k in order])) for i, (half, order) in pages.items()
                     if any(k in hosts for k in order)]
        else:
            by_stream: dict[int, list] = {}
            for o, ids, host in items:
                by_stream.setdefault(o.group % len(streams), []).append((self.groups[o.group], ids, host))
            plans = [(i, build_plan(direction, transfers)) for i, transfers in by_stream.items()]
        issued: Issued = []
        for i, plan in plans:
            s = streams[i]
            if s is not None and ready is not None:
                s.wait_event(ready)
            run_plan(plan, self.impl, s)
            ev = None
            if s is not None:
                ev = torch.cuda.Event()
                ev.record(s)
            issued.append((ev, plan))
        h.t_copy_issued = time.perf_counter()
        return issued

    @staticmethod
    def wait(h: TransferHandle, issued: Issued) -> None:
        """Wait for the copies `issue` queued (their plans keep the tensors alive until then)."""
        for ev, _ in issued:
            if ev is not None:
                ev.synchronize()
        h.t_done = time.perf_counter()
