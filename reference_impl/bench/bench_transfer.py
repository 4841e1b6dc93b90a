"""End-to-end store and retrieve through a real cache server, against the copy ceiling measured in the same run.

For each wire format x copy engine x stream mode x policy: store N chunks of a model's pages (GPU or
CPU tensors) into the server, look them up, retrieve them into other blocks, verify every moved byte,
and print GB/s beside the pinned D2H / H2D ceiling. Also reports the server's VRAM (NVML, by pid)
and whether it mapped any CUDA library.

    python reference_impl/bench/bench_transfer.py --preset qwen3.6-27b --chunks 20 --out transfer.json
    python reference_impl/bench/bench_transfer.py --device cpu --preset qwen3.6-27b-4layers --chunks 4 --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.presets import preset_layout
from hybridkv.server.launch import start_server
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools
from hybridkv_bench.probes import calibrate, sample_server


def verify(layout, pools, src, dst, chunk_tokens: int, policy: str) -> int:
    """Bytes of every retrieved page compared with its source page; returns the count of bad pages."""
    bad = 0
    for g, grp in enumerate(layout.groups):
        bpc = chunk_tokens // grp.block_tokens
        n = len(src[g]) // bpc
        if grp.kind == "attention":
            moved = range(n * bpc)
        else:
            ends = [(c + 1) * bpc - 1 for c in range(n)]
            moved = ends if policy == "all" else ends[-1:]
        for t in pools[g]:
            s = t[torch.as_tensor([src[g][j] for j in moved], device=t.device)]
            d = t[torch.as_tensor([dst[g][j] for j in moved], device=t.device)]
            bad += int((s != d).any(dim=1).sum())
    return bad


def run_case(endpoint, layout, pools, alloc, cfg: TransferConfig, chunks: int, reps: int, seed: int) -> dict:
    sync = torch.cuda.synchronize if pools[0][0].is_cuda else (lambda: None)
    res = {"store_s": [], "store_copy_s": [], "load_s": [], "load_copy_s": [], "lookup_s": [], "bad_pages": 0}
    with KVTransfer(endpoint, layout, pools, cfg) as kv:
        ct = kv.chunk_tokens
        bpc = [ct // g.block_tokens for g in layout.groups]
        src = [alloc.allocate(chunks * b) for b in bpc]
        dst = [alloc.allocate(chunks * b) for b in bpc]
        try:
            for r in range(reps + 1):  # the first repeat warms up (kernel compile, first touch of slots)
                tokens = np.random.default_rng(seed * 1000 + r).integers(0, 150_000, chunks * ct)
                sync()
                t0 = time.perf_counter()
                st = kv.store(f"s{r}", tokens, src).wait_committed(600)
                t1 = time.perf_counter()
                hit = kv.lookup(f"l{r}", tokens)
                t2 = time.perf_counter()
                ld = kv.retrieve(hit, dst).wait(600)
                t3 = time.perf_counter()
                if hit.hit_chunks != chunks:
                    raise RuntimeError(f"hit {hit.hit_chunks} of {chunks} chunks")
                if r == 0:
                    res["bad_pages"] = verify(layout, pools, src, dst, ct, cfg.retrieve_policy)
                    res["store_bytes"], res["load_bytes"] = st.nbytes, ld.nbytes
                    continue
                res["store_s"].append(t1 - t0)
                res["store_copy_s"].append(st.copy_s)
                res["lookup_s"].append(t2 - t1)
                res["load_s"].append(t3 - t2)
                res["load_copy_s"].append(ld.copy_s)
                kv.end_session(f"s{r}")
                kv.end_session(f"l{r}")
                kv.client.call(__import__("hybridkv.protocol", fromlist=["Clear"]).Clear(engine=kv.engine_id))
        finally:
            for ids in src + dst:
                alloc.free(ids)
    out = {"bad_pages": res["bad_pages"], "store_bytes": res["store_bytes"], "load_bytes": res["load_bytes"]}
    for k in ("store_s", "store_copy_s", "lookup_s", "load_s", "load_copy_s"):
        out[k] = statistics.median(res[k])
    out["store_gbps"] = out["store_bytes"] / out["store_s"] / 1e9
    out["store_copy_gbps"] = out["store_bytes"] / out["store_copy_s"] / 1e9
    out["load_gbps"] = out["load_bytes"] / out["load_s"] / 1e9
    out["load_copy_gbps"] = out["load_bytes"] / out["load_copy_s"] / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3.6-27b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--formats", default="shm,raw,pickle,torch_save")
    p.add_argument("--engines", default="kernel,dma")
    p.add_argument("--streams", default="single,per_group")
    p.add_argument("--policies", default="boundary,all")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="legacy formats: one configuration only")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = "cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device)
    layout = preset_layout(a.preset, a.tp)
    ct = layout.default_chunk_tokens()
    chunk_bytes = layout.chunk_bytes(ct)
    cal = calibrate(device)
    print(json.dumps({"what": "ceiling", "device": cal.device, "method": cal.method,
                      "d2h_gbps": cal.d2h_peak_gbps, "h2d_gbps": cal.h2d_peak_gbps}), flush=True)
    blocks_per_chunk = max(ct // g.block_tokens for g in layout.groups)
    num_blocks = 2 * a.chunks * blocks_per_chunk * len(layout.groups) + 8
    pools = vllm_pools(layout, num_blocks, device)
    fill_random(pools, 1)
    alloc = BlockAllocator(num_blocks)
    sock = tempfile.mkdtemp(prefix="hkv-bench-", dir="/tmp")
    l1_gib = 1.3 * a.chunks * chunk_bytes / 2**30 + 0.1
    formats = a.formats.split(",")
    # zero-copy formats first: the server is probed before a legacy or cuda_ipc case loads torch/CUDA into it
    formats.sort(key=lambda f: (f in ("pickle", "torch_save", "cuda_ipc"), f == "cuda_ipc"))
    flags = ("--cuda-ipc",) if "cuda_ipc" in formats else ()
    server = start_server(f"ipc://{sock}/s.sock", *flags, l1_gib=l1_gib, stderr=sys.stderr)
    rows, samples = [], {}
    try:
        axes = itertools.product(formats, a.engines.split(","), a.streams.split(","), a.policies.split(","))
        for i, (fmt, eng, streams, pol) in enumerate(axes):
            legacy = fmt in ("pickle", "torch_save")
            if (legacy or fmt == "cuda_ipc") and "zero_copy" not in samples:
                samples["zero_copy"] = sample_server(server.pid).metrics()
            if fmt == "cuda_ipc" and "legacy" not in samples:
                samples["legacy"] = sample_server(server.pid).metrics()
            if fmt == "cuda_ipc" and (eng, streams) != ("kernel", "single"):
                continue  # the server does the copies: the engine's copy engine and streams do not apply
            if a.quick and legacy and (eng, streams, pol) != ("kernel", "single", "boundary"):
                continue
            cfg = TransferConfig(wire_format=fmt, copy_engine=eng, streams=streams, retrieve_policy=pol,
                                 store_policy=pol, salt=f"bench-{i}", timeout_s=600)
            t = time.perf_counter()
            r = run_case(server.endpoint, layout, pools, alloc, cfg, a.chunks, 1 if legacy else a.reps, i)
            r.update(format=fmt, engine=eng, streams=streams, policy=pol, wall_s=time.perf_counter() - t,
                     store_ratio=r["store_gbps"] / cal.d2h_peak_gbps, load_ratio=r["load_gbps"] / cal.h2d_peak_gbps)
            rows.append(r)
            print(json.dumps({"what": "case", **r}), flush=True)
        samples["end"] = sample_server(server.pid).metrics()
        print(json.dumps({"what": "server", **samples}), flush=True)
    finally:
        server.stop()
        server.close()
    print(f"\n{a.preset} TP{a.tp}, {a.chunks} chunks of {ct} tokens ({chunk_bytes / 1e6:.1f} MB each), "
          f"device {device}; ceiling D2H {cal.d2h_peak_gbps:.1f} GB/s, H2D {cal.h2d_peak_gbps:.1f} GB/s ({cal.method})")
    print(f"{'format':10} {'engine':6} {'streams':9} {'policy':8} {'store GB/s':>10} {'ratio':>6} {'copy':>6} "
          f"{'load GB/s':>10} {'ratio':>6} {'copy':>6} {'lookup ms':>9} {'bad':>4}")
    for r in rows:
        print(f"{r['format']:10} {r['engine']:6} {r['streams']:9} {r['policy']:8} {r['store_gbps']:10.2f} "
              f"{r['store_ratio']:6.2f} {r['store_copy_gbps']:6.1f} {r['load_gbps']:10.2f} {r['load_ratio']:6.2f} "
              f"{r['load_copy_gbps']:6.1f} {r['lookup_s'] * 1e3:9.2f} {r['bad_pages']:4d}")
    for k, v in samples.items():
        print(f"server after {k} cases: {v}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"preset": a.preset, "tp": a.tp, "chunks": a.chunks, "device": device,
                       "calibration": {"d2h_gbps": cal.d2h_peak_gbps, "h2d_gbps": cal.h2d_peak_gbps,
                                       "method": cal.method, "device": cal.device},
                       "server": samples, "cases": rows}, f, indent=1)
    return 1 if any(r["bad_pages"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
