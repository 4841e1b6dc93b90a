"""Where an L2 workload's L2 lives, and what it can do on its own: a directory on the disk under test or a Redis
(the given one, or a redis-server started for the run), the storage's ceilings measured there (the disk's O_DIRECT
rates, Redis SET and GET), and the adapter's own put and get rates in this process, without a server around it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv_bench.calibration.storage import MIB, disk_ceiling, drop_page_cache, redis_ceiling
from hybridkv_bench.l2.spec import GIB, L2Bench, L2BenchError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
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
class Target:
    """Where the workload's L2 lives: its directory (fs) or store (redis), and the server's spec of it."""

    l2_dir: Path
    url: str
    prefix: str
    spec: Any  # hybridkv.server.l2.specs.L2Spec


def l2_target(b: L2Bench, work: Path, total: int, object_bytes: int, adapter_count: int, result: dict,
               started: list[RedisServer]) -> Target:
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
        return Target(l2_dir, "", "", FsL2Spec(str(l2_dir), int((2 * total / GIB + 0.01) * GIB), b.fsync))
    target = Target(work, b.redis_url, f"hkv-l2bench-{os.getpid()}-{int(time.time())}:", None)
    if not target.url:
        started.append(srv := RedisServer(2 * total + 2 * b.probe_mib * MIB + 256 * MIB, work))
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
