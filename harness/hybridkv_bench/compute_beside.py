"""Compute beside offload (issue 26): what stores and loads cost the engine's own compute, in one run.

A compute load runs on the engine's stream (the stream a model's forward uses), of one of two kinds:

- `matmul`: bf16 square matrix products (fp32 on a CPU), arithmetic-bound; throughput in TFLOP/s;
- `attention`: decode attention (one query per sequence, `scaled_dot_product_attention`) over a long K/V,
  memory-bound; throughput in GB/s of K/V read.

Beside it, a copy loop moves pages of `page_bytes` between 16 engine layer pools and page-locked host
memory on a copy stream of its own, with one copy implementation (`dma`, `triton`, `torch`): a gather (a
store, GPU -> host) or a scatter (a load, host -> GPU), plan after plan, block ids scattered at random so
every page is its own copy. Each case measures, one right after the other:

1. the compute alone (`compute_alone`), median over windows of `steps` calls timed with events;
2. the same compute while the copy loop runs (`compute_during`), and the loop's GB/s over that span;
3. the copy loop alone (`transfer_alone_gbps`).

`compute_ratio = compute_during / compute_alone`; the transfer's ratios are to the pinned-copy ceiling of
the same run (`hybridkv_bench.calibration`: D2H for stores, H2D for loads). After the timed loops one more
copy runs into poisoned bytes and every byte is compared (`verified`).

    python -m hybridkv_bench.compute_beside --device cuda --out DIR     # the H200 matrix, about 2 minutes
    python -m hybridkv_bench.compute_beside --device cpu --quick        # the code path on a CPU (seconds)
    python -m hybridkv_bench.compute_beside --plot DIR                  # compute_ratio.png from DIR/run.json
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import torch
from hybridkv_kernels import COPY_ENGINES, PagedLayers, build_plan, choose_impl, run_plan
from hybridkv_kernels.plan import PageCopyPlan

from .calibration.copies import calibrate
from .context import collect_context, utc_now
from .results import write_json_atomic

ComputeKind = Literal["matmul", "attention"]
Direction = Literal["store", "load"]
Priority = Literal["default", "high"]
Launch = Literal["eager", "graph"]
LAYERS = 16  # one group's layers, as a Qwen3.6-27B group has
# Page sizes of the presets the issue names: 64 KiB blocks, Qwen3-Next TP8 / TP4 ranks, Qwen3.6-27B TP8 rank
# and TP1 (hybridkv.presets).
H200_PAGES = (65_536, 147_456, 278_528, 409_600, 3_211_264)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One run's matrix and sizes; validated at construction."""

    device: Literal["cpu", "cuda"] = "cuda"
    pages: tuple[int, ...] = H200_PAGES
    impls: tuple[str, ...] = ("dma", "triton")
    computes: tuple[ComputeKind, ...] = ("matmul", "attention")
    directions: tuple[Direction, ...] = ("store", "load")
    priorities: tuple[Priority, ...] = ("default",)
    # eager: the compute's calls launched one by one from Python, as an eager forward does; graph: each window
    # one CUDA graph replay, so launches from a busy Python process cannot gap the compute (GPU-side cost only)
    launch: Launch = "eager"
    plan_bytes: int = 256 << 20     # bytes one copy plan moves (a 784-token chunk of Qwen3.6-27B is 205 MB)
    matmul_n: int = 8192
    attn_batch: int = 16             # sequences
    attn_heads: int = 8
    attn_len: int = 16_384           # tokens of K/V per sequence
    attn_head_dim: int = 128
    windows: int = 20                # timed windows per measurement
    window_s: float = 0.03           # each window's length, about (steps are sized to it)
    # a measurement stops after this much wall time (at least one window): a compute starved by the copies
    # (decode attention beside the Triton kernel ran at 1% of its rate) would otherwise take minutes per case
    measure_s: float = 1.5
    transfer_alone_s: float = 0.5

    def __post_init__(self) -> None:
        for name, values, allowed in (("impls", self.impls, COPY_ENGINES),
                                      ("computes", self.computes, ("matmul", "attention")),
                                      ("directions", self.directions, ("store", "load")),
                                      ("priorities", self.priorities, ("default", "high"))):
            if not values or any(v not in allowed for v in values):
                raise ValueError(f"{name} must be a non-empty subset of {allowed}, got {values!r}")
        if self.launch not in ("eager", "graph") or (self.launch == "graph" and self.device != "cuda"):
            raise ValueError(f"launch must be eager, or graph on CUDA, got {self.launch!r} on {self.device}")
        if not self.pages or any(p < 16 or p % 16 for p in self.pages):
            raise ValueError(f"pages must be multiples of 16 bytes, got {self.pages!r}")
        if min(self.plan_bytes, self.matmul_n, self.attn_batch, self.attn_heads, self.attn_len,
               self.attn_head_dim, self.windows) < 1 or self.window_s <= 0 or self.transfer_alone_s <= 0 \
                or self.measure_s <= 0:
            raise ValueError(f"sizes, windows and times must be positive: {self}")
        if any(self.plan_bytes < LAYERS * p for p in self.pages):
            raise ValueError(f"plan_bytes {self.plan_bytes} holds fewer than one page per layer of {max(self.pages)} B")


