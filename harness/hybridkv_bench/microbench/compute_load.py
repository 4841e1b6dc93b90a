"""The engine's compute beside offload: a bf16 matmul (TFLOP/s) or a decode attention (GB/s of K/V), as a
step on the current stream, timed in windows, eagerly or as CUDA-graph replays (`compute_beside`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

ComputeKind = Literal["matmul", "attention"]


class ComputeSizes(Protocol):
    """The sizes of the compute loads (`compute_beside.BenchConfig` holds them)."""

    @property
    def matmul_n(self) -> int: ...
    @property
    def attn_batch(self) -> int: ...
    @property
    def attn_heads(self) -> int: ...
    @property
    def attn_len(self) -> int: ...
    @property
    def attn_head_dim(self) -> int: ...

# -- compute loads ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ComputeLoad:
    """A callable step on the current stream and the work one step does (FLOP or bytes)."""

    kind: ComputeKind
    step: Callable[[], object]
    work: float
    unit: str
    scale: float  # work per second -> unit


def make_compute(kind: ComputeKind, cfg: ComputeSizes, device: torch.device) -> ComputeLoad:
    """The compute load on random data (never zeros: they run faster than real data)."""
    gen = torch.Generator(device=device).manual_seed(26)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if kind == "matmul":
        n = cfg.matmul_n
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        out = torch.empty(n, n, device=device, dtype=dtype)
        return ComputeLoad(kind, lambda: torch.mm(a, b, out=out), 2.0 * n**3, "TFLOP/s", 1e-12)
    shape_kv = (cfg.attn_batch, cfg.attn_heads, cfg.attn_len, cfg.attn_head_dim)
    q = torch.randn(cfg.attn_batch, cfg.attn_heads, 1, cfg.attn_head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(shape_kv, device=device, dtype=dtype, generator=gen)
    v = torch.randn(shape_kv, device=device, dtype=dtype, generator=gen)
    kv_bytes = float(k.numel() * k.element_size() * 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return ComputeLoad(kind, lambda: sdpa(q, k, v), kv_bytes, "GB/s", 1e-9)


class Timer:
    """Elapsed seconds of work queued between start() and stop(): CUDA events on a GPU, the wall clock else."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None):
        self.cuda = device.type == "cuda"
        self.stream = stream

    def start(self) -> None:
        if self.cuda:
            self._a = torch.cuda.Event(enable_timing=True)
            self._a.record(self.stream)
        else:
            self._t = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            b = torch.cuda.Event(enable_timing=True)
            b.record(self.stream)
            b.synchronize()
            return self._a.elapsed_time(b) / 1e3
        return time.perf_counter() - self._t


def steps_per_window(load: ComputeLoad, window_s: float, device: torch.device,
                     stream: torch.cuda.Stream | None) -> int:
    """How many steps fill about `window_s` (after a warm-up: first-call setup stays out of the windows)."""
    timer = Timer(device, stream)
    for _ in range(3):
        load.step()
    timer.start()
    for _ in range(5):
        load.step()
    per_step = timer.stop() / 5
    return max(1, round(window_s / max(per_step, 1e-9)))


def compute_windows(load: ComputeLoad, steps: int, windows: int, device: torch.device,
                    stream: torch.cuda.Stream | None, graph: torch.cuda.CUDAGraph | None = None,
                    max_s: float = float("inf")) -> list[float]:
    """Throughput (in `load.unit`) of each of `windows` windows of `steps` steps queued back to back (with
    `graph`: one replay of it, `steps` steps captured); fewer windows once `max_s` of wall time has passed."""
    timer = Timer(device, stream)
    out: list[float] = []
    t0 = time.perf_counter()
    for _ in range(windows):
        if out and time.perf_counter() - t0 > max_s:
            break
        timer.start()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(steps):
                load.step()
        out.append(steps * load.work / timer.stop() * load.scale)
    return out


def capture(load: ComputeLoad, steps: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """`steps` steps of `load` as one CUDA graph, captured on `stream`."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(steps):
            load.step()
    stream.synchronize()
    return graph


# -- the copy loop ---------------------------------------------------------------------------------------------
