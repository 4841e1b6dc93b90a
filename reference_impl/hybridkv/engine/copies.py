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
from hybridkv_kernels.copy_dma import copy_pages_dma, dma_runs
from hybridkv_kernels.pace import Pace, Pacer, measure_link_gbps

from hybridkv.engine.handles import TransferHandle
from hybridkv.engine.wire import ObjectJob
from hybridkv.model.layout import ModelLayout, layer_index
from hybridkv.wire import protocol as P

Direction = Literal["gather", "scatter"]
FENCE_RING = 64  # device words for fences in flight on one stream (the 65th reuses the first, in stream order)
# What `issue` queued: per stream, the event recorded after its copies and the plan (it holds the tensors).
Issued = list[tuple["torch.cuda.Event | None", Any]]
# Per stream: the engine half of a plan, and the (chunk, group) objects it lists in order.
PlannedPages = dict[int, tuple[Any, list[tuple[int, int]]]]
# Plans bound to their objects (`PageCopies.bind`): per stream index, the plan, the groups of its transfers in
# order, and on DMA the driver's arguments for its runs (`dma_runs`), so that queueing them is all that is left.
Bound = list[tuple[int, Any, list[int], Any]]
# A layer-wise load's order: steps of (layer names, their (group, layer within group) pairs), queued one
# after another, each step's copies followed by an event its layers' readers wait for (`layer_steps`).
LayerSteps = list[tuple[tuple[str, ...], frozenset[tuple[int, int]]]]


def layer_steps(layout: ModelLayout) -> LayerSteps:
    """The order a forward pass reads a layout's layers in: every recurrent state first (small, and read by
    the first layers), then the other groups' layers by decoder-layer index, one step per index."""
    states = [(g, j) for g in layout.recurrent_groups for j in range(layout.groups[g].num_layers)]
    by_index: dict[int | str, list[tuple[int, int]]] = {}
    for g, grp in enumerate(layout.groups):
        if g not in layout.recurrent_groups:
            for j, name in enumerate(grp.layer_names):
                by_index.setdefault(layer_index(name), []).append((g, j))
    steps: LayerSteps = []
    if states:
        steps.append((tuple(layout.groups[g].layer_names[j] for g, j in states), frozenset(states)))
    for index in sorted(by_index, key=lambda i: (isinstance(i, str), str(i) if isinstance(i, str) else i)):
        pairs = by_index[index]
        steps.append((tuple(layout.groups[g].layer_names[j] for g, j in pairs), frozenset(pairs)))
    return steps


