"""A GPU probe of the batched memcpy's settings (issue 37 items 2 and 3): what each costs the copies and the compute.

The library's batched copies (`hybridkv_kernels.cuda_batch`) run with the source read in stream order and no flags.
The driver offers more: `CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE` (flags) and a source access order of
`during_api_call` or `any`. This probe runs, per variant of those attributes:

1. `call_us`: the host time of one driver call queueing a plan of R runs (pages of `page_bytes`, every page its own
   run, as a Qwen3.6-27B TP8 chunk's pages are), p50 over rounds, the stream drained between calls;
2. `issue_to_done_us`: from the first call to the copies' end (host clock, the stream synchronized), for the same
   plan queued by `copy_pages_dma` with its first slice off, of 8 and of 16 runs (`copy_dma.FIRST_SLICE_RUNS`,
   the later calls growing from it): does a first call of a few runs start the copy engines sooner?
3. with `--compute`: `compute_beside`'s decode attention (CUDA graphs) beside DMA loads and stores of the same
   pages, with the engine's stream at default and at high priority. A copy stream cannot be given a lower priority
   than the default one (0 is CUDA's lowest): a high-priority engine stream is the same order between the two.

    python -m hybridkv_bench.microbench.memcpy_probe [--runs 80 1184] [--page-bytes 409600] [--compute] [--json]

It needs a CUDA device whose driver batches memcpys (CUDA 12.8+); anywhere else it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from hybridkv_kernels import PagedLayers, build_plan, copy_dma, cuda_batch
from hybridkv_kernels.copy_dma import copy_pages_dma, dma_runs
from hybridkv_kernels.plan import Direction

# (source access order, flags): the library's, then each change alone, then both
VARIANTS = (("stream", "default"), ("stream", "prefer_overlap_with_compute"), ("any", "default"),
            ("any", "prefer_overlap_with_compute"))
FIRST_SLICES = (0, 8, 16)


def usable() -> str | None:
    """None where the probe can run, else why not (one line)."""
    if not torch.cuda.is_available():
        return "no CUDA device here: this probe times the driver's batched memcpy on a GPU"
    if not cuda_batch.available():
        return ("this CUDA driver has no batched memcpy (cuMemcpyBatchAsync, CUDA 12.8+), or it is turned off: "
                "nothing to probe")
    return None


def _plan(direction: Direction, runs: int, page_bytes: int, device: torch.device):
    """A plan of `runs` pages of one layer pool, every page its own run (every other block, descending)."""
    pool = torch.randint(0, 256, (2 * runs + 1, page_bytes), dtype=torch.uint8, device=device)
    layers = PagedLayers.from_tensors([pool], page_bytes)
    ids = list(range(2 * runs, 0, -2))
    obj = torch.empty(runs * page_bytes, dtype=torch.uint8, pin_memory=True)
    return build_plan(direction, [(layers, ids, obj)])


def probe_calls(runs_list: list[int], page_bytes: int, rounds: int) -> list[dict]:
    """`call_us` and `issue_to_done_us` per (variant, direction, runs, first slice)."""
    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    batch = cuda_batch.get()
    assert batch is not None
    default_first = copy_dma.FIRST_SLICE_RUNS
    rows = []
    for order, flags in VARIANTS:
        cuda_batch.set_attributes(order, flags)
        directions: tuple[Direction, ...] = ("gather", "scatter")
        for direction in directions:
            for runs in runs_list:
                plan = _plan(direction, runs, page_bytes, device)
                dst, src, sizes = dma_runs(plan)
                calls = []
                for _ in range(rounds):
                    stream.synchronize()
                    t0 = time.perf_counter()
                    batch(dst, src, sizes, stream.cuda_stream, device.index or 0)
                    calls.append(time.perf_counter() - t0)
                stream.synchronize()
                for first in FIRST_SLICES:
                    copy_dma.FIRST_SLICE_RUNS = first
                    spans = []
                    for _ in range(rounds):
                        stream.synchronize()
                        t0 = time.perf_counter()
                        copy_pages_dma(plan, stream=stream, runs=(dst, src, sizes))
                        stream.synchronize()
                        spans.append(time.perf_counter() - t0)
                    rows.append({"src_access_order": order, "flags": flags, "direction": direction, "runs": runs,
                                 "page_bytes": page_bytes, "first_slice_runs": first,
                                 "call_us": statistics.median(calls) * 1e6,
                                 "issue_to_done_us": statistics.median(spans) * 1e6,
                                 "gbps": runs * page_bytes / statistics.median(spans) / 1e9})
                copy_dma.FIRST_SLICE_RUNS = default_first
    cuda_batch.set_attributes()  # the library's again
    return rows


def probe_compute(page_bytes: int) -> list[dict]:
    """compute_beside's decode attention beside DMA loads and stores, per attribute variant and engine priority."""
    from hybridkv_bench.microbench.compute_beside import BenchConfig, run_matrix

    rows = []
    for order, flags in VARIANTS:
        cuda_batch.set_attributes(order, flags)
        cfg = BenchConfig(device="cuda", pages=(page_bytes,), impls=("dma",), computes=("attention",),
                          directions=("load", "store"), priorities=("default", "high"), launch="graph")
        for c in run_matrix(cfg, None, log=lambda _line: None)["cases"]:
            rows.append({"src_access_order": order, "flags": flags, "direction": c["direction"],
                         "priority": c["priority"], "compute_ratio": c["compute_ratio"],
                         "transfer_ratio": c["transfer_ratio"], "verified": c["verified"]})
    cuda_batch.set_attributes()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m hybridkv_bench.microbench.memcpy_probe",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, nargs="+", default=[80, 1184], help="runs per plan (2 and 71 TP8 chunks)")
    ap.add_argument("--page-bytes", type=int, default=409_600, help="a Qwen3.6-27B TP8 page")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--compute", action="store_true", help="also decode attention beside the copies (about 2 min)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.page_bytes < 16 or args.page_bytes % 16 or any(r < 1 for r in args.runs):
        ap.error("--rounds and --runs must be >= 1, --page-bytes a multiple of 16")
    if (why := usable()) is not None:
        print(f"memcpy_probe: {why}", file=sys.stderr)
        return 2
    rows = probe_calls(args.runs, args.page_bytes, args.rounds)
    if args.compute:
        rows += probe_compute(args.page_bytes)
    for r in rows:
        print(json.dumps(r) if args.json else "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                        for k, v in r.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
