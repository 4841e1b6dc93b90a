"""Gather/scatter throughput of every implementation against the copy ceiling measured in the same run.

    python kernels/bench/bench_gather_scatter.py --out results/runs/kernels.json          # H200, < 4 min
    TRITON_INTERPRET=1 python kernels/bench/bench_gather_scatter.py --device cpu --small  # smoke test

Pools are laid out as vLLM's hybrid allocator lays them: one raw tensor per layer slot, shared by
the 4 groups, which own disjoint random blocks. Each case verifies its bytes once into poisoned
memory, warms up, then reports the median of timed runs; GB/s = 1e9 B/s of page payload.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from hybridkv_kernels import PagedLayers, available_impls, plan_gather, plan_scatter, run_plan

SENTINEL = 0xA5
GROUPS = 4


@dataclass(frozen=True, slots=True)
class Shape:
    """One pool shape: page size, layers per group, chunks per group and blocks per chunk."""

    name: str
    page_bytes: int
    layers: int
    chunks: int
    blocks_per_chunk: int

    @property
    def total_bytes(self) -> int:
        return GROUPS * self.layers * self.chunks * self.blocks_per_chunk * self.page_bytes


def shapes(small: bool) -> list[Shape]:
    """Qwen3.6-27B TP1 pages (one 784-token block per chunk) and 16-token-block 64 KiB pages."""
    if small:
        return [Shape("qwen36_27b_tp1", 3_211_264, 2, 2, 1), Shape("block16_64k", 65_536, 2, 4, 4)]
    return [Shape("qwen36_27b_tp1", 3_211_264, 16, 12, 1),  # 2.47 GB
            Shape("block16_64k", 65_536, 16, 16, 16)]  # 1.07 GB


def sync(device: torch.device) -> None:
    """Wait for all queued work on `device`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median wall time of `fn` over `reps` runs, each fenced by a device synchronize."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(device: torch.device, small: bool, reps: int) -> dict[str, float]:
    """One large pinned D2H and H2D copy (or host memcpy on a CPU): the run's own ceiling."""
    n = (64 if small else 2048) << 20
    if device.type == "cpu":
        a, b = torch.empty(n, dtype=torch.uint8).fill_(1), torch.empty(n, dtype=torch.uint8)
        gbps = n / median_seconds(lambda: b.copy_(a), device, reps) / 1e9
        return {"d2h_peak_gbps": gbps, "h2d_peak_gbps": gbps, "ceiling": "host memcpy"}
    g = torch.empty(n, dtype=torch.uint8, device=device)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d2h = n / median_seconds(lambda: h.copy_(g, non_blocking=True), device, reps) / 1e9
    h2d = n / median_seconds(lambda: g.copy_(h, non_blocking=True), device, reps) / 1e9
    return {"d2h_peak_gbps": d2h, "h2d_peak_gbps": h2d, "ceiling": "2 GiB pinned copy_"}


