"""Compute beside offload: what stores and loads cost the engine's own compute, in one run.

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

    python -m hybridkv_bench.microbench.compute_beside --device cuda --out DIR     # the H200 matrix, about 2 minutes
    python -m hybridkv_bench.microbench.compute_beside --device cpu --quick        # the code path on a CPU (seconds)
    python -m hybridkv_bench.microbench.compute_beside --plot DIR                  # compute_ratio.png from DIR/run.json
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import torch
from hybridkv_kernels import COPY_ENGINES, choose_impl
from hybridkv_kernels.pace import Pace

from hybridkv_bench.calibration.copies import calibrate
from hybridkv_bench.microbench.compute_load import (
    ComputeKind,
    ComputeLoad,
    capture,
    compute_windows,
    make_compute,
    steps_per_window,
)
from hybridkv_bench.microbench.copy_loop import (
    LAYERS,
    CopyLoop,
    CopySetup,
    Direction,
    make_copy,
    transfer_alone,
    verify,
)
from hybridkv_bench.results.folder import write_json_atomic
from hybridkv_bench.results.host import collect_context, utc_now

Priority = Literal["default", "high"]
Launch = Literal["eager", "graph"]
# Page sizes of the presets: 64 KiB blocks, Qwen3-Next TP8 / TP4 ranks, Qwen3.6-27B TP8 rank
# and TP1 (hybridkv.model.presets).
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
    # the copy loop beside the compute paced to these fractions of its own rate alone (1.0: unpaced): the curve of
    # compute_ratio against the link's share that a deployment's cap (`max_link_fraction`) would pick a point on
    link_fractions: tuple[float, ...] = (1.0,)
    # host: the copy loop waits before queueing each plan (bursts of whole plans); library: the transfer
    # library's pacing (hybridkv_kernels.pace: slices and gaps queued on the copy stream, what TransferConfig's
    # max_link_fraction / max_compute_cost run)
    pacer: str = "host"

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
        if self.pacer not in ("host", "library") or (self.pacer == "library" and self.device != "cuda"):
            raise ValueError(f"pacer must be host, or library on CUDA, got {self.pacer!r} on {self.device}")
        if not self.link_fractions or any(not 0 < f <= 1 for f in self.link_fractions):
            raise ValueError(f"link_fractions must be in (0, 1], got {self.link_fractions!r}")
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
    link_fraction: float = 1.0       # the pace asked of the copy loop, as a fraction of its rate alone
    compute_windows: list[float] = field(default_factory=list)


def run_case(cfg: BenchConfig, load: ComputeLoad, setup: CopySetup, impl: str, direction: Direction,
             priority: Priority, ceiling: float, device: torch.device) -> list[CaseResult]:
    """The loop alone, then per link fraction: compute alone, compute beside the loop paced to that fraction of its
    rate alone; then the bytes verified. One result per fraction."""
    page_bytes = setup.plan.page_bytes
    alone_gbps = transfer_alone(setup, impl, device, cfg.transfer_alone_s)
    stream = None
    if device.type == "cuda":
        stream = torch.cuda.Stream(device, priority=-1 if priority == "high" else 0)
    runs = []
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        steps = steps_per_window(load, cfg.window_s, device, stream)
        graph = capture(load, steps, stream) if cfg.launch == "graph" and stream is not None else None
        for frac in cfg.link_fractions:
            alone = compute_windows(load, steps, cfg.windows, device, stream, graph, cfg.measure_s)
            paced = frac < 1
            library = Pace(frac, alone_gbps) if paced and cfg.pacer == "library" else None
            rate = frac * alone_gbps if paced and library is None else 0.0
            with CopyLoop(setup, impl, device, rate_gbps=rate, pace=library) as loop:
                during = compute_windows(load, steps, cfg.windows, device, stream, graph, cfg.measure_s)
            runs.append((frac, alone, during, loop.gbps))
    ok = verify(setup, impl, direction)
    out = []
    for frac, alone, during, gbps in runs:
        a, d = statistics.median(alone), statistics.median(during)
        out.append(CaseResult(compute=load.kind, impl=impl, page_bytes=page_bytes, direction=direction,
                              priority=priority, launch=cfg.launch, ran_impl=choose_impl(impl, page_bytes, device),
                              compute_unit=load.unit, compute_alone=a, compute_during=d, compute_ratio=d / a,
                              transfer_gbps=gbps, transfer_alone_gbps=alone_gbps, ceiling_gbps=ceiling,
                              transfer_ratio=gbps / ceiling, transfer_alone_ratio=alone_gbps / ceiling,
                              plan_pages=setup.plan.num_pages, verified=ok, link_fraction=frac,
                              compute_windows=during))
    return out


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
                        for c in run_case(cfg, load, setup, impl, direction, priority, ceiling, device):
                            cases.append(c)
                            log(f"{kind:9} {page:>9} B {direction:5} {impl:6} {priority:7} {cfg.launch:5} "
                                f"pace {c.link_fraction:.2f} compute "
                                f"{c.compute_during:8.1f}/{c.compute_alone:8.1f} {c.compute_unit} = "
                                f"{c.compute_ratio:.3f} | copies {c.transfer_gbps:5.1f} GB/s = "
                                f"{c.transfer_ratio:.2f} of {ceiling:.1f} (alone {c.transfer_alone_ratio:.2f}) | "
                                f"ran={c.ran_impl} verified={c.verified}")
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
    rows = ["| compute | pages (B) | direction | impl | priority | launch | pace | compute_ratio | "
            "copies GB/s (of ceiling) | copies alone (of ceiling) | verified |",
            "|---|---:|---|---|---|---|---:|---:|---:|---:|---|"]
    for c in run["cases"]:
        rows.append(f"| {c['compute']} | {c['page_bytes']:,} | {c['direction']} | {c['impl']} | {c['priority']} | "
                    f"{c['launch']} | {c.get('link_fraction', 1.0):.2f} | {c['compute_ratio']:.3f} | "
                    f"{c['transfer_gbps']:.1f} "
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
    series = sorted({(c["impl"], c["priority"], c["launch"], c.get("link_fraction", 1.0)) for c in cases})
    fig, axes = plt.subplots(len(computes), 2, figsize=(11, 3.6 * len(computes)), squeeze=False)
    for i, kind in enumerate(computes):
        for j, direction in enumerate(directions):
            ax = axes[i][j]
            for impl, priority, launch, pace in series:
                sel = sorted((c for c in cases if c["compute"] == kind and c["direction"] == direction
                              and (c["impl"], c["priority"], c["launch"], c.get("link_fraction", 1.0))
                              == (impl, priority, launch, pace)), key=lambda c: c["page_bytes"])
                if not sel:
                    continue
                name = impl if len(series) == 1 else f"{impl} {priority} {launch} pace {pace:.2f}"
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
    if len({c.get("link_fraction", 1.0) for c in cases}) > 1:
        _plot_pace(cases, folder / "compute_vs_link.png")
    return path


def _plot_pace(cases: list[dict], path: Path) -> None:
    """compute_ratio against the copies' share of the same-run ceiling, one line per compute, direction and page
    size: the curve a cap on the link's share (`--link-fractions`) picks its point on."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(c["compute"], c["direction"], c["page_bytes"], c["impl"]) for c in cases}):
        sel = sorted((c for c in cases if (c["compute"], c["direction"], c["page_bytes"], c["impl"]) == key),
                     key=lambda c: c["transfer_ratio"])
        ax.plot([c["transfer_ratio"] for c in sel], [c["compute_ratio"] for c in sel], "o-",
                label=f"{key[0]} beside {key[1]}s, {key[2] / 1e3:.0f} KB pages, {key[3]}")
    ax.axhline(0.97, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("copies / same-run pinned ceiling")
    ax.set_ylabel("compute_ratio (during / alone)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m hybridkv_bench.microbench.compute_beside",
                                 description=__doc__.split("\n")[0])
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
    ap.add_argument("--link-fractions", type=float, nargs="+", default=[1.0],
                    help="pace the copies to these fractions of their rate alone (1.0: unpaced)")
    ap.add_argument("--pacer", choices=["host", "library"], default="host",
                    help="how copies are paced below 1.0: the loop waits between plans (host), or the library's "
                         "slices and gaps on the copy stream (library)")
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
                          link_fractions=tuple(args.link_fractions), pacer=args.pacer, **sizes)
    except ValueError as e:
        ap.error(str(e))
    run = run_matrix(cfg, args.out)
    print(table(run))
    return 0 if all(c["verified"] for c in run["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
