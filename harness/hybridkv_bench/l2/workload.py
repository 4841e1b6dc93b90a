"""The L2 workload: spill to L2 and reload from it, beside the storage's own ceiling measured in the same run.

`hybridkv l2bench FILE` (FILE: a TOML under scenarios/l2/). One host (engine + `hybridkv serve`)
stores `docs` documents with every group's objects into an L1 that holds them all, then stops its
server with --flush-on-exit: every object is written to L2 on the server's I/O threads, and bytes over
that time is the spill rate. A second server with its own arena and L1 then looks every document up
(the page cache dropped first when permitted): each object comes back from L2 into L1 before the hit
is given, and bytes over the lookups is the reload rate; every page retrieved is compared with the
one stored. With a filesystem L2 the second server is a restart on the same directory; with Redis it
is another host sharing the store, so the hit is a cross-host hit. The workload file is `l2.spec`'s; the L2,
its ceilings (the disk's O_DIRECT write and read in the L2 directory, or the Redis's SET and GET through the
client) and the adapter's own rates are `l2.target`'s; this module runs the two hosts and sums them up.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hybridkv_bench.calibration.storage import MIB, drop_page_cache
from hybridkv_bench.l2.spec import GIB, L2Bench, L2BenchError, load_l2_bench
from hybridkv_bench.l2.target import RedisServer, Target, l2_target
from hybridkv_bench.l2.watch import DirWatch, Watch, redis_counter


@dataclass
class _Rig:
    """The engine side of both hosts: pools, the source and destination blocks, the documents' tokens."""

    layout: Any
    pools: Any
    bpc: list[int]
    src: list[list[int]]
    dst: list[list[int]]
    cfg: Any
    docs: list
    logs: Path
    server: Any  # hybridkv.server.books.config.ServerConfig: both hosts' settings, less their endpoint and L1 size
    work: Path
    total: int


def _spill(b: L2Bench, rig: _Rig, target: Target, result: dict) -> None:
    """Host A stores everything in an L1 that holds it, then flushes every object on SIGTERM."""
    from hybridkv.engine.transfer import KVTransfer
    from hybridkv.server.front.launch import start_server
    from hybridkv.wire import protocol as P

    layout, pools, cfg, src, docs, logs, work = rig.layout, rig.pools, rig.cfg, rig.src, rig.docs, rig.logs, rig.work
    with open(logs / "a.log", "w") as log:  # an L1 that holds everything (the shared settings'), flushed on exit
        a = start_server(replace(rig.server, endpoint=f"ipc://{work}/a.sock", flush_on_exit=True,
                                 spill_watermark=0.0), stderr=log)
    try:
        with KVTransfer(a.endpoint, layout, pools, cfg) as kv:
            for d, tokens in enumerate(docs):
                kv.store(f"d{d}", tokens, src).wait_committed(600)
            stored = kv.client.call(P.Stats())[0].counters["bytes_committed"]
        objects = b.docs * b.chunks * len(layout.groups)
        watch = (DirWatch(target.l2_dir, objects) if b.l2 == "fs"
                 else Watch(redis_counter(target.url, target.prefix), objects))
        t0 = time.perf_counter()
        rc = a.stop(timeout=600)
        exit_s = time.perf_counter() - t0
        spill_s = watch.done_at(t0)
    finally:
        a.close()
    if rc != 0:
        raise L2BenchError(f"server A exited with {rc} while flushing to L2 (see {logs / 'a.log'})")
    if spill_s is None:
        raise L2BenchError(f"only {watch.seen} of {objects} objects reached L2 when server A exited")
    result.update(spill_bytes=stored, spill_s=spill_s, l2_spill_gbps=stored / spill_s / 1e9,
                  spill_with_exit_s=exit_s, l2_spill_with_exit_gbps=stored / exit_s / 1e9)