@dataclass(slots=True)
class CaseResult:
    """One (compute, impl, page size, direction, priority) case; rates in the units of `compute_unit`."""

    compute: str
    impl: str                        # the copy engine asked for (auto, kernel, dma, triton, torch)
    page_bytes: int
    direction: str
    priority: str
    launch: str
    ran_impl: str                    # the implementation `impl` chose for these pages here
    compute_unit: str
    compute_alone: float
    compute_during: float
    compute_ratio: float
    transfer_gbps: float             # the copy loop beside the compute
    transfer_alone_gbps: float
    ceiling_gbps: float              # this run's pinned copy, same direction
    transfer_ratio: float
    transfer_alone_ratio: float
    plan_pages: int
    verified: bool
    compute_windows: list[float] = field(default_factory=list)


# -- compute loads ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ComputeLoad:
    """A callable step on the current stream and the work one step does (FLOP or bytes)."""

    kind: ComputeKind
    step: Callable[[], object]
    work: float
    unit: str
    scale: float  # work per second -> unit


def make_compute(kind: ComputeKind, cfg: BenchConfig, device: torch.device) -> ComputeLoad:
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


class _Timer:
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
    timer = _Timer(device, stream)
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
    timer = _Timer(device, stream)
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
    timed plans and ends at most three plans before them)."""

    def __init__(self, setup: CopySetup, impl: str, device: torch.device):
        self.setup, self.impl, self.device = setup, impl, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
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
            timer = _Timer(self.device, self.stream)
            timer.start()
            self.first_done.set()
            pending: list[torch.cuda.Event] = []
            done = 0
            while not self._stop.is_set():
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


def run_case(cfg: BenchConfig, load: ComputeLoad, setup: CopySetup, impl: str, direction: Direction,
             priority: Priority, ceiling: float, device: torch.device) -> CaseResult:
    """Compute alone, compute beside the copy loop, the loop alone, then the bytes verified."""
    page_bytes = setup.plan.page_bytes
    stream = None
    if device.type == "cuda":
        stream = torch.cuda.Stream(device, priority=-1 if priority == "high" else 0)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        steps = steps_per_window(load, cfg.window_s, device, stream)
        graph = capture(load, steps, stream) if cfg.launch == "graph" and stream is not None else None
        alone = compute_windows(load, steps, cfg.windows, device, stream, graph, cfg.measure_s)
        with CopyLoop(setup, impl, device) as loop:
            during = compute_windows(load, steps, cfg.windows, device, stream, graph, cfg.measure_s)
    alone_gbps = transfer_alone(setup, impl, device, cfg.transfer_alone_s)
    ok = verify(setup, impl, direction)
    a, d = statistics.median(alone), statistics.median(during)
    return CaseResult(compute=load.kind, impl=impl, page_bytes=page_bytes, direction=direction, priority=priority,
                      launch=cfg.launch, ran_impl=choose_impl(impl, page_bytes, device), compute_unit=load.unit,
                      compute_alone=a, compute_during=d, compute_ratio=d / a, transfer_gbps=loop.gbps,
                      transfer_alone_gbps=alone_gbps, ceiling_gbps=ceiling, transfer_ratio=loop.gbps / ceiling,
                      transfer_alone_ratio=alone_gbps / ceiling, plan_pages=setup.plan.num_pages, verified=ok,
                      compute_windows=during)


def run_matrix(cfg: BenchConfig, out: Path | None = None, log: Callable[[str], None] = print) -> dict:
    """Every case of `cfg`'s matrix beside this run's ceilings; written to `out` (run.json, cases.csv)."""
    device = torch.device(cfg.device)
    context = collect_context()
    cal = calibrate(cfg.device, nbytes=None if device.type == "cuda" else 64 << 20, iterations=5)
    log(f"ceilings: D2H {cal.d2h_peak_gbps:.1f} GB/s, H2D {cal.h2d_peak_gbps:.1f} GB/s ({cal.method})")
    cases: list[CaseResult] = []
    for kind in cfg.computes:
        load = make_compute(kind, cfg, device)
        for page in cfg.pages:
            for direction in cfg.directions:
                ceiling = cal.d2h_peak_gbps if direction == "store" else cal.h2d_peak_gbps
                setup = make_copy(direction, page, cfg.plan_bytes, device, seed=page)
                for impl in cfg.impls:
                    for priority in cfg.priorities:
                        c = run_case(cfg, load, setup, impl, direction, priority, ceiling, device)
                        cases.append(c)
                        log(f"{kind:9} {page:>9} B {direction:5} {impl:6} {priority:7} {cfg.launch:5} compute "
                            f"{c.compute_during:8.1f}/{c.compute_alone:8.1f} {c.compute_unit} = {c.compute_ratio:.3f}"
                            f" | copies {c.transfer_gbps:5.1f} GB/s = {c.transfer_ratio:.2f} of {ceiling:.1f} "
                            f"(alone {c.transfer_alone_ratio:.2f}) | ran={c.ran_impl} verified={c.verified}")
                del setup
        del load
    context["finished_at"] = utc_now()
    run = {"context": context, "config": asdict(cfg), "calibration": msgspec.to_builtins(cal),
           "cases": [asdict(c) for c in cases]}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "run.json", run)
        write_csv(out / "cases.csv", cases)
    return run


CSV_FIELDS = [f for f in CaseResult.__dataclass_fields__ if f != "compute_windows"]


def write_csv(path: Path, cases: list[CaseResult]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for c in cases:
            w.writerow(asdict(c))


def table(run: dict) -> str:
    """A Markdown table: compute_ratio beside the transfer's ratio to its same-run ceiling."""
    rows = ["| compute | pages (B) | direction | impl | priority | launch | compute_ratio | copies GB/s (of ceiling) | "
            "copies alone (of ceiling) | verified |", "|---|---:|---|---|---|---|---:|---:|---:|---|"]
    for c in run["cases"]:
        rows.append(f"| {c['compute']} | {c['page_bytes']:,} | {c['direction']} | {c['impl']} | {c['priority']} | "
                    f"{c['launch']} | {c['compute_ratio']:.3f} | {c['transfer_gbps']:.1f} "
                    f"({c['transfer_ratio']:.2f} of {c['ceiling_gbps']:.1f}) | {c['transfer_alone_gbps']:.1f} "
                    f"({c['transfer_alone_ratio']:.2f}) | {c['verified']} |")
    return "\n".join(rows)