class PageCopies:
    """Plans and queues one engine's page copies; stores and loads each have their own streams."""

    def __init__(self, groups: Sequence[PagedLayers], impl: str, n_streams: int,
                 link_fractions: dict[str, float] | None = None, link_gbps: float = 0.0):
        self.groups = groups
        self.impl = impl
        self.device = device = groups[0].device
        self.streams: dict[str, list[torch.cuda.Stream | None]] = {
            k: [torch.cuda.Stream(device) for _ in range(n_streams)] if device.type == "cuda" else [None]
            for k in ("store", "load")}
        # per kind, its streams' pacers where `link_fractions` (TransferConfig.link_fraction) caps it below 1 (CUDA
        # only: CPU copies are synchronous); the link's rate measured once per direction unless `link_gbps` is given
        self.pacers: dict[str, list[Pacer]] = {}
        for kind, fraction in (link_fractions or {}).items():
            if fraction < 1 and device.type == "cuda":
                rate = link_gbps or measure_link_gbps(device, "gather" if kind == "store" else "scatter")
                self.pacers[kind] = [Pacer(s, Pace(fraction, rate)) for s in self.streams[kind] if s is not None]
        self._fence_src: torch.Tensor | None = None  # the device words fences are copied from (`fence`)
        self._fence_next = 0

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

    def bind(self, direction: Direction, items: list[tuple[P.ObjectLoc, np.ndarray, torch.Tensor]],
             pages: PlannedPages | None = None) -> Bound:
        """The plans of (object, blocks, host bytes) `items`, one per stream: with `pages` (from `plan_pages`)
        only the objects are bound to the engine halves; without, the plans are built whole."""
        streams = self.streams["store" if direction == "gather" else "load"]
        if pages is not None:
            hosts = {(o.chunk, o.group): host for o, _, host in items}
            plans = [(i, half.bind([hosts.get(k) for k in order]), [k[1] for k in order if k in hosts])
                     for i, (half, order) in pages.items() if any(k in hosts for k in order)]
        else:
            by_stream: dict[int, list] = {}
            for o, ids, host in items:
                by_stream.setdefault(o.group % len(streams), []).append((o.group, (self.groups[o.group], ids, host)))
            plans = [(i, build_plan(direction, [t for _, t in ts]), [g for g, _ in ts]) for i, ts in by_stream.items()]
        dma = self.impl == "dma" and self.device.type == "cuda"
        return [(i, plan, groups, dma_runs(plan) if dma else None) for i, plan, groups in plans]

    def issue(self, h: TransferHandle, direction: Direction, items: list[tuple[P.ObjectLoc, np.ndarray, torch.Tensor]],
              ready: torch.cuda.Event | None = None, pages: PlannedPages | None = None,
              steps: LayerSteps | None = None, bound: Bound | None = None) -> Issued:
        """Queue the page copies of (object, blocks, host bytes) `items`, grouped per stream, after `ready`;
        timed into `h`. With `pages` (from `plan_pages`) the plans' engine halves exist: only the objects
        are bound. With `bound` (from `bind`, made earlier) the plans are whole and `items` is not read. With
        `steps` (CUDA only) the copies go layer by layer in that order, and `h.layer_ready` holds each layer's
        event: a reader of a layer waits for its own pages alone. On a CPU the copies are done when this returns."""
        if not h.t_copy_start:
            h.t_copy_start = time.perf_counter()
        streams = self.streams[h.kind]
        plans = bound if bound is not None else self.bind(direction, items, pages)
        for i, _, _, _ in plans:
            s = streams[i]
            if s is not None and ready is not None:
                s.wait_event(ready)
        if steps is not None and self.device.type == "cuda":
            issued = self._issue_steps(h, [(streams[i], plan, groups) for i, plan, groups, _ in plans], steps)
        else:
            pacers = self.pacers.get(h.kind)
            issued = [(self._run(plan, streams[i], runs, pacers[i] if pacers else None), plan)
                      for i, plan, _, runs in plans]
        h.t_copy_issued = time.perf_counter()
        return issued

    def _run(self, plan: Any, s: torch.cuda.Stream | None, runs: Any = None,
             pacer: Pacer | None = None) -> torch.cuda.Event | None:
        """Queue `plan` on `s` (`runs`: its `dma_runs`, if made; `pacer`: `s`'s, where its kind is paced); the
        event recorded after it (None on a CPU: the copies are done)."""
        if pacer is not None:
            pacer.run(plan, self.impl, runs)
        elif self.impl == "dma":  # chosen and checked once, in KVTransfer: not again per plan
            copy_pages_dma(plan, stream=s, runs=runs)
        else:
            run_plan(plan, self.impl, s, runs)
        if s is None:
            return None
        ev = torch.cuda.Event()
        ev.record(s)
        return ev

    def _issue_steps(self, h: TransferHandle, plans: list[tuple[torch.cuda.Stream | None, Any, list[int]]],
                     steps: LayerSteps) -> Issued:
        """Each stream's plan cut into `steps`' parts, queued step after step; `h.layer_ready` names each
        layer's events (one per stream that copies some of it)."""
        step_of = np.full((len(self.groups), max(g.num_layers for g in self.groups)), -1, dtype=np.int64)
        for k, (_, pairs) in enumerate(steps):
            for g, j in pairs:
                step_of[g, j] = k
        parts = []
        for s, plan, groups in plans:
            step = step_of[np.asarray(groups, dtype=np.int64)[plan.page_transfer], plan.page_layer]
            if step.size and step.min() < 0:  # `layer_steps` names every layer; a page left out would never move
                raise ValueError("layer steps do not name every layer the load copies")
            order = np.argsort(step, kind="stable")
            parts.append((s, plan, order, np.searchsorted(step[order], np.arange(len(steps) + 1))))
        ready: dict[str, list[Any]] = {}
        issued: Issued = []
        pacers = dict(zip(self.streams[h.kind], self.pacers.get(h.kind, ()), strict=False))
        for k, (names, _) in enumerate(steps):
            for s, plan, order, bounds in parts:
                if bounds[k + 1] > bounds[k]:
                    part = plan.take(order[bounds[k]:bounds[k + 1]])
                    ev = self._run(part, s, pacer=pacers.get(s))
                    issued.append((ev, part))
                    for name in names:
                        ready.setdefault(name, []).append(ev)
        h.layer_ready = ready
        return issued

    def fence(self, issued: Issued, word: torch.Tensor, value: int) -> Issued:
        """Queue, after every copy of `issued` (a store's), the write of `value` into the 8-byte host `word`
        (the reservation's fence word in the arena): on CUDA, on the first store stream, a fill of a device
        word and its DMA copy out; the copy engine writes in stream order, so once the word shows `value`,
        every page before it has landed. Returns `issued` with that step added (its event, and the device word
        it holds). On a CPU the copies are done already: the word is written now."""
        s = self.streams["store"][0]
        if s is None:
            word.view(torch.int64)[0] = value
            return issued
        if len(self.streams["store"]) > 1:  # with one store stream every copy of `issued` is on `s` already
            for ev, _ in issued:
                if ev is not None:
                    s.wait_event(ev)
        if self._fence_src is None:
            self._fence_src = torch.zeros(FENCE_RING, dtype=torch.int64, device=self.device)
        src = self._fence_src[self._fence_next % FENCE_RING:][:1]  # reused in order: one stream writes them
        self._fence_next += 1
        with torch.cuda.stream(s):
            src.fill_(value)
            word.view(torch.int64).copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(s)
        return [*issued, (ev, src)]

    @staticmethod
    def wait(h: TransferHandle, issued: Issued) -> None:
        """Wait for the copies `issue` queued (their plans keep the tensors alive until then)."""
        for ev, _ in issued:
            if ev is not None:
                ev.synchronize()
        if not h.t_done:  # a fenced store's commit answer may have told first (the fence shows after the copies)
            h.t_done = time.perf_counter()
