"""Copy ceilings of this machine, measured in the same run as the payload rates they bound.

- `d2h_peak_gbps` / `h2d_peak_gbps`: one GPU, pinned host memory, 1 GiB copies timed with CUDA events.
- `bidir_peak_gbps`: D2H and H2D at once on two streams (bytes of both directions over the wall time):
  the ceiling of an engine storing one request while loading another.
- `host_memcpy_gbps`: a 256 MiB host-to-host copy (torch's copy_): host memory bandwidth. On a CPU-only
  machine it stands for every direction.
- `aggregate_*_gbps`: every visible GPU copying into (out of) its own pinned buffer at once, for
  several engines on several GPUs; `per_gpu_*_gbps` are each GPU's share of that same run.
Rates are medians over `iterations` after one warm-up, GB/s = 1e9 B/s. torch is imported inside.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Literal

import msgspec

GIB = 1 << 30


class ProbeError(RuntimeError):
    """A probe that could not measure what it was asked to (named in the message)."""


class Calibration(msgspec.Struct, kw_only=True):
    """Copy ceilings of this machine (see the module doc); None where it has no such path."""

    method: Literal["cuda-pinned-events", "cpu-memcpy"]
    device: str
    bytes: int
    iterations: int
    d2h_peak_gbps: float
    h2d_peak_gbps: float
    d2h_samples_gbps: list[float]
    h2d_samples_gbps: list[float]
    bidir_peak_gbps: float | None = None
    host_memcpy_gbps: float | None = None
    gpus: int = 0
    aggregate_d2h_gbps: float | None = None
    aggregate_h2d_gbps: float | None = None
    per_gpu_d2h_gbps: list[float] = []
    per_gpu_h2d_gbps: list[float] = []
    seconds: float = 0.0  # wall time the calibration itself took


def resolve_device(device: str) -> Literal["cpu", "cuda"]:
    """`auto` is cuda when torch sees a GPU, else cpu; asking for cuda without one is an error."""
    if device not in ("auto", "cpu", "cuda"):
        raise ProbeError(f"unknown device {device!r}; choose auto, cpu or cuda")
    if device == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise ProbeError("device 'cuda' asked for, but torch sees no CUDA device")
    return "cpu"


def _median_of(fn: Callable[[], float], iterations: int) -> tuple[float, list[float]]:
    fn()  # warm-up: first touch, lazy module and context setup
    samples = [fn() for _ in range(iterations)]
    return statistics.median(samples), samples


def host_memcpy_gbps(nbytes: int = 256 << 20, iterations: int = 5) -> tuple[float, list[float]]:
    """Host memory bandwidth as torch's copy_ sees it: median GB/s and the samples."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def once() -> float:
        start = time.perf_counter()
        dst.copy_(src)
        return nbytes / (time.perf_counter() - start) / 1e9

    return _median_of(once, iterations)


def host_bidir_gbps(nbytes: int = 256 << 20, iterations: int = 5) -> float:
    """Two host copies at once (what store-while-load is on a CPU engine): bytes of both over the wall time."""
    import torch

    bufs = [(torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)) for _ in range(2)]

    def once() -> float:
        threads = [threading.Thread(target=d.copy_, args=(s,)) for s, d in bufs]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return 2 * nbytes / (time.perf_counter() - start) / 1e9

    return _median_of(once, iterations)[0]


def _cuda_one_gpu(nbytes: int, iterations: int) -> dict:
    """D2H, H2D and both at once on the current GPU, pinned host memory, timed with CUDA events."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(dst, src) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return nbytes / (start.elapsed_time(end) / 1e3) / 1e9

    def both() -> float:
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record(s1)
        s2.wait_event(start)
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)  # H2D
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)  # D2H
        mid.record(s2)
        s1.wait_event(mid)
        end.record(s1)
        end.synchronize()
        return 2 * nbytes / (start.elapsed_time(end) / 1e3) / 1e9

    h2d, h2d_s = _median_of(lambda: timed(dev, host), iterations)
    d2h, d2h_s = _median_of(lambda: timed(host, dev), iterations)
    bidir, _ = _median_of(both, iterations)
    return {"h2d": h2d, "h2d_s": h2d_s, "d2h": d2h, "d2h_s": d2h_s, "bidir": bidir}


def _cuda_all_gpus(nbytes: int, iterations: int, direction: Literal["d2h", "h2d"]) -> tuple[float, list[float]]:
    """Every GPU copying `nbytes` at once in one direction: aggregate GB/s (median) and each GPU's own."""
    import torch

    n = torch.cuda.device_count()
    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]

    def once() -> tuple[float, list[float]]:
        for i in range(n):
            torch.cuda.synchronize(i)
        marks = []
        start = time.perf_counter()
        for i in range(n):
            with torch.cuda.device(i):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst, src = (hosts[i], devs[i]) if direction == "d2h" else (devs[i], hosts[i])
                dst.copy_(src, non_blocking=True)
                b.record()
                marks.append((a, b))
        for _, b in marks:
            b.synchronize()
        wall = time.perf_counter() - start
        return n * nbytes / wall / 1e9, [nbytes / (a.elapsed_time(b) / 1e3) / 1e9 for a, b in marks]

    once()
    runs = [once() for _ in range(iterations)]
    agg = statistics.median(r[0] for r in runs)
    per_gpu = [statistics.median(r[1][i] for r in runs) for i in range(n)]
    return agg, per_gpu


def calibrate(device: str = "auto", nbytes: int | None = None, iterations: int = 5,
              all_gpus: bool | None = None) -> Calibration:
    """Measure the ceilings of the module doc. `all_gpus` (default: when more than one GPU is visible)
    adds the aggregate of every GPU copying at once."""
    t0 = time.perf_counter()
    resolved = resolve_device(device)
    if iterations < 1:
        raise ProbeError(f"iterations must be >= 1, got {iterations}")
    if resolved == "cpu":
        nbytes = nbytes or (256 << 20)
        rate, samples = host_memcpy_gbps(nbytes, iterations)
        return Calibration(method="cpu-memcpy", device=_cpu_name(), bytes=nbytes, iterations=iterations,
                           d2h_peak_gbps=rate, h2d_peak_gbps=rate, d2h_samples_gbps=samples,
                           h2d_samples_gbps=samples, bidir_peak_gbps=host_bidir_gbps(min(nbytes, 64 << 20), 3),
                           host_memcpy_gbps=rate, seconds=time.perf_counter() - t0)
    import torch

    nbytes = nbytes or GIB
    one = _cuda_one_gpu(nbytes, iterations)
    memcpy, _ = host_memcpy_gbps(iterations=iterations)
    gpus = torch.cuda.device_count()
    cal = Calibration(method="cuda-pinned-events", device=torch.cuda.get_device_name(), bytes=nbytes,
                      iterations=iterations, d2h_peak_gbps=one["d2h"], h2d_peak_gbps=one["h2d"],
                      d2h_samples_gbps=one["d2h_s"], h2d_samples_gbps=one["h2d_s"], bidir_peak_gbps=one["bidir"],
                      host_memcpy_gbps=memcpy, gpus=gpus)
    if all_gpus if all_gpus is not None else gpus > 1:
        cal.aggregate_d2h_gbps, cal.per_gpu_d2h_gbps = _cuda_all_gpus(nbytes, iterations, "d2h")
        cal.aggregate_h2d_gbps, cal.per_gpu_h2d_gbps = _cuda_all_gpus(nbytes, iterations, "h2d")
    cal.seconds = time.perf_counter() - t0
    return cal


def _cpu_name() -> str:
    from hybridkv_bench.results.host import cpu_model

    return cpu_model() or "cpu"
