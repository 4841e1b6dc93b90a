"""Storage ceilings, measured in the same run as the L2 rates they bound.

- `disk_ceiling`: sequential O_DIRECT write (then fsync) and read of one file in the L2's own directory,
  in 16 MiB requests (or `block` bytes: the L2 workload also probes at its object size, the size of
  the L2's own requests), with one writer and with several (the L2 spills on several I/O threads);
  the better of the two is the disk's rate.
- `redis_ceiling`: large SET and GET of distinct keys on the same Redis the L2 uses, through the same
  client library, from one client and from several at once.
Nothing here imports torch.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 1 << 20
_BLOCK = 16 * MIB


class StorageProbeError(RuntimeError):
    """A ceiling that cannot be measured here; the message says why."""


@dataclass(frozen=True, slots=True)
class DiskCeiling:
    disk_write_gbps: float
    disk_read_gbps: float
    write_gbps_by_threads: dict[int, float]
    read_gbps_by_threads: dict[int, float]
    probe_bytes: int
    direct_io: bool
    page_cache_dropped: bool
    block_bytes: int = _BLOCK

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RedisCeiling:
    redis_set_gbps: float            # the best of one client and several
    redis_get_gbps: float
    set_gbps_by_clients: dict[int, float]
    get_gbps_by_clients: dict[int, float]
    value_bytes: int
    probe_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def drop_page_cache() -> bool:
    """Drop the page cache so reads come from the disk; needs root (False without)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_ceiling(directory: str | Path, nbytes: int = 1 << 30, threads: tuple[int, ...] = (1, 4),
                 block: int = _BLOCK) -> DiskCeiling:
    """O_DIRECT sequential write + fsync, then read, of `nbytes` in `directory` in `block`-byte
    requests (a multiple of 4096), per thread count."""
    if block <= 0 or block % 4096:
        raise StorageProbeError(f"probe block must be a positive multiple of 4096 bytes, got {block}")
    nbytes = max(block, nbytes - nbytes % block)
    path = Path(directory) / f".disk-probe-{uuid.uuid4().hex[:8]}"
    direct = getattr(os, "O_DIRECT", 0)
    writes: dict[int, float] = {}
    reads: dict[int, float] = {}
    dropped = False
    try:
        for n in threads:
            writes[n] = _timed(path, nbytes, n, os.O_WRONLY | os.O_CREAT | direct, write=True, block=block)
            dropped = drop_page_cache()
            reads[n] = _timed(path, nbytes, n, os.O_RDONLY | direct, write=False, block=block)
    except OSError as e:
        if direct and e.errno == 22:  # EINVAL: this file system takes no O_DIRECT (tmpfs, some FUSE)
            raise StorageProbeError(f"{directory} does not take O_DIRECT ({e}): no disk ceiling there") from e
        raise StorageProbeError(f"disk probe in {directory} failed: {e}") from e
    finally:
        path.unlink(missing_ok=True)
    return DiskCeiling(max(writes.values()), max(reads.values()), writes, reads, nbytes, bool(direct), dropped, block)


def _timed(path: Path, nbytes: int, threads: int, flags: int, write: bool, block: int = _BLOCK) -> float:
    """GB/s of moving `nbytes` through `path` in `block`-byte requests on `threads` threads (interleaved)."""
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    blocks = nbytes // block
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
        view = memoryview(buf)
        if write:
            view[:] = os.urandom(4096) * (block // 4096)
        try:
            for b in range(i, blocks, threads):
                done = os.pwrite(fd, view, b * block) if write else os.preadv(fd, [view], b * block)
                if done != block:
                    raise OSError(5, f"short {'write' if write else 'read'} of {done} B at block {b}")
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            errors.append(e)
        finally:
            view.release()
            buf.close()

    try:
        t = time.perf_counter()
        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        if write:
            os.fsync(fd)
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return nbytes / dt / 1e9


def redis_ceiling(url: str, nbytes: int = 512 * MIB, value_bytes: int = 8 * MIB,
                  clients: tuple[int, ...] = (1, 4)) -> RedisCeiling:
    """SET then GET `nbytes` in values of `value_bytes` on distinct keys, per number of clients."""
    import redis

    count = max(1, nbytes // value_bytes)
    value = os.urandom(MIB) * (value_bytes // MIB) + os.urandom(value_bytes % MIB)
    prefix = f"hkv-probe-{uuid.uuid4().hex[:8]}:"
    sets: dict[int, float] = {}
    gets: dict[int, float] = {}
    admin = redis.Redis.from_url(url, socket_timeout=60)
    try:
        admin.ping()
    except redis.RedisError as e:
        raise StorageProbeError(f"Redis {url} does not answer: {e}") from e
    try:
        for n in clients:
            sets[n] = _redis_timed(url, prefix, count, n, value, write=True)
            gets[n] = _redis_timed(url, prefix, count, n, value, write=False)
            admin.delete(*[f"{prefix}{i}" for i in range(count)])
    finally:
        keys = list(admin.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            admin.delete(*keys)
        admin.close()
    return RedisCeiling(max(sets.values()), max(gets.values()), sets, gets, value_bytes, count * value_bytes)


def _redis_timed(url: str, prefix: str, count: int, clients: int, value: bytes, write: bool) -> float:
    import redis

    conns = [redis.Redis.from_url(url, socket_timeout=60) for _ in range(clients)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        r = conns[i]
        try:
            for k in range(i, count, clients):
                if write:
                    r.set(f"{prefix}{k}", value)
                elif len(r.get(f"{prefix}{k}") or b"") != len(value):
                    raise StorageProbeError(f"Redis lost probe key {prefix}{k} (maxmemory too small?)")
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    for r in conns:
        r.ping()  # connect before the clock starts
    t = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    dt = time.perf_counter() - t
    for r in conns:
        r.close()
    if errors:
        raise errors[0]
    return count * len(value) / dt / 1e9
