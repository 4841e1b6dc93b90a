"""Copies paced to a share of the host link: a plan queued in slices with idle gaps between them, on its stream.

Loads write into HBM while the model reads it, and cost memory-bound compute more than their bytes' share of its
bandwidth (kernels/README.md, "Compute beside the copies"). A deployment that caps what offload may cost caps its
rate: the copy engines still run each slice at full speed, then wait on the GPU, so that the slices and gaps
together move `fraction` of the link's rate on average (a duty cycle). The gap is a spin kernel of one thread on
the copy stream (`torch.cuda._sleep`): no host thread waits, and the stream's later work stays in order after it.
On a CPU copies are synchronous and nothing competes for a copy engine: pacing does not apply there.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv_kernels.copy_dma import DmaRuns, copy_pages_dma, dma_runs
from hybridkv_kernels.plan import PageCopyPlan

# Bytes moved between two gaps. Small enough that the gaps spread over a load (a 0.8 pace leaves a gap of a
# quarter of a slice), large enough that the gaps' own launches stay few: at ~50 GB/s a slice is ~160 us.
SLICE_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Pace:
    """Move copies at `fraction` of `link_gbps` (the copies' own rate alone in that direction), in slices of
    about `slice_bytes`."""

    fraction: float
    link_gbps: float
    slice_bytes: int = SLICE_BYTES

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"a pace's fraction must lie in (0, 1], got {self.fraction!r}")
        if not self.link_gbps > 0 or not math.isfinite(self.link_gbps):
            raise ValueError(f"a pace's link_gbps must be a positive rate, got {self.link_gbps!r}")
        if self.slice_bytes <= 0:
            raise ValueError(f"a pace's slice_bytes must be positive, got {self.slice_bytes!r}")

    def gap_s(self, nbytes: int) -> float:
        """The idle time after a slice of `nbytes`: its time at the link's rate, times (1 - f) / f."""
        return nbytes / (self.link_gbps * 1e9) * (1 - self.fraction) / self.fraction


def slices(sizes: np.ndarray, slice_bytes: int) -> list[tuple[int, int]]:
    """[start, end) index ranges over copies of `sizes` bytes, each range at least `slice_bytes` (the last one
    may be less), never splitting a copy."""
    if len(sizes) == 0:
        return []
    ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
    out: list[tuple[int, int]] = []
    lo, base = 0, 0
    while lo < len(ends):
        hi = int(np.searchsorted(ends, base + slice_bytes, side="left")) + 1
        hi = min(max(hi, lo + 1), len(ends))
        out.append((lo, hi))
        base = int(ends[hi - 1])
        lo = hi
    return out


@functools.cache
def _cycles_per_s(device_index: int) -> float:
    """The GPU clock that `torch.cuda._sleep` counts, measured once per device (a spin of a known cycle count
    timed with events; the clock moves with boost, so the gaps are approximate as the pace is)."""
    with torch.cuda.device(device_index):
        s = torch.cuda.Stream()
        cycles = 20_000_000
        with torch.cuda.stream(s):
            torch.cuda._sleep(1000)  # the first launch loads the kernel
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            torch.cuda._sleep(cycles)
            b.record(s)
        b.synchronize()
        return cycles / (a.elapsed_time(b) / 1e3)


class Pacer:
    """Paces the copies queued on one CUDA stream (`run`). The gap owed after a transfer's last slice is not
    queued behind it (the transfer's end would wait for it): the stream's next transfer starts with what is left
    of it, less the host time that passed since (copies queued long after owe nothing)."""

    def __init__(self, stream: torch.cuda.Stream, pace: Pace):
        self.stream, self.pace = stream, pace
        self._owed_s = 0.0
        self._owed_at = 0.0

    def run(self, plan: PageCopyPlan, impl: str, runs: DmaRuns | None = None) -> None:
        """Queue `plan` with copy implementation `impl` (dma, triton or torch) in slices of about
        `pace.slice_bytes`, each after the gap that holds the average at the pace (`schedule`); never
        synchronizes. `runs`: the plan's `dma_runs`, made ahead (DMA only)."""
        from hybridkv_kernels.dispatch import run_plan

        if plan.device.type != "cuda":
            raise ValueError(f"pacing needs a CUDA plan, got one on {plan.device}")
        per_s = _cycles_per_s(plan.device.index if plan.device.index is not None else torch.cuda.current_device())
        lead = self._owed_s - (time.perf_counter() - self._owed_at)
        if impl == "dma":
            dst, src, sizes = runs if runs is not None else dma_runs(plan)
        else:
            sizes = np.full(plan.num_pages, plan.page_bytes, dtype=np.int64)
        steps, self._owed_s = schedule(sizes, self.pace, lead)
        for gap_s, lo, hi in steps:
            _gap(self.stream, gap_s * per_s)
            if impl == "dma":
                copy_pages_dma(plan, stream=self.stream, runs=(dst[lo:hi], src[lo:hi], sizes[lo:hi]))
            else:
                run_plan(plan.take(np.arange(lo, hi)), impl, self.stream)
        self._owed_at = time.perf_counter()


def schedule(sizes: np.ndarray, pace: Pace, lead_s: float = 0.0) -> tuple[list[tuple[float, int, int]], float]:
    """The duty cycle of copies of `sizes` bytes: (gap before it in seconds, start, end) of each slice of copies
    (`slices`), and the gap owed after the last one. The first slice waits `lead_s` (what an earlier transfer
    still owed, if positive); each later one the gap its predecessor's bytes owe at the pace."""
    out: list[tuple[float, int, int]] = []
    lead = max(lead_s, 0.0)
    for lo, hi in slices(sizes, pace.slice_bytes):
        out.append((lead, lo, hi))
        lead = pace.gap_s(int(np.asarray(sizes[lo:hi], dtype=np.int64).sum()))
    return out, lead


def _gap(stream: torch.cuda.Stream, cycles: float) -> None:
    if cycles >= 1:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(cycles))


@functools.cache
def measure_link_gbps(device: torch.device, direction: str, nbytes: int = 64 << 20) -> float:
    """GB/s of one pinned copy of `nbytes` between `device` and the host (`gather`: device to host), the best of
    three after a warm-up: the rate a pace is a share of, measured once per device and direction."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src, dst = (dev, host) if direction == "gather" else (host, dev)
    s = torch.cuda.Stream(device)
    best = 0.0
    with torch.cuda.stream(s):
        for i in range(4):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            dst.copy_(src, non_blocking=True)
            b.record(s)
            b.synchronize()
            if i:
                best = max(best, nbytes / (a.elapsed_time(b) / 1e3) / 1e9)
    return best
