"""The offload beside the compute: pages stored or loaded in a loop on a copy stream by one copy engine,
its rate alone, and a check of every byte it moved (`compute_beside`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch
from hybridkv_kernels import PagedLayers, build_plan, run_plan
from hybridkv_kernels.pace import Pace, Pacer
from hybridkv_kernels.plan import PageCopyPlan

from hybridkv_bench.microbench.compute_load import Timer

Direction = Literal["store", "load"]
LAYERS = 16  # one group's layers, as a Qwen3.6-27B group has

@dataclass(slots=True)
class CopySetup:
    """Engine layer pools, a page-locked host object and the plan between them, for one page size."""

    plan: PageCopyPlan
    layers: PagedLayers
    ids: list[int]
    obj: torch.Tensor
    nbytes: int


def make_copy(direction: Direction, page_bytes: int, plan_bytes: int, device: torch.device, seed: int) -> CopySetup:
    """16 layer pools of twice the plan's blocks, random scattered block ids, a pinned host object."""
    per_layer = max(1, plan_bytes // (LAYERS * page_bytes))
    num_blocks = 2 * per_layer
    gen = torch.Generator(device=device).manual_seed(seed)  # random bytes drawn where they live: fast on a GPU
    tensors = [torch.randint(0, 256, (num_blocks, page_bytes), dtype=torch.uint8, device=device, generator=gen)
               for _ in range(LAYERS)]
    layers = PagedLayers.from_tensors(tensors, page_bytes)
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:per_layer].tolist()
    nbytes = LAYERS * per_layer * page_bytes
    obj = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    obj.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen))
    plan = build_plan("gather" if direction == "store" else "scatter", [(layers, ids, obj)])
    return CopySetup(plan, layers, ids, obj, nbytes)


class CopyLoop:
    """Runs a plan back to back on its own stream in a thread, at most three plans in flight, until stopped; the
    rate counts from after one warm-up plan to the last plan's end (the compute beside it starts with the
    timed plans and ends at most three plans before them). With `rate_gbps` the loop is paced: plan k is queued no
    earlier than k plans' bytes at that rate after the start, so the copy engines run at full speed in bursts
    with idle gaps between them (a duty cycle, as an offload capped to a fraction of the link would run)."""

    def __init__(self, setup: CopySetup, impl: str, device: torch.device, rate_gbps: float = 0.0,
                 pace: Pace | None = None):
        if rate_gbps < 0:
            raise ValueError(f"rate_gbps must be >= 0 (0: unpaced), got {rate_gbps}")
        self.setup, self.impl, self.device = setup, impl, device
        self.rate_gbps = rate_gbps
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # `pace`: the library's pacing instead (slices and gaps queued on the GPU, hybridkv_kernels.pace)
        self.pacer = Pacer(self.stream, pace) if pace is not None and self.stream is not None else None
        self.first_done = threading.Event()
        self._stop = threading.Event()
        self.bytes = 0
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="copy-loop", daemon=True)

    def __enter__(self) -> CopyLoop:
        self._thread.start()
        if not self.first_done.wait(60):
            raise RuntimeError(f"the {self.impl} copy loop finished no plan in 60 s")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def _run(self) -> None:
        try:
            run_plan(self.setup.plan, self.impl, self.stream)  # warm-up: a kernel's compile stays out of the rate
            if self.stream is not None:
                self.stream.synchronize()
            timer = Timer(self.device, self.stream)
            timer.start()
            self.first_done.set()
            pending: list[torch.cuda.Event] = []
            done = 0
            t0 = time.perf_counter()
            while not self._stop.is_set():
                if self.rate_gbps:
                    due = t0 + done * self.setup.nbytes / (self.rate_gbps * 1e9)
                    if (gap := due - time.perf_counter()) > 0 and self._stop.wait(gap):
                        break
                if self.pacer is not None:
                    self.pacer.run(self.setup.plan, self.impl)
                else:
                    run_plan(self.setup.plan, self.impl, self.stream)
                done += 1
                if self.stream is not None:
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    pending.append(ev)
                    if len(pending) > 2:  # two plans queued ahead keep the copy engines busy, stop stays quick
                        pending.pop(0).synchronize()
            self.seconds = timer.stop()
            self.bytes = done * self.setup.nbytes
        except BaseException as e:  # surfaced by __exit__ (and first_done, so __enter__ does not hang)
            self.error = e
            self.first_done.set()


def transfer_alone(setup: CopySetup, impl: str, device: torch.device, seconds: float) -> float:
    """GB/s of the copy loop with nothing else on the GPU."""
    with CopyLoop(setup, impl, device) as loop:
        time.sleep(seconds)
    return loop.gbps


def verify(setup: CopySetup, impl: str, direction: Direction) -> bool:
    """One more copy into poisoned destination bytes; every byte compared with its source."""
    layers, ids = setup.layers, setup.ids
    pb = setup.plan.page_bytes
    idx = torch.tensor(ids, device=layers.views[0].device)
    if direction == "store":
        setup.obj.fill_(0xA5)
        run_plan(setup.plan, impl)
        if layers.views[0].device.type == "cuda":
            torch.cuda.synchronize()
        want = torch.stack([v.index_select(0, idx) for v in layers.views]).reshape(-1)
        return bool(torch.equal(setup.obj.to(want.device), want))
    want_host = setup.obj.view(LAYERS, len(ids), pb)
    for v in layers.views:
        v.index_fill_(0, idx, 0x5A)
    run_plan(setup.plan, impl)
    if layers.views[0].device.type == "cuda":
        torch.cuda.synchronize()
    got = torch.stack([v.index_select(0, idx) for v in layers.views])
    return bool(torch.equal(got.cpu(), want_host))


# -- the matrix ------------------------------------------------------------------------------------------------
