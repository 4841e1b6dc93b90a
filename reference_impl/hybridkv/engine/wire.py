"""How bytes reach the server, one strategy object per wire format, registered in `WIRES` by name.

A wire is one of two kinds, as `hybridkv.wire.wire_formats.TRAITS` says of its format. A `DirectWire` (`shm`)
answers with `slots` (the server's arena, which the engine's copies reach) and a payload-free `commit`;
the transfer library queues and waits for the copies itself. A `PayloadWire` runs whole stores and loads
(`store`, `load`): `raw` stages in pinned memory and sends zero-copy frames; `pickle` / `torch_save`
serialize as the seed did; `cuda_ipc` lets the server copy the engine's pages itself (LMCache's mode; the
only user of the protocol's `blocks`). `hybridkv.engine.routes` drives each kind.
"""

from __future__ import annotations

import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from hybridkv_kernels import PagedLayers

from hybridkv.baselines.codec import PayloadError, decode_tensor, encode_tensor
from hybridkv.engine.client import CacheClient
from hybridkv.engine.handles import Hit, TransferHandle
from hybridkv.engine.prefault import Prefault
from hybridkv.memory.arena import map_arena
from hybridkv.wire import protocol as P
from hybridkv.wire.wire_formats import FORMATS, TRAITS, WireFormat

ObjectJob = tuple[P.ObjectLoc, np.ndarray]  # an object and the engine blocks (of its group) that hold it
# Runs the page copies of (object, blocks, host bytes) triples and waits for them.
CopyFn = Callable[[list[tuple[P.ObjectLoc, np.ndarray, torch.Tensor]]], None]


class ArenaMapping:
    """The server's L1 arena mapped into this engine; registered as pinned memory on CUDA so the GPU
    reads and writes slots directly (DMA or a kernel through UVA), with no copy by either process.
    Engines of one process share one mapping per arena (`open`): registering tens of GB takes seconds."""

    _shared: ClassVar[dict[tuple[str, int, str], tuple[ArenaMapping, list[int]]]] = {}  # -> (mapping, [users])
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def open(cls, path: str, size: int, device: torch.device) -> ArenaMapping:
        """The process's mapping of arena `path` for `device`, made on first use."""
        key = (path, size, str(device))
        with cls._lock:
            entry = cls._shared.get(key)
            if entry is None:
                entry = cls._shared[key] = (cls(path, size, device), [0])
            entry[1][0] += 1
            return entry[0]

    def release(self) -> None:
        """Drop one user of a shared mapping; the last one unmaps it."""
        with self._lock:
            for key, (mapping, users) in list(self._shared.items()):
                if mapping is self:
                    users[0] -= 1
                    if users[0] == 0:
                        del self._shared[key]
                        self.close()
                    return
        self.close()

    def __init__(self, path: str, size: int, device: torch.device):
        self._mm = map_arena(path, size)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.size = size
        self._registered = False
        self.prefault: Prefault | None = None  # CPU: the page tables filled ahead of the first load (prefault.py)
        if device.type == "cuda":
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the {size} B arena {path} failed with CUDA error {int(rc)}")
            self._registered = True
        else:
            self.prefault = Prefault(self.tensor.data_ptr(), size)

    def slot(self, offset: int, length: int) -> torch.Tensor:
        """The arena bytes of one object slot, as a flat uint8 view."""
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"slot ({offset}, {length}) lies outside the {self.size} B arena")
        return self.tensor[offset:offset + length]

    def close(self) -> None:
        """Unregister and unmap (every view of the arena must be gone)."""
        if self.prefault is not None:
            self.prefault.stop()
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        del self.tensor
        self._mm.close()


class StagingPool:
    """Reusable staging buffers, pinned when the engine is on CUDA (pinning costs far more than copying)."""

    def __init__(self, device: torch.device, keep: int = 4):
        self.pin = device.type == "cuda"
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of exactly `nbytes` (a view of a pooled buffer at least that large)."""
        with self._lock:
            for i, t in enumerate(self._free):
                if t.numel() >= nbytes:
                    return self._free.pop(i)[:nbytes]
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)[:nbytes]

    def put(self, t: torch.Tensor) -> None:
        """Give a buffer from `get` back for reuse."""
        base = t._base if t._base is not None else t
        assert isinstance(base, torch.Tensor)
        with self._lock:
            self._free.append(base)
            self._free.sort(key=torch.Tensor.numel)
            del self._free[:-self.keep]


@dataclass(frozen=True, slots=True)
class WireContext:
    """What a strategy may use of its engine: the connection, the registration and the page views."""

    client: CacheClient
    engine_id: int
    device: torch.device
    groups: Sequence[PagedLayers]
    dtypes: Sequence[str]  # each group's dtype name, for the legacy formats' tensors
    arena_path: str
    arena_bytes: int


class WireStrategy(ABC):
    """One wire format's engine half; a format is either a `DirectWire` or a `PayloadWire`."""

    format: ClassVar[WireFormat]

    def __init__(self, ctx: WireContext):
        self.ctx = ctx

    def close(self) -> None:  # noqa: B027 - a hook: only strategies that hold something override it
        """Give back what the strategy holds (the arena mapping)."""


