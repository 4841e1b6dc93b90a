"""Test helpers: real cache-server processes on private ipc endpoints, and an engine driven by hand."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from hybridkv.engine.client import CacheClient, ServerError
from hybridkv.memory.arena import map_arena
from hybridkv.model.presets import preset_layout
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import ServerProcess, start_server
from hybridkv.wire import protocol as P


def spawn_server(sock_dir: str, *args: str, name: str = "s", l1_gib: float = 0.05,
                 client_timeout: float = 30.0) -> ServerProcess:
    """A server for tests that manage its life themselves (the `server_factory` fixture stops its own)."""
    return start_server(parse([f"--endpoint=ipc://{sock_dir}/{name}.sock", f"--l1-gib={l1_gib}",
                               f"--client-timeout={client_timeout}", *args, "--admin"]))


@contextmanager
def module_server(**kw) -> Iterator[ServerProcess]:
    """A server a module's tests share (its module-scoped `server` fixture), where a fresh process per test is not
    what they check: its --client-timeout outlasts the module, so no reclaim of an earlier test's engine moves a
    counter a later test compares; such tests store fresh keys and compare counters with their values before."""
    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    s = spawn_server(d, **{"client_timeout": 3600.0, **kw})
    try:
        yield s
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)


def alive(endpoint: str) -> bool:
    """A fresh client's Health is answered `ok`: the server still serves."""
    with CacheClient(endpoint, timeout_s=10) as c:
        return c.call(P.Health())[0].status == "ok"


def expect(code: str, fut_or_call) -> ServerError:
    """`fut_or_call()` raises a ServerError of `code`; that error."""
    with pytest.raises(ServerError) as ei:
        fut_or_call()
    assert ei.value.code == code, ei.value
    return ei.value


def counters(client: CacheClient) -> dict:
    """The server's counters (Stats)."""
    return client.call(P.Stats())[0].counters


def settled(client: CacheClient, timeout_s: float = 60.0) -> dict:
    """The server's counters once no worker job is in flight (spills and L2 reads are asynchronous: a test that
    looks at L2 or its counters after a store waits here for them), nothing is parked and no object is unready."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = client.call(P.Stats())[0].counters
        if c["workers_inflight"] == 0 and c["parked"] == 0 and c["l1_unready_objects"] == 0:
            return c
        assert time.monotonic() < deadline, f"still working after {timeout_s} s: {c}"
        time.sleep(0.01)


@contextmanager
def small_tmpfs(parent: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: 2m, 16m) of our own, to fill up for real; skips without the right
    to mount (root)."""
    mnt = parent / f"mnt-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# the tiny hybrid's groups in vLLM's order: its three GDN groups come first (layer 0 is GDN), attention last
ATTN = preset_layout("tiny-hybrid").attention_groups[0]
STATES = tuple(preset_layout("tiny-hybrid").recurrent_groups)


class Engine:
    """The engine side of the shm format, by hand: register, map the arena, write and read slots."""

    def __init__(self, client: CacheClient, layout=None, chunk_tokens: int = 0, tp_rank: int = 0, salt: str = "",
                 name: str = ""):
        self.client = client
        self.layout = layout or preset_layout("tiny-hybrid")
        reg, _ = client.call(P.Register(layout=self.layout, chunk_tokens=chunk_tokens, tp_rank=tp_rank, salt=salt,
                                        name=name))
        self.reg = reg
        self.id = reg.engine
        self.sizes = reg.object_bytes
        self.chunk_tokens = chunk_tokens or self.layout.default_chunk_tokens()
        self.arena = np.frombuffer(map_arena(reg.arena_path, reg.arena_bytes), dtype=np.uint8)

    def keys(self, n: int, seed: int = 0) -> list[bytes]:
        from hybridkv.model.keys import chunk_keys

        tokens = np.random.default_rng(seed).integers(0, 50000, n * self.chunk_tokens)
        return chunk_keys(self.reg.namespace, tokens, self.chunk_tokens)

    @staticmethod
    def payload(key: bytes, group: int, length: int) -> np.ndarray:
        """The bytes a test stores for (key, group), of its length: a hash stream of both for small objects (one
        C call: tests that check every byte of thousands of 4-byte objects spent their time seeding a numpy
        generator per object, ~30 us each), a generator seeded by both for large ones (faster per byte)."""
        if length <= 1 << 12:
            return np.frombuffer(bytearray(hashlib.shake_128(key + group.to_bytes(2, "little")).digest(length)),
                                 dtype=np.uint8)
        seed = int.from_bytes(key[:8], "little") ^ group
        return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8)

    def store(self, keys: list[bytes], objects=None, request: str = "r") -> P.Prepared:
        objects = objects if objects is not None else [
            (c, g) for c in range(len(keys)) for g in range(len(self.layout.groups))]
        prep, _ = self.client.call(P.PrepareStore(engine=self.id, request=request, keys=keys, objects=objects))
        for s in prep.slots:
            self.arena[s.offset:s.offset + s.length] = self.payload(keys[s.chunk], s.group, s.length)
        if prep.reservation:
            self.client.call(P.CommitStore(engine=self.id, reservation=prep.reservation))
        return prep

    def lookup(self, keys, policy="boundary", request="r", skip=0) -> P.LookupResult:
        r, _ = self.client.call(P.Lookup(engine=self.id, request=request, keys=keys, policy=policy,
                                         skip_chunks=skip))
        return r

    def check(self, keys, res: P.LookupResult) -> None:
        for o in res.objects:
            got = self.arena[o.offset:o.offset + o.length]
            assert np.array_equal(got, self.payload(keys[o.chunk], o.group, o.length)), (o.chunk, o.group)


class RawDealer:
    """A bare DEALER socket: sends any frames, returns the decoded reply and its payload frames."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.sock.connect(endpoint)

    def call(self, frames: list) -> tuple[P.Message, list[bytes]]:
        self.sock.send_multipart(frames)
        out = self.sock.recv_multipart()
        return P.decode_reply(out[0]), out[1:]

    def request(self, msg: dict | P.Message, frames: list = ()) -> P.Message:
        data = P.encode(msg) if isinstance(msg, P.Message) else msgspec.msgpack.encode(msg)
        return self.call([data, *frames])[0]

    def close(self) -> None:
        self.sock.close(linger=0)


def process_fds(pid: int) -> int:
    """Files a process holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has used, user and system, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lookup_checked(eng: Engine, keys: list[bytes], want: int, policy: str = "all") -> P.LookupResult:
    """Look up, assert the hit length, verify every byte handed out (every group with `all`), release the lease."""
    res = eng.lookup(keys, policy=policy)
    assert res.hit_chunks == want, (res.hit_chunks, want)
    eng.check(keys, res)
    if res.lease:
        eng.client.call(P.Release(engine=eng.id, lease=res.lease))
    return res
