"""The L2 workload: spill to L2 and reload from it, beside the storage's own ceiling measured in the same run.

`hybridkv l2bench FILE` (FILE: a TOML under scenarios/l2/). One host (engine + `hybridkv serve`)
stores `docs` documents with every group's objects into an L1 that holds them all, then stops its
server with --flush-on-exit: every object is written to L2 on the server's I/O threads, and bytes over
that time is the spill rate. A second server with its own arena and L1 then looks every document up
(the page cache dropped first when permitted): each object comes back from L2 into L1 before the hit
is given, and bytes over the lookups is the reload rate; every page retrieved is compared with the
one stored. With a filesystem L2 the second server is a restart on the same directory; with Redis it
is another host sharing the store, so the hit is a cross-host hit. Ceilings (`calibration.storage`):
the disk's O_DIRECT write and read in the L2 directory, or the Redis's SET and GET through the client.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import msgspec

from hybridkv_bench.calibration.storage import MIB, disk_ceiling, drop_page_cache, redis_ceiling
from hybridkv_bench.l2.watch import DirWatch, Watch, redis_counter

GIB = 1 << 30


class L2BenchError(RuntimeError):
    """The workload could not run or its bytes did not verify; the message says which."""


class L2Bench(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One L2 workload, strictly decoded from TOML."""

    name: str
    description: str = ""
    l2: Literal["fs", "redis"]
    preset: str = "qwen3.6-27b-4layers"
    docs: int = 8
    chunks: int = 4                       # chunks per document
    device: Literal["auto", "cpu", "cuda"] = "auto"
    l2_dir: str = ""                      # fs: where the L2 lives ("" = a temp dir under /tmp)
    fsync: bool = True                    # fs: a spill is done when the disk has it
    redis_url: str = ""                   # redis: "" = start a redis-server on loopback for the run
    redis_chunk_mib: int = 8
    io_threads: int = 4
    probe_mib: int = 1024                 # bytes moved by each ceiling probe

    def __post_init__(self) -> None:
        for f in ("docs", "chunks", "io_threads", "probe_mib", "redis_chunk_mib"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.l2 == "fs" and self.redis_url:
            raise ValueError("redis_url is for l2 = \"redis\"")


def load_l2_bench(path: str | Path, scale: float = 1.0) -> L2Bench:
    """Decode an L2 workload file; `scale` in (0, 1] shrinks documents and probes (a quick run)."""
    import tomllib

    try:
        b = msgspec.convert(tomllib.loads(Path(path).read_text()), L2Bench)
    except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError, ValueError) as e:
        raise L2BenchError(f"{path}: {e}") from None
    if not 0 < scale <= 1:
        raise L2BenchError(f"scale must be in (0, 1], got {scale}")
    if scale < 1:
        b = msgspec.structs.replace(b, docs=max(2, round(b.docs * scale)),
                                    probe_mib=max(64, round(b.probe_mib * scale)))
    return b


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _RedisServer:
    """A redis-server for the run: loopback, a random port, no persistence, allkeys-lru."""

    def __init__(self, maxmemory: int, workdir: Path) -> None:
        exe = shutil.which("redis-server") or shutil.which("valkey-server")
        if exe is None:
            raise L2BenchError("no redis-server or valkey-server on PATH (apt-get install -y redis-server), "
                               "or set redis_url to a running one")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise L2BenchError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def adapter_rates(adapter, object_bytes: int, count: int, threads: int) -> dict:
    """put and get_into GB/s of the adapter alone, in this process, from page-aligned memory on
    `threads` threads: the L2 path without the server around it, to tell its cost from the server's."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    slot = -(-object_bytes // 4096) * 4096
    mem = mmap.mmap(-1, slot * threads)
    view = memoryview(mem)
    view[:] = os.urandom(MIB) * (len(mem) // MIB) + os.urandom(len(mem) % MIB)
    keys = [os.urandom(16) for _ in range(count)]
    ns = b"l2bench-adapter!"

    def region(i: int) -> memoryview:
        t = i % threads
        return view[t * slot:t * slot + object_bytes]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda i: adapter.put(keys[i], 0, ns, region(i)), range(count)))
    put_s = time.perf_counter() - t0
    dropped = drop_page_cache()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        ok = list(ex.map(lambda i: adapter.get_into(keys[i], 0, region(i)), range(count)))
    get_s = time.perf_counter() - t0
    for k in keys:
        adapter.remove(k, 0)
    view.release()
    mem.close()
    if not all(ok):
        raise L2BenchError(f"the adapter lost {ok.count(False)} of {count} objects it had just stored")
    return {"adapter_put_gbps": count * object_bytes / put_s / 1e9,
            "adapter_get_gbps": count * object_bytes / get_s / 1e9, "adapter_page_cache_dropped": dropped}


def _disk_ceilings(l2_dir: Path, nbytes: int, object_bytes: int) -> dict:
    """The disk's O_DIRECT rates in 16 MiB requests and in requests of the L2's object size (what a
    spill or a reload of one object asks of the disk); the ceiling is the better of the two."""
    big = disk_ceiling(l2_dir, nbytes)
    obj = disk_ceiling(l2_dir, nbytes, block=max(4096, object_bytes - object_bytes % 4096))
    return {**big.as_dict(), "disk_write_gbps": max(big.disk_write_gbps, obj.disk_write_gbps),
            "disk_read_gbps": max(big.disk_read_gbps, obj.disk_read_gbps),
            "disk_16mib_write_gbps": big.disk_write_gbps, "disk_16mib_read_gbps": big.disk_read_gbps,
            "disk_object_block_bytes": obj.block_bytes, "disk_object_write_gbps": obj.disk_write_gbps,
            "disk_object_read_gbps": obj.disk_read_gbps}


@dataclass
class _Target:
    """Where the workload's L2 lives: its directory (fs) or store (redis), and the server's spec of it."""

    l2_dir: Path
    url: str
    prefix: str
    spec: Any  # hybridkv.server.l2.specs.L2Spec


def _l2_target(b: L2Bench, work: Path, total: int, object_bytes: int, adapter_count: int, result: dict,
               started: list[_RedisServer]) -> _Target:
    """Make the L2 (a directory, or a Redis: the given one or one started for the run, appended to `started`)
    and measure its ceilings and the adapter's own rates into `result`."""
    if b.l2 == "fs":
        base = Path(b.l2_dir) if b.l2_dir else work
        base.mkdir(parents=True, exist_ok=True)
        l2_dir = Path(tempfile.mkdtemp(prefix="l2-", dir=base))
        df = subprocess.run(["df", "-h", str(l2_dir)], capture_output=True, text=True).stdout.splitlines()[-1:]
        result["l2_where"] = " ".join(df)
        result.update(_disk_ceilings(l2_dir, b.probe_mib * MIB, object_bytes))
        from hybridkv.server.l2.fs import FilesystemL2
        from hybridkv.server.l2.fs_spec import FsL2Spec

        with FilesystemL2(work / "adapter", 4 * adapter_count * object_bytes + GIB, fsync=b.fsync) as fs:
            result.update(adapter_rates(fs, object_bytes, adapter_count, b.io_threads))
        return _Target(l2_dir, "", "", FsL2Spec(str(l2_dir), int((2 * total / GIB + 0.01) * GIB), b.fsync))
    target = _Target(work, b.redis_url, f"hkv-l2bench-{os.getpid()}-{int(time.time())}:", None)
    if not target.url:
        started.append(srv := _RedisServer(2 * total + 2 * b.probe_mib * MIB + 256 * MIB, work))
        target.url = srv.url
    result["l2_where"] = target.url
    result.update(redis_ceiling(target.url, b.probe_mib * MIB).as_dict())
    spec = {"type": "redis", "url": target.url, "prefix": target.prefix, "chunk_mb": b.redis_chunk_mib,
            "timeout_s": 60.0, "meta_timeout_s": 1.0}
    from hybridkv.server.l2.redis import RedisL2
    from hybridkv.server.l2.redis_spec import RedisL2Spec
    from hybridkv.server.l2.specs import parse_l2_adapter

    target.spec = parse_l2_adapter(json.dumps(spec), {})

    rspec = parse_l2_adapter(json.dumps({**spec, "prefix": target.prefix + "adapter:"}), {})
    assert isinstance(rspec, RedisL2Spec)
    with RedisL2(rspec) as rl2:
        result.update(adapter_rates(rl2, object_bytes, adapter_count, b.io_threads))
    return target


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


def _spill(b: L2Bench, rig: _Rig, target: _Target, result: dict) -> None:
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
    redis_srvs: list[_RedisServer] = []
    shm_dirs: list[Path] = []
    result: dict = {"name": b.name, "l2": b.l2, "preset": b.preset, "docs": b.docs, "chunks": b.chunks,
                    "stored_bytes": total, "device": device, "io_threads": b.io_threads,
                    "cpus": os.cpu_count(), "load_avg_1m_at_start": os.getloadavg()[0], "crc32_impl": CRC32_IMPL}
    object_bytes = layout.chunk_bytes(ct) // len(layout.groups)
    adapter_count = max(4, min(b.docs * b.chunks * len(layout.groups), (b.probe_mib * MIB) // object_bytes))
    try:
        target = _l2_target(b, work, total, object_bytes, adapter_count, result, redis_srvs)
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