class DirectWire(WireStrategy):
    """A wire whose objects are host memory the engine's copies reach directly, and whose commit carries no
    payload: the transfer library queues and waits for the copies itself (so its caller may queue them)."""

    @abstractmethod
    def slots(self, jobs: list[ObjectJob]) -> list[tuple[P.ObjectLoc, np.ndarray, torch.Tensor]]:
        """The (object, blocks, host bytes) triples for the objects' locations."""

    fences = False  # whether `fence_word` and `commit_fenced` work (a reservation's fence word is in host memory)

    @abstractmethod
    def commit(self, h: TransferHandle, reservation: int) -> Future:
        """The commit of a reservation whose objects were copied; resolved when answered."""

    def fence_word(self, offset: int) -> torch.Tensor:
        """The 8 host bytes of the fence word at `offset` (`Prepared.fence`)."""
        raise NotImplementedError(f"the {self.format} wire has no fence words")

    def commit_fenced(self, h: TransferHandle, reservation: int) -> Future:
        """The commit of a reservation whose copies and fence are queued, sent now; resolved when answered
        (once the server saw the fence word)."""
        raise NotImplementedError(f"the {self.format} wire has no fenced commit")


class PayloadWire(WireStrategy):
    """A wire that moves objects through the socket: it runs whole stores and loads."""

    @abstractmethod
    def store(self, h: TransferHandle, reservation: int, jobs: list[ObjectJob], copy: CopyFn,
              ready: torch.cuda.Event | None, pages_read: Callable[[], None]) -> Future:
        """Move a reservation's objects and send their commit; call `pages_read` once the engine's pages were
        read. Returns the commit's reply future (the caller resolves the store's `committed` from it)."""

    @abstractmethod
    def load(self, h: TransferHandle, hit: Hit, jobs: list[ObjectJob], copy: CopyFn) -> None:
        """Write a lease's objects into the engine's blocks."""

    def _commit(self, h: TransferHandle, reservation: int, frames: Sequence = (),
                blocks: list[list[int]] | None = None) -> Future:
        msg = P.CommitStore(engine=self.ctx.engine_id, reservation=reservation, format=self.format,
                            blocks=blocks or [])
        h.t_commit_sent = time.perf_counter()
        return self.ctx.client.submit(msg, list(frames))


class ShmWire(DirectWire):
    """The GPU writes and reads the server's arena slots directly; only metadata crosses the socket."""

    format = "shm"

    def __init__(self, ctx: WireContext):
        super().__init__(ctx)
        self.arena = ArenaMapping.open(ctx.arena_path, ctx.arena_bytes, ctx.device)

    def slots(self, jobs: list[ObjectJob]) -> list[tuple[P.ObjectLoc, np.ndarray, torch.Tensor]]:
        return [(o, ids, self.arena.slot(o.offset, o.length)) for o, ids in jobs]

    def commit(self, h: TransferHandle, reservation: int) -> Future:
        # Sent and answered on this thread (the client's call(): it receives its own reply): the server's
        # work is a state change, and a reply handed over by the I/O thread costs more than the round trip.
        h.t_commit_sent = time.perf_counter()
        out: Future = Future()
        try:
            out.set_result(self.ctx.client.call(P.CommitStore(engine=self.ctx.engine_id, reservation=reservation,
                                                              format=self.format)))
        except Exception as e:
            out.set_exception(e)
        return out

    fences = True

    def fence_word(self, offset: int) -> torch.Tensor:
        if offset % 8:
            raise ValueError(f"fence word offset {offset} is not 8-byte aligned")
        return self.arena.slot(offset, 8)

    def commit_fenced(self, h: TransferHandle, reservation: int) -> Future:
        # submit, not call: the caller's thread goes on at once, the answer comes on whichever thread receives
        h.t_commit_sent = time.perf_counter()
        return self.ctx.client.submit(P.CommitStore(engine=self.ctx.engine_id, reservation=reservation,
                                                    format=self.format, fenced=True))

    def close(self) -> None:
        self.arena.release()


