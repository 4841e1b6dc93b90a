"""Measurements taken beside the workload: what the cache server costs (copy ceilings live in
`hybridkv_bench.calibration.copies`).

- `server_vram_mib`: the server's VRAM from NVML by process id; None when NVML cannot tell.
- `cuda_libraries_mapped`: which CUDA libraries the server mapped, from /proc/PID/maps.
- `process_usage`: resident memory and CPU time (psutil).
torch and pynvml are imported inside the functions that need them.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from hybridkv_bench.calibration.copies import ProbeError

MIB = 1 << 20

# Shared objects whose presence in a process means it loaded a CUDA runtime, driver or CUDA build
# of torch. A process that maps none of them cannot have created a CUDA context.
_CUDA_LIB = re.compile(
    r"^(libcuda\.so|libcudart|libcublas|libcublasLt|libcudnn|libnvidia-|libnvrtc|libnvJitLink|libnccl"
    r"|libcusparse|libcufft|libcurand|libcusolver|libcupti|libtorch_cuda|libc10_cuda)"
)


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