class ShmRegion:
    """A /dev/shm file mapped here (and cudaHostRegister'ed on CUDA), as the cache server's arena."""

    def __init__(self, nbytes: int, device: torch.device):
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.file = tempfile.NamedTemporaryFile(dir=where)  # noqa: SIM115 (closed in close())
        self.file.truncate(nbytes)
        self.map = mmap.mmap(self.file.fileno(), nbytes)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.tensor.fill_(0)  # fault the pages in now, not inside a timed copy
        self.registered = device.type == "cuda"
        if self.registered:
            rc = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            assert rc == 0, f"cudaHostRegister failed with {rc}"

    def close(self) -> None:
        """Unregister and unmap (the mapping stays until exit if a view of it is still alive)."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        gc.collect()
        with contextlib.suppress(BufferError):
            self.map.close()
        self.file.close()


def build_pool(shape: Shape, device: torch.device, gen: torch.Generator):
    """Shared layer-slot tensors of random bytes, one PagedLayers per group, and each group's block ids."""
    per_group = shape.chunks * shape.blocks_per_chunk
    num_blocks = GROUPS * per_group + 8
    # Random bytes made on the device: filling GBs with a CPU generator would take most of the budget.
    dev_gen = torch.Generator(device=device).manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    slots = [torch.randint(0, 256, (num_blocks, shape.page_bytes), dtype=torch.uint8, device=device,
                           generator=dev_gen) for _ in range(shape.layers)]
    groups = [PagedLayers.from_views(slots) for _ in range(GROUPS)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    ids = [perm[g * per_group : (g + 1) * per_group] for g in range(GROUPS)]
    return slots, groups, ids


def transfers_for(shape: Shape, groups, ids, host: torch.Tensor) -> list[list[tuple]]:
    """Per group, one (layers, block ids, object) per chunk, objects packed back to back in `host`."""
    per_group, off = [], 0
    obj_bytes = shape.layers * shape.blocks_per_chunk * shape.page_bytes
    for layers, gids in zip(groups, ids, strict=True):
        ts = []
        for c in range(shape.chunks):
            chunk = gids[c * shape.blocks_per_chunk : (c + 1) * shape.blocks_per_chunk]
            ts.append((layers, chunk, host[off : off + obj_bytes]))
            off += obj_bytes
        per_group.append(ts)
    return per_group


def runner(direction: str, per_group, impl: str, mode: str, device: torch.device):
    """A no-argument function enqueuing the whole case (plans built once, outside the timing)."""
    build = plan_gather if direction == "gather" else plan_scatter
    if mode == "single":
        plan = build([t for ts in per_group for t in ts])
        return lambda: run_plan(plan, impl)
    plans = [build(ts) for ts in per_group]
    streams = [torch.cuda.Stream(device) for _ in plans]

    def run() -> None:
        """Each group's copy on its own stream, all ordered after the current stream."""
        for plan, stream in zip(plans, streams, strict=True):
            stream.wait_stream(torch.cuda.current_stream(device))
            run_plan(plan, impl, stream=stream)
        for stream in streams:
            torch.cuda.current_stream(device).wait_stream(stream)

    return run


def verify(direction, run, slots, per_group, reference: torch.Tensor, host: torch.Tensor, device) -> bool:
    """Run once into poisoned destinations and compare every byte with the reference gather."""
    if direction == "gather":
        host.fill_(SENTINEL)
        run()
        sync(device)
        return bool(torch.equal(host.to(device), reference))
    host.copy_(reference.cpu())
    for s in slots:
        s.fill_(SENTINEL)
    run()
    sync(device)
    back = torch.empty_like(reference)
    run_plan(plan_gather(transfers_for_device(per_group, back)), "torch")
    sync(device)
    targets_ok = bool(torch.equal(back, reference))
    # Every block no group owns must still hold the poison: a scatter writes its target pages only.
    owned = {b for ts in per_group for _, ids, _ in ts for b in ids}
    free = torch.tensor([b for b in range(slots[0].shape[0]) if b not in owned], device=device)
    return targets_ok and all(bool((s.index_select(0, free) == SENTINEL).all()) for s in slots)


def transfers_for_device(per_group, flat: torch.Tensor) -> list[tuple]:
    """The same transfers with objects re-pointed at the same offsets of a device buffer."""
    out, off = [], 0
    for ts in per_group:
        for layers, ids, obj in ts:
            out.append((layers, ids, flat[off : off + obj.numel()]))
            off += obj.numel()
    return out


def main() -> None:
    """Run every (shape, direction, memory, impl, stream mode) case and print JSON lines and a table."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny sizes, for a CPU smoke run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--impls", default="triton,dma,torch")
    ap.add_argument("--out", default=None, help="write the run as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        # "cuda" alone names the current device; set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    impls = [i for i in args.impls.split(",") if i in available_impls(device)]
    modes = ["single", "per_group"] if device.type == "cuda" else ["single"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    context = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
               "device": name, "cuda": torch.version.cuda, "impls": impls, "modes": modes, "reps": args.reps}
    try:
        import triton

        context["triton"] = triton.__version__
    except ImportError:
        context["triton"] = None
    peaks = ceilings(device, args.small, args.reps)
    context.update(peaks)
    print(json.dumps({"context": context}), flush=True)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for shape in shapes(args.small):
        slots, groups, ids = build_pool(shape, device, gen)
        pinned = torch.empty(shape.total_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        shm = ShmRegion(shape.total_bytes, device)
        reference = torch.empty(shape.total_bytes, dtype=torch.uint8, device=device)
        layout = transfers_for(shape, groups, ids, pinned)
        run_plan(plan_gather(transfers_for_device(layout, reference)), "torch")
        sync(device)
        for direction in ("gather", "scatter"):
            for memory, host in (("pinned", pinned), ("shm", shm.tensor)):
                per_group = transfers_for(shape, groups, ids, host)
                t0 = time.perf_counter()
                plan_gather([t for ts in per_group for t in ts])
                plan_ms = (time.perf_counter() - t0) * 1e3
                for impl in impls:
                    for mode in modes:
                        run = runner(direction, per_group, impl, mode, device)
                        ok = verify(direction, run, slots, per_group, reference, host, device)
                        sec = median_seconds(run, device, args.reps)
                        gbps = shape.total_bytes / sec / 1e9
                        peak = peaks["d2h_peak_gbps" if direction == "gather" else "h2d_peak_gbps"]
                        case = {"shape": shape.name, "page_bytes": shape.page_bytes,
                                "bytes": shape.total_bytes, "pages": shape.total_bytes // shape.page_bytes,
                                "direction": direction,
                                "memory": memory, "impl": impl, "streams": mode, "verified": ok,
                                "median_s": sec, "gbps": gbps, "ceiling_gbps": peak, "ratio": gbps / peak,
                                "plan_build_ms": plan_ms}
                        cases.append(case)
                        print(json.dumps(case), flush=True)
        del run, per_group, host, layout, slots, groups, pinned, reference
        shm.close()
    print(f"\n{'shape':<16}{'dir':<8}{'memory':<8}{'impl':<8}{'streams':<10}{'GB/s':>8}{'ratio':>7}  ok")
    for c in cases:
        print(f"{c['shape']:<16}{c['direction']:<8}{c['memory']:<8}{c['impl']:<8}{c['streams']:<10}"
              f"{c['gbps']:>8.1f}{c['ratio']:>7.2f}  {'yes' if c['verified'] else 'NO'}")
    print(f"ceiling: D2H {peaks['d2h_peak_gbps']:.1f} GB/s, H2D {peaks['h2d_peak_gbps']:.1f} GB/s "
          f"({peaks['ceiling']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"context": context, "cases": cases}, f, indent=1)
    if not all(c["verified"] for c in cases):
        raise SystemExit("some cases moved wrong bytes (verified: false)")


if __name__ == "__main__":
    main()
