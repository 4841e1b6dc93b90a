"""Copy mechanisms for paged gather/scatter against the PCIe ceiling, on every preset's page size.

    python kernels/bench/bench_copy_variants.py --out results/runs/copy_variants.json   # H200, ~3 min

For each page size of the presets (Qwen3.6-27B at TP1/TP4/TP8, Qwen3-Next TP1; and 64 / 256 KiB pages of
smaller blocks, where `auto` keeps the kernel) and a long (about 1.6 GB)
and a short (2 chunks) transfer, it times, wall clock from the first enqueue to the end of the copies
(plans are built beforehand: this is the copy mechanism alone):
- `dma`: hybridkv_kernels' DMA path as `auto` runs it: the plan's runs of pages in two batched driver calls
  (cuMemcpyBatchAsync, CUDA 12.8+) on two streams;
- `dma-loop`: one `copy_` per contiguous run of pages on one stream (the path without batching);
- `batch`: one batched driver call (`hybridkv_kernels.cuda_batch`) for the whole plan on one stream;
- `triton-B-W`: the one-launch Triton kernel with B KiB per program and W warps.
Host memory is a shared mapping registered with cudaHostRegister, as the server's arena is. Ceilings: one
pinned 1 GiB copy each way, and both at once on two streams (bidirectional), measured in the same run.
With --bidir it also runs a gather and a scatter at once (store while load) per mechanism pair.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import threading
import time

import numpy as np
import torch
from hybridkv_kernels import PagedLayers, build_plan, cuda_batch, run_plan
from hybridkv_kernels.copy_dma import copy_pages_dma, copy_runs
from hybridkv_kernels.copy_triton import copy_pages_triton

PAGES = {"qwen36_tp1": 3_211_264, "next_tp1": 1_114_112, "qwen36_tp4": 802_816, "qwen36_tp8": 409_600,
         "block16_64k": 65_536, "block64_256k": 262_144}
LAYERS_PER_GROUP, GROUPS = 16, 4


def host_region(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    assert int(rc) == 0, f"cudaHostRegister failed: {int(rc)}"
    t.fill_(0)
    return mm, t


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def ceilings(reps: int) -> dict[str, float]:
    n = 1 << 30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    h1 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    d2h = n / timed(lambda: h1.copy_(dev, non_blocking=True), reps) / 1e9
    h2d = n / timed(lambda: dev.copy_(h1, non_blocking=True), reps) / 1e9

    def both():
        with torch.cuda.stream(s1):
            h1.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(h2, non_blocking=True)
    bidir = 2 * n / timed(both, reps) / 1e9
    return {"d2h_peak_gbps": d2h, "h2d_peak_gbps": h2d, "bidir_peak_gbps": bidir}


def make_case(page_bytes: int, chunks: int, blocks_per_chunk: int, host: torch.Tensor, gen: np.random.Generator):
    """Engine layer tensors with random scattered blocks, and a plan per direction into `host` objects."""
    nblocks = chunks * blocks_per_chunk * GROUPS + 8
    layers = [torch.randint(0, 255, (nblocks, page_bytes), dtype=torch.uint8, device="cuda")
              for _ in range(LAYERS_PER_GROUP)]  # groups share the layer tensors (vLLM) with disjoint blocks
    perm = gen.permutation(nblocks)
    groups = [PagedLayers.from_views(layers) for _ in range(GROUPS)]
    transfers, off = [], 0
    obj_bytes = LAYERS_PER_GROUP * blocks_per_chunk * page_bytes
    for c in range(chunks):
        for g in range(GROUPS):
            ids = perm[(c * GROUPS + g) * blocks_per_chunk:(c * GROUPS + g + 1) * blocks_per_chunk]
            transfers.append((groups[g], ids, host[off:off + obj_bytes]))
            off += obj_bytes
    used = perm[:chunks * GROUPS * blocks_per_chunk]
    return layers, build_plan("gather", transfers), build_plan("scatter", transfers), off, used


def mechanisms(batch: cuda_batch.BatchMemcpy | None):
    s_main = torch.cuda.Stream()

    def dma(plan):
        def run():
            with torch.cuda.stream(s_main):
                run_plan(plan, "dma")
        return run

    def dma_loop(plan):
        def run():
            with torch.cuda.stream(s_main):
                copy_pages_dma(plan, batched=False)
        return run

    def batched(plan):
        starts, lengths = copy_runs(plan)
        src, dst, sizes = plan.src_addr[starts], plan.dst_addr[starts], lengths * plan.page_bytes

        def run():
            batch(dst, src, sizes, s_main.cuda_stream, torch.cuda.current_device())
        return run

    def triton(block_kib, warps):
        def make(plan):
            def run():
                with torch.cuda.stream(s_main):
                    copy_pages_triton(plan, block_bytes=block_kib * 1024, num_warps=warps)
            return run
        return make

    out = {"dma": dma, "dma-loop": dma_loop}
    if batch is not None:
        out["batch"] = batched
    for b, w in ((16, 4), (32, 4), (32, 8), (64, 8)):
        out[f"triton-{b}-{w}"] = triton(b, w)
    return out


def verify(run_g, run_s, layers, used: np.ndarray) -> bool:
    """A gather then a scatter back into zeroed blocks restores the used pages exactly."""
    idx = torch.from_numpy(used).to("cuda")
    ref = [t.index_select(0, idx) for t in layers]
    run_g()
    torch.cuda.synchronize()
    for t in layers:
        t.index_fill_(0, idx, 0)
    torch.cuda.synchronize()  # the scatter runs on its own stream: the fill must be done first
    run_s()
    torch.cuda.synchronize()
    return all(torch.equal(t.index_select(0, idx), r) for t, r in zip(layers, ref, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--long-gb", type=float, default=1.6)
    ap.add_argument("--bidir", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated page names to run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.cuda.init()
    ceil = ceilings(a.reps)
    print(json.dumps(ceil))
    batch = cuda_batch.get()  # the library's own wrapper: the bench times the driver call it makes
    print("batched memcpy: " + ("unavailable" if batch is None else
                                "cuMemcpyBatchAsync_v2" if batch.v2 else "cuMemcpyBatchAsync"))
    host_bytes = int(a.long_gb * 1e9) + (256 << 20)
    mm, host = host_region(host_bytes)
    gen = np.random.default_rng(0)
    rows = []
    mechs = mechanisms(batch)
    for name, pb in PAGES.items():
        if a.only and name not in a.only.split(","):
            continue
        chunk_bytes = GROUPS * LAYERS_PER_GROUP * pb
        for size, chunks in (("long", max(2, int(a.long_gb * 1e9 // chunk_bytes))), ("short", 2)):
            layers, pg, ps, nbytes, used = make_case(pb, chunks, 1, host, gen)
            reps = a.reps if size == "long" else 4 * a.reps
            for mname, make in mechs.items():
                row = {"pages": name, "page_bytes": pb, "size": size, "bytes": nbytes, "mech": mname}
                try:
                    rg, rs = make(pg), make(ps)
                    row["ok"] = verify(rg, rs, layers, used)
                    row["store_gbps"] = nbytes / timed(rg, reps) / 1e9
                    row["load_gbps"] = nbytes / timed(rs, reps) / 1e9
                    row["store_ratio"] = row["store_gbps"] / ceil["d2h_peak_gbps"]
                    row["load_ratio"] = row["load_gbps"] / ceil["h2d_peak_gbps"]
                except Exception as e:  # a mechanism that cannot run here is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
            if a.bidir and size == "long":
                # store while load: gather from half the blocks while scattering into the other half
                half = len(pg.transfers) // 2
                g2 = build_plan("gather", pg.transfers[:half])
                s2 = build_plan("scatter", ps.transfers[half:])
                for gm, sm in (("dma", "dma"), ("dma-loop", "dma-loop"), ("batch", "batch"), ("triton-16-4", "dma"),
                               ("triton-16-4", "triton-16-4")):
                    if gm not in mechs or sm not in mechs:
                        continue
                    other = mechanisms(batch)  # its own streams, so the two directions overlap
                    rg, rs = mechs[gm](g2), other[sm](s2)

                    def both(rg=rg, rs=rs):
                        # the load is enqueued from its own thread, as the library's load worker does
                        t = threading.Thread(target=rs)
                        t.start()
                        rg()
                        t.join()
                    t = timed(both, a.reps)
                    row = {"pages": name, "size": "bidir", "mech": f"{gm}+{sm}",
                           "bidir_gbps": (g2.nbytes + s2.nbytes) / t / 1e9}
                    row["bidir_ratio"] = row["bidir_gbps"] / ceil["bidir_peak_gbps"]
                    rows.append(row)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                          flush=True)
            del layers, pg, ps
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"ceilings": ceil, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
