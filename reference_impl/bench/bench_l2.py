"""L2 spill and reload through the server's filesystem adapter, against the disk's own sequential
throughput measured in the same run (dd with O_DIRECT on the same filesystem).

The server gets a small L1 and an L2 directory with --l2-fsync (so a spill is done only when the disk
has it, not when the page cache has it). The engine stores more than L1 holds: LRU eviction spills the
oldest objects. Then the page cache is dropped (when permitted) and the first documents are looked up
again: every object comes back from disk (L2 -> L1 prefetch) before the hit is reported, and is verified.

    python reference_impl/bench/bench_l2.py --l2-dir /tmp/hkv-l2 --docs 8 --chunks 10 --out l2.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from hybridkv import protocol as P
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.presets import preset_layout
from hybridkv.server.launch import start_server
from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

GIB = 1 << 30


def dd_gbps(directory: str, gib: int) -> dict:
    """Sequential O_DIRECT write then read of `gib` GiB in `directory` (the disk's own ceiling)."""
    path = os.path.join(directory, "dd-probe.bin")
    out = {}
    for what, cmd in (("write", f"dd if=/dev/zero of={path} bs=16M count={gib * 64} oflag=direct conv=fsync"),
                      ("read", f"dd if={path} of=/dev/null bs=16M iflag=direct")):
        t = time.perf_counter()
        r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
        dt = time.perf_counter() - t
        if r.returncode:
            raise RuntimeError(f"{cmd}: {r.stderr.strip()}")
        out[f"disk_{what}_gbps"] = gib * GIB / dt / 1e9
    os.unlink(path)
    return out


def drop_page_cache() -> bool:
    """Drop the page cache so reloads come from the disk; needs root (returns False without)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def stats(kv: KVTransfer) -> dict:
    return kv.client.call(P.Stats())[0].counters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3.6-27b")
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--chunks", type=int, default=10, help="chunks per document")
    p.add_argument("--l1-gib", type=float, default=0.0, help="L1 of the reloading server; default: a third of "
                   "what is stored")
    p.add_argument("--l2-dir", default=None, help="default: a temp dir under /tmp (say which disk it is)")
    p.add_argument("--dd-gib", type=int, default=4)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = "cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device)
    layout = preset_layout(a.preset)
    ct = layout.default_chunk_tokens()
    doc_bytes = a.chunks * layout.chunk_bytes(ct)
    total = a.docs * doc_bytes
    l1_gib = a.l1_gib or max(total / 3 / GIB, 2 * doc_bytes / GIB)
    l2_dir = a.l2_dir or tempfile.mkdtemp(prefix="hkv-l2-", dir="/tmp")
    os.makedirs(l2_dir, exist_ok=True)
    disk = subprocess.run(["df", "-h", l2_dir], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    ceiling = dd_gbps(l2_dir, a.dd_gib)
    print(json.dumps({"what": "disk", "df": disk, **ceiling}), flush=True)

    sock = tempfile.mkdtemp(prefix="hkv-l2b-", dir="/tmp")
    l2 = os.path.join(l2_dir, "l2")
    l2_flags = ("--l2-dir", l2, "--l2-gib", f"{2 * total / GIB:.3f}", "--l2-fsync")
    bpc = [ct // g.block_tokens for g in layout.groups]
    num_blocks = 2 * a.chunks * max(bpc) * len(layout.groups) + 8
    pools = vllm_pools(layout, num_blocks, device)
    fill_random(pools, 1)
    alloc = BlockAllocator(num_blocks)
    src = [alloc.allocate(a.chunks * b) for b in bpc]
    dst = [alloc.allocate(a.chunks * b) for b in bpc]
    result: dict = {"preset": a.preset, "docs": a.docs, "chunks": a.chunks, "stored_bytes": total,
                    "l1_gib": l1_gib, "l2_dir": l2_dir, "df": disk, **ceiling}
    cfg = TransferConfig(wire_format="shm", store_policy="all", retrieve_policy="all", timeout_s=600)
    docs = [np.random.default_rng(d).integers(0, 150_000, a.chunks * ct) for d in range(a.docs)]
    # 1. Spill: a server whose L1 holds everything stores the documents, then flushes every object to L2
    #    on SIGTERM (--flush-on-exit, --l2-fsync): bytes over the flush time is the L2 write path.
    server = start_server(f"ipc://{sock}/a.sock", *l2_flags, "--admin", "--flush-on-exit", "--spill-watermark", "0",
                          l1_gib=1.2 * total / GIB + 0.1, client_timeout=120, stderr=sys.stderr)
    try:
        with KVTransfer(server.endpoint, layout, pools, cfg) as kv:
            for d, tokens in enumerate(docs):
                # a real engine rewrites its pages per document; here the same pages under new keys
                kv.store(f"d{d}", tokens, src).wait_committed(600)
            stored = stats(kv)["bytes_committed"]
        t0 = time.perf_counter()
        rc = server.stop(timeout=600)
        flush_s = time.perf_counter() - t0
    finally:
        server.close()
    if rc != 0:
        raise RuntimeError(f"server exited with {rc} while flushing to L2")
    files = sum(len(f) for _, _, f in os.walk(l2))
    result.update(spill_bytes=stored, spill_s=flush_s, spill_gbps=stored / flush_s / 1e9, l2_files=files)
    # 2. Reload: drop the page cache, start a server with a small L1 on the same directory (index rebuilt
    #    from the files) and look every document up: each object is read from disk before the hit is given.
    dropped = drop_page_cache()
    server = start_server(f"ipc://{sock}/b.sock", *l2_flags, "--admin", l1_gib=l1_gib, client_timeout=120,
                          stderr=sys.stderr)
    bad, lookup_s = 0, 0.0
    try:
        with KVTransfer(server.endpoint, layout, pools, cfg) as kv:
            for d in range(a.docs):
                t = time.perf_counter()
                hit = kv.lookup(f"r{d}", docs[d])
                lookup_s += time.perf_counter() - t
                if hit.hit_chunks != a.chunks:
                    raise RuntimeError(f"document {d}: hit {hit.hit_chunks} of {a.chunks} chunks after restart")
                kv.retrieve(hit, dst).wait(600)
                for g in range(len(layout.groups)):
                    for t_ in pools[g]:
                        bad += int((t_[src[g]] != t_[dst[g]]).any(dim=1).sum())
                kv.end_session(f"r{d}")
            reloaded = stats(kv)["l2_prefetch_bytes"]
    finally:
        server.stop()
        server.close()
        shutil.rmtree(l2, ignore_errors=True)
    result.update(page_cache_dropped=dropped, reload_bytes=reloaded, reload_lookup_s=lookup_s,
                  reload_gbps=reloaded / lookup_s / 1e9 if lookup_s else None, bad_pages=bad)
    result["spill_ratio"] = result["spill_gbps"] / result["disk_write_gbps"]
    if result.get("reload_gbps"):
        result["reload_ratio"] = result["reload_gbps"] / result["disk_read_gbps"]
    print(json.dumps({"what": "l2", **result}), flush=True)
    print(f"\nL2 on {disk}\n  disk (dd O_DIRECT, {a.dd_gib} GiB): write {result['disk_write_gbps']:.2f} GB/s, "
          f"read {result['disk_read_gbps']:.2f} GB/s")
    print(f"  spill (flush on exit, fsync'd, {result['spill_bytes'] / 1e9:.1f} GB): {result['spill_gbps']:.2f} GB/s = "
          f"{result['spill_ratio']:.2f} of disk write")
    print(f"  reload ({reloaded / 1e9:.1f} GB, page cache dropped: {result['page_cache_dropped']}): "
          f"{result.get('reload_gbps') or 0:.2f} GB/s = {result.get('reload_ratio', 0):.2f} of disk read; "
          f"bad pages {result['bad_pages']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if result["bad_pages"] else 0


if __name__ == "__main__":
    sys.exit(main())
