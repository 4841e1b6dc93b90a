"""Measurements taken beside the workload: copy ceilings and what the cache server costs.

- `calibrate`: the copy peak of this machine, measured in the same run as the payload rates it
  bounds (pinned D2H / H2D on CUDA, a large host memcpy on CPU).
- `server_vram_mib`: the server's VRAM from NVML by process id; None when NVML cannot tell.
- `cuda_libraries_mapped`: which CUDA libraries the server mapped, from /proc/PID/maps.
- `process_usage`: resident memory and CPU time (psutil).
torch and pynvml are imported inside the functions that need them.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Literal

import msgspec

MIB = 1 << 20

# Shared objects whose presence in a process means it loaded a CUDA runtime, driver or CUDA build
# of torch. A process that maps none of them cannot have created a CUDA context.
_CUDA_LIB = re.compile(
    r"^(libcuda\.so|libcudart|libcublas|libcublasLt|libcudnn|libnvidia-|libnvrtc|libnvJitLink|libnccl"
    r"|libcusparse|libcufft|libcurand|libcusolver|libcupti|libtorch_cuda|libc10_cuda)"
)


class ProbeError(RuntimeError):
    """A probe that could not measure what it was asked to (named in the message)."""


class Calibration(msgspec.Struct, kw_only=True):
    """Copy ceilings of this machine. On CPU both directions are one memcpy figure."""

    method: Literal["cuda-pinned-events", "cpu-memcpy"]
    device: str
    bytes: int
    iterations: int
    d2h_peak_gbps: float
    h2d_peak_gbps: float
    d2h_samples_gbps: list[float]
    h2d_samples_gbps: list[float]
    seconds: float  # wall time the calibration itself took


def _resolve_device(device: str) -> str:
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


def calibrate(device: str = "auto", nbytes: int | None = None, iterations: int = 5) -> Calibration:
    """Median copy rate over `iterations` timed copies after one warm-up, in GB/s (1e9 B/s).

    CUDA: pinned host <-> device copies of 1 GiB timed with CUDA events. CPU: a 256 MiB host copy
    (torch's copy_, the operation the CPU data path uses), timed with perf_counter.
    """
    import torch

    t0 = time.perf_counter()
    resolved = _resolve_device(device)
    if iterations < 1:
        raise ProbeError(f"iterations must be >= 1, got {iterations}")
    if resolved == "cuda":
        nbytes = nbytes or (1 << 30)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host.fill_(1)

        def timed(dst, src) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            return nbytes / (start.elapsed_time(end) / 1e3) / 1e9

        timed(dev, host), timed(host, dev)  # warm-up: first-touch, lazy module and context setup
        h2d = [timed(dev, host) for _ in range(iterations)]
        d2h = [timed(host, dev) for _ in range(iterations)]
        method, name = "cuda-pinned-events", torch.cuda.get_device_name()
        del host, dev
    else:
        nbytes = nbytes or (256 << 20)
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)

        def timed_cpu() -> float:
            start = time.perf_counter()
            dst.copy_(src)
            return nbytes / (time.perf_counter() - start) / 1e9

        timed_cpu()
        d2h = h2d = [timed_cpu() for _ in range(iterations)]
        method, name = "cpu-memcpy", _cpu_name()
    return Calibration(method=method, device=name, bytes=nbytes, iterations=iterations,
                       d2h_peak_gbps=statistics.median(d2h), h2d_peak_gbps=statistics.median(h2d),
                       d2h_samples_gbps=d2h, h2d_samples_gbps=h2d, seconds=time.perf_counter() - t0)


def _cpu_name() -> str:
    from .context import cpu_model

    return cpu_model() or "cpu"


def server_vram_mib(pid: int, control_pid: int | None = None) -> float | None:
    """VRAM held by process `pid` summed over all GPUs, from NVML; 0.0 if it holds none.

    None ("not measurable") when NVML is missing or fails, when the driver hides per-process
    memory, or when `control_pid` (a process known to hold a CUDA context, such as the engine)
    is not listed either: then NVML sees another PID namespace (a container) and a missing `pid`
    would prove nothing.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        used: dict[int, int | None] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                prev = used.get(p.pid, 0)
                used[p.pid] = None if prev is None or p.usedGpuMemory is None else prev + p.usedGpuMemory
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
    if control_pid is not None and control_pid not in used:
        return None
    if pid not in used:
        return 0.0
    mem = used[pid]
    return None if mem is None else mem / MIB


def cuda_libraries_mapped(pid: int, maps_path: str | Path | None = None) -> list[str]:
    """Paths of CUDA libraries mapped into process `pid` (sorted, each once)."""
    path = Path(maps_path) if maps_path is not None else Path(f"/proc/{pid}/maps")
    try:
        text = path.read_text()
    except OSError as e:
        raise ProbeError(f"cannot read {path}: {e.strerror}") from None
    found = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            lib = parts[5].removesuffix(" (deleted)")
            if _CUDA_LIB.match(Path(lib).name):
                found.add(lib)
    return sorted(found)


class ProcessUsage(msgspec.Struct, frozen=True, kw_only=True):
    rss_mib: float
    cpu_s: float  # user + system, this process only


def process_usage(pid: int) -> ProcessUsage:
    import psutil

    try:
        p = psutil.Process(pid)
        with p.oneshot():
            rss = p.memory_info().rss
            t = p.cpu_times()
    except psutil.Error as e:
        raise ProbeError(f"cannot read usage of process {pid}: {e}") from None
    return ProcessUsage(rss_mib=rss / MIB, cpu_s=t.user + t.system)


class ServerSample(msgspec.Struct, frozen=True, kw_only=True):
    """What the cache server costs, sampled after a case."""

    vram_mib: float | None
    cuda_libraries: list[str]
    rss_mib: float
    cpu_s: float

    def metrics(self) -> dict[str, float | bool | None]:
        return {"server_vram_mib": self.vram_mib, "server_cuda_mapped": bool(self.cuda_libraries),
                "server_rss_mib": self.rss_mib, "server_cpu_s": self.cpu_s}


def sample_server(pid: int, control_pid: int | None = None) -> ServerSample:
    """All server probes at once, for the runner to call after each case."""
    usage = process_usage(pid)
    return ServerSample(vram_mib=server_vram_mib(pid, control_pid), cuda_libraries=cuda_libraries_mapped(pid),
                        rss_mib=usage.rss_mib, cpu_s=usage.cpu_s)