def _reload(b: L2Bench, rig: _Rig, result: dict) -> None:
    """Host B (own arena, an L1 of a third) looks every document up; every page is verified."""
    from hybridkv.engine.transfer import KVTransfer
    from hybridkv.server.front.launch import start_server
    from hybridkv.wire import protocol as P

    layout, pools, cfg, bpc, src, dst, docs, logs, work, total = (
        rig.layout, rig.pools, rig.cfg, rig.bpc, rig.src, rig.dst, rig.docs, rig.logs, rig.work, rig.total)
    result["page_cache_dropped"] = drop_page_cache() if b.l2 == "fs" else False
    l1_b = int((max(total / 3, 2 * total / b.docs) / GIB + 0.05) * GIB)
    with open(logs / "b.log", "w") as log:
        bsrv = start_server(replace(rig.server, endpoint=f"ipc://{work}/b.sock", l1_bytes=l1_b), stderr=log)
    bad = hit_chunks = 0
    lookup_s = 0.0
    try:
        with KVTransfer(bsrv.endpoint, layout, pools, cfg) as kv:
            for d, tokens in enumerate(docs):
                t = time.perf_counter()
                hit = kv.lookup(f"r{d}", tokens)
                lookup_s += time.perf_counter() - t
                hit_chunks += hit.hit_chunks
                if hit.hit_chunks:
                    kv.retrieve(hit, dst).wait(600)
                for g in range(len(layout.groups)):
                    n = hit.hit_chunks * bpc[g]
                    for t_ in pools[g]:
                        bad += int((t_[src[g][:n]] != t_[dst[g][:n]]).any(dim=1).sum())
                kv.end_session(f"r{d}")
            reloaded = kv.client.call(P.Stats())[0].counters["l2_prefetch_bytes"]
    finally:
        bsrv.stop()
        bsrv.close()
    result["load_avg_1m_at_end"] = os.getloadavg()[0]
    result.update(reload_bytes=reloaded, reload_s=lookup_s,
                  l2_reload_gbps=reloaded / lookup_s / 1e9 if lookup_s else 0.0,
                  hit_chunks=hit_chunks, expected_hit_chunks=b.docs * b.chunks, corrupt_pages=bad)
    if b.l2 == "fs":
        result["spill_ceiling_ratio"] = result["l2_spill_gbps"] / result["disk_write_gbps"]
        result["reload_ceiling_ratio"] = result["l2_reload_gbps"] / result["disk_read_gbps"]
    else:
        result["spill_ceiling_ratio"] = result["l2_spill_gbps"] / result["redis_set_gbps"]
        result["reload_ceiling_ratio"] = result["l2_reload_gbps"] / result["redis_get_gbps"]
        result["cross_host_hit"] = hit_chunks == b.docs * b.chunks