class StagedWire(PayloadWire):
    """Gathered into a staging buffer, sent as payload frames; received frames are scattered from."""

    def __init__(self, ctx: WireContext):
        super().__init__(ctx)
        self.staging = StagingPool(ctx.device)

    @abstractmethod
    def encode(self, objs: list[torch.Tensor], dtypes: list[str]) -> list:
        """Payload frames for gathered objects."""

    @abstractmethod
    def decode(self, frames: list, lengths: list[int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Scatter sources for received frames, and the staging buffer to give back (or None)."""

    def store(self, h, reservation, jobs, copy, ready, pages_read) -> Future:
        lengths = [o.length for o, _ in jobs]
        staging = self.staging.get(sum(lengths))
        dsts = list(torch.split(staging, lengths))
        copy([(o, ids, d) for (o, ids), d in zip(jobs, dsts, strict=True)])
        pages_read()
        commit = self._commit(h, reservation, self.encode(dsts, [self.ctx.dtypes[o.group] for o, _ in jobs]))

        def reuse(f: Future) -> None:
            # Only after the reply: frames were sent zero-copy from the staging buffer. On a failure it is not
            # pooled again (the socket may still hold it); the garbage collector frees it with the frames.
            if f.exception() is None:
                self.staging.put(staging)

        commit.add_done_callback(reuse)
        return commit

    def load(self, h, hit, jobs, copy) -> None:
        rep, frames = self.ctx.client.call(P.Retrieve(engine=self.ctx.engine_id, lease=hit.lease, format=self.format))
        if [(o.chunk, o.group) for o in rep.objects] != [(o.chunk, o.group) for o in hit.objects]:
            raise RuntimeError(f"server returned objects {rep.objects} for lease {hit.lease}")
        srcs, staging = self.decode(frames, [o.length for o in hit.objects])
        try:
            copy([(o, ids, s) for (o, ids), s in zip(jobs, srcs, strict=True)])
        finally:
            if staging is not None:
                self.staging.put(staging)


class RawWire(StagedWire):
    """Pinned staging sent as zero-copy ZMQ frames: no serialization, one copy by the server."""

    format = "raw"

    def encode(self, objs, dtypes) -> list:
        return [o.numpy() for o in objs]

    def decode(self, frames, lengths):
        if len(frames) != len(lengths):
            raise PayloadError(f"expected {len(lengths)} payload frames, got {len(frames)}")
        for i, (f, n) in enumerate(zip(frames, lengths, strict=True)):
            if len(f) != n:
                raise PayloadError(f"payload frame {i} is {len(f)} B, the object is {n} B")
        with warnings.catch_warnings():
            # received frames are read-only; the scatter only reads them
            warnings.simplefilter("ignore", UserWarning)
            views = [torch.frombuffer(f, dtype=torch.uint8) for f in frames]
        if self.ctx.device.type != "cuda":
            return views, None
        # frames live in unpinned socket memory: one host copy into pinned staging, then DMA/kernel H2D
        staging = self.staging.get(sum(lengths))
        srcs = list(torch.split(staging, lengths))
        for s, v in zip(srcs, views, strict=True):
            s.copy_(v)
        return srcs, staging


class SerializedWire(StagedWire):
    """The seed's formats: each object serialized as a typed tensor (kept as baselines)."""

    def encode(self, objs, dtypes) -> list:
        # clone: pickling a view would serialize the whole staging buffer it lives in
        return [encode_tensor(self.format, o.clone().view(getattr(torch, dt)))
                for o, dt in zip(objs, dtypes, strict=True)]

    def decode(self, frames, lengths):
        if len(frames) != len(lengths):
            raise PayloadError(f"expected {len(lengths)} payload frames, got {len(frames)}")
        srcs = []
        for i, (f, n) in enumerate(zip(frames, lengths, strict=True)):
            t = decode_tensor(self.format, f).contiguous().view(-1).view(torch.uint8)
            if t.numel() != n:
                raise PayloadError(f"payload {i} decodes to {t.numel()} B, the object is {n} B")
            # the seed moved each decoded tensor to the GPU, then copied it into the paged cache
            srcs.append(t.to(self.ctx.device) if self.ctx.device.type == "cuda" else t)
        return srcs, None


class PickleWire(SerializedWire):
    format = "pickle"


class TorchSaveWire(SerializedWire):
    format = "torch_save"


class CudaIpcWire(PayloadWire):
    """The server maps the engine's pages through CUDA IPC and copies them itself (LMCache's design)."""

    format = "cuda_ipc"

    def __init__(self, ctx: WireContext):
        super().__init__(ctx)
        if ctx.device.type != "cuda":
            raise ValueError("wire format cuda_ipc needs the engine's pages on a CUDA device")
        from hybridkv.baselines.cuda_ipc import export_views

        ctx.client.call(P.ShareCuda(engine=ctx.engine_id, groups=export_views(list(ctx.groups))))

    def store(self, h, reservation, jobs, copy, ready, pages_read) -> Future:
        if ready is not None:  # the server's copies cannot wait on our stream: wait here
            ready.synchronize()
        h.t_copy_start = time.perf_counter()
        # the reply means the server read the pages and committed them (the client times a silent server out)
        commit = self._commit(h, reservation, blocks=[ids.tolist() for _, ids in jobs])
        commit.result()
        h.t_done = time.perf_counter()
        pages_read()
        return commit

    def load(self, h, hit, jobs, copy) -> None:
        self.ctx.client.call(P.Retrieve(engine=self.ctx.engine_id, lease=hit.lease, format=self.format,
                                        blocks=[ids.tolist() for _, ids in jobs]))


WIRES: dict[WireFormat, type[DirectWire] | type[PayloadWire]] = {
    w.format: w for w in (ShmWire, RawWire, PickleWire, TorchSaveWire, CudaIpcWire)
}
WIRE_FORMATS: tuple[WireFormat, ...] = FORMATS
assert set(WIRES) == set(FORMATS), "every wire format has its strategy"
assert all(issubclass(w, DirectWire) == TRAITS[f].direct for f, w in WIRES.items()), "a direct format's wire is direct"