def plot(folder: Path) -> Path:
    """compute_ratio.png: per compute load and direction, compute_ratio and transfer ratio over page size."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.loads((folder / "run.json").read_text())
    cases = run["cases"]
    computes = sorted({c["compute"] for c in cases})
    directions = ["store", "load"]
    series = sorted({(c["impl"], c["priority"], c["launch"]) for c in cases})
    fig, axes = plt.subplots(len(computes), 2, figsize=(11, 3.6 * len(computes)), squeeze=False)
    for i, kind in enumerate(computes):
        for j, direction in enumerate(directions):
            ax = axes[i][j]
            for impl, priority, launch in series:
                sel = sorted((c for c in cases if c["compute"] == kind and c["direction"] == direction
                              and (c["impl"], c["priority"], c["launch"]) == (impl, priority, launch)),
                             key=lambda c: c["page_bytes"])
                if not sel:
                    continue
                name = impl if len(series) == 1 else f"{impl} {priority} {launch}"
                x = [c["page_bytes"] / 1e3 for c in sel]
                line, = ax.plot(x, [c["compute_ratio"] for c in sel], "o-", label=f"{name}: compute_ratio")
                ax.plot(x, [c["transfer_ratio"] for c in sel], "s--", color=line.get_color(),
                        label=f"{name}: copies / same-run ceiling")
            ax.set_xscale("log")
            ax.set_ylim(0, 1.1)
            ax.set_xlabel("page size (KB)")
            ax.set_title(f"{kind} beside {direction}s")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = folder / "compute_ratio.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridkv_bench.compute_beside", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="run folder for run.json and cases.csv")
    ap.add_argument("--pages", type=int, nargs="+", default=None)
    ap.add_argument("--impls", nargs="+", default=None, help="copy engines: auto kernel dma triton torch "
                                                             "(default: dma triton on CUDA, dma torch on a CPU)")
    ap.add_argument("--computes", nargs="+", default=["matmul", "attention"])
    ap.add_argument("--directions", nargs="+", default=["store", "load"])
    ap.add_argument("--priorities", nargs="+", default=["default"],
                    help="the engine stream's priority: default (0, as the copies') and/or high")
    ap.add_argument("--launch", choices=["eager", "graph"], default="eager",
                    help="graph: each window one CUDA graph replay (CUDA only)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: the code path, not a measurement")
    ap.add_argument("--plot", type=Path, default=None, metavar="DIR", help="instead: plot DIR/run.json")
    args = ap.parse_args(argv)
    if args.plot is not None:
        print(plot(args.plot))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    impls = tuple(args.impls or (("dma", "triton") if args.device == "cuda" else ("dma", "torch")))
    sizes: dict = {}
    if args.quick or args.device == "cpu":
        sizes = dict(plan_bytes=LAYERS * 4096 * 16, matmul_n=192, attn_batch=2, attn_heads=2, attn_len=512,
                     attn_head_dim=32, windows=3, window_s=0.005, transfer_alone_s=0.02)
    pages = tuple(args.pages or (H200_PAGES if not sizes else (4096, 16384)))
    try:
        cfg = BenchConfig(device=args.device, pages=pages, impls=impls, computes=tuple(args.computes),
                          directions=tuple(args.directions), priorities=tuple(args.priorities), launch=args.launch,
                          **sizes)
    except ValueError as e:
        ap.error(str(e))
    run = run_matrix(cfg, args.out)
    print(table(run))
    return 0 if all(c["verified"] for c in run["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