def run_l2_bench(b: L2Bench, out: Path) -> dict:
    """Run the workload into `out` (l2.json, server logs); returns the result, ceilings included."""
    import numpy as np
    import torch
    from hybridkv.engine.transfer import TransferConfig
    from hybridkv.model.presets import preset_layout
    from hybridkv.server.books.config import ServerConfig
    from hybridkv.server.l2.header import CRC32_IMPL
    from hybridkv.wire.wire_formats import DEFAULT_FORMAT

    from hybridkv_bench.pools import BlockAllocator, fill_random, vllm_pools

    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if b.device == "auto" and torch.cuda.is_available() else ("cpu" if b.device == "auto" else b.device)
    layout = preset_layout(b.preset)
    ct = layout.default_chunk_tokens()
    total = b.docs * b.chunks * layout.chunk_bytes(ct)
    work = Path(tempfile.mkdtemp(prefix="hkv-l2w-", dir="/tmp"))
    redis_srvs: list[RedisServer] = []
    shm_dirs: list[Path] = []
    result: dict = {"name": b.name, "l2": b.l2, "preset": b.preset, "docs": b.docs, "chunks": b.chunks,
                    "stored_bytes": total, "device": device, "io_threads": b.io_threads,
                    "cpus": os.cpu_count(), "load_avg_1m_at_start": os.getloadavg()[0], "crc32_impl": CRC32_IMPL}
    object_bytes = layout.chunk_bytes(ct) // len(layout.groups)
    adapter_count = max(4, min(b.docs * b.chunks * len(layout.groups), (b.probe_mib * MIB) // object_bytes))
    try:
        target = l2_target(b, work, total, object_bytes, adapter_count, result, redis_srvs)
        # Each run's arenas in a private folder of /dev/shm: nothing else sweeping /dev/shm touches them.
        shm = Path(tempfile.mkdtemp(prefix="hkv-l2w-", dir="/dev/shm"))
        shm_dirs.append(shm)
        # host A's settings: an L1 that holds every document; host B's differ in endpoint and L1 size
        server = ServerConfig(endpoint="", l1_bytes=int((1.2 * total / GIB + 0.05) * GIB), l2=target.spec,
                              io_threads=b.io_threads, l1_dir=str(shm), admin=True, client_timeout_s=120)

        bpc = [ct // g.block_tokens for g in layout.groups]
        num_blocks = 2 * b.chunks * sum(bpc) + 8  # a block id belongs to one group at a time
        pools = vllm_pools(layout, num_blocks, device)
        fill_random(pools, 1)
        alloc = BlockAllocator(num_blocks)
        src = [alloc.allocate(b.chunks * n) for n in bpc]
        dst = [alloc.allocate(b.chunks * n) for n in bpc]
        cfg = TransferConfig(wire_format=DEFAULT_FORMAT, store_policy="all", retrieve_policy="all", timeout_s=600)
        docs = [np.random.default_rng([7, d]).integers(0, 150_000, b.chunks * ct) for d in range(b.docs)]
        logs = out / "server-logs"
        logs.mkdir(exist_ok=True)
        rig = _Rig(layout, pools, bpc, src, dst, cfg, docs, logs, server, work, total)
        _spill(b, rig, target, result)
        _reload(b, rig, result)
    finally:
        for srv in redis_srvs:
            srv.close()
        for tmp in [work, *shm_dirs]:
            shutil.rmtree(tmp, ignore_errors=True)
    (out / "l2.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary(r: dict) -> str:
    """The figures beside their same-run ceilings, in a few lines."""
    if r["l2"] == "fs":
        ceil_w, ceil_r, what = r["disk_write_gbps"], r["disk_read_gbps"], f"disk O_DIRECT at {r['l2_where']}"
    else:
        ceil_w, ceil_r, what = r["redis_set_gbps"], r["redis_get_gbps"], f"Redis SET/GET at {r['l2_where']}"
    return (f"{r['name']}: {r['stored_bytes'] / 1e9:.2f} GB in {r['docs']} documents ({r['preset']})\n"
            f"  ceiling ({what}): write {ceil_w:.2f} GB/s, read {ceil_r:.2f} GB/s{_blocks(r)}\n"
            f"  L2 spill  {r['l2_spill_gbps']:.2f} GB/s = {r['spill_ceiling_ratio']:.2f} of the write ceiling "
            f"({r['l2_spill_with_exit_gbps']:.2f} GB/s counting the server's exit)\n"
            f"  L2 reload {r['l2_reload_gbps']:.2f} GB/s = {r['reload_ceiling_ratio']:.2f} of the read ceiling "
            f"(page cache dropped: {r['page_cache_dropped']})\n"
            f"  the adapter alone (in process, {r['io_threads']} threads): put {r['adapter_put_gbps']:.2f} GB/s, "
            f"get {r['adapter_get_gbps']:.2f} GB/s; load average {r['load_avg_1m_at_start']:.1f} on {r['cpus']} CPUs; "
            f"CRC-32 by {r.get('crc32_impl', '?')}\n"
            f"  hit {r['hit_chunks']} of {r['expected_hit_chunks']} chunks"
            f"{' through a second server (cross-host)' if r['l2'] == 'redis' else ' after a restart'}; "
            f"corrupt pages {r['corrupt_pages']}")


def _blocks(r: dict) -> str:
    if "disk_object_write_gbps" not in r:
        return ""
    return (f" (the better of 16 MiB requests: {r['disk_16mib_write_gbps']:.2f} / {r['disk_16mib_read_gbps']:.2f}, "
            f"and {r['disk_object_block_bytes'] / 1e6:.1f} MB object-size ones: {r['disk_object_write_gbps']:.2f} / "
            f"{r['disk_object_read_gbps']:.2f})")


def main(path: str, out: str | None = None, scale: float = 1.0) -> int:
    b = load_l2_bench(path, scale)
    folder = Path(out or f"results/runs/{b.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    r = run_l2_bench(b, folder)
    print(summary(r))
    print(f"run folder: {folder}")
    return 1 if r["corrupt_pages"] or r["hit_chunks"] != r["expected_hit_chunks"] else 0
