"""Engine-side memory for the wire formats: the mapped server arena (shm), pinned staging buffers
(raw and the legacy formats), and turning staged objects into payload frames and back."""

from __future__ import annotations

import threading
import warnings

import torch

from hybridkv.arena import map_arena
from hybridkv.baselines.codec import PayloadError, decode_tensor, encode_tensor


class ArenaMapping:
    """The server's L1 arena mapped into this engine; registered as pinned memory on CUDA so the GPU
    reads and writes slots directly (DMA or a kernel through UVA), with no copy by either process.
    Engines of one process share one mapping per arena (`open`): registering tens of GB takes seconds."""

    _shared: dict[tuple[str, int, str], list] = {}  # (path, size, device) -> [mapping, users]
    _lock = threading.Lock()

    @classmethod
    def open(cls, path: str, size: int, device: torch.device) -> ArenaMapping:
        key = (path, size, str(device))
        with cls._lock:
            entry = cls._shared.get(key)
            if entry is None:
                entry = cls._shared[key] = [cls(path, size, device), 0]
            entry[1] += 1
            return entry[0]

    def release(self) -> None:
        """Drop one user of a shared mapping; the last one unmaps it."""
        with self._lock:
            for key, entry in list(self._shared.items()):
                if entry[0] is self:
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._shared[key]
                        self.close()
                    return
        self.close()

    def __init__(self, path: str, size: int, device: torch.device):
        self._mm = map_arena(path, size)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.size = size
        self._registered = False
        if device.type == "cuda":
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the {size} B arena {path} failed with CUDA error {int(rc)}")
            self._registered = True

    def slot(self, offset: int, length: int) -> torch.Tensor:
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"slot ({offset}, {length}) lies outside the {self.size} B arena")
        return self.tensor[offset:offset + length]

    def close(self) -> None:
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
        base = t._base if t._base is not None else t
        with self._lock:
            self._free.append(base)
            self._free.sort(key=torch.Tensor.numel)
            del self._free[:-self.keep]


def encode_objects(fmt: str, objs: list[torch.Tensor], dtypes: list[str]) -> list:
    """Payload frames for gathered objects: zero-copy views (raw) or the seed's serializations."""
    if fmt == "raw":
        return [o.numpy() for o in objs]
    # clone: pickling a view would serialize the whole staging buffer it lives in
    return [encode_tensor(fmt, o.clone().view(getattr(torch, dt))) for o, dt in zip(objs, dtypes, strict=True)]


def decode_objects(fmt: str, frames: list, lengths: list[int], device: torch.device,
                   pool: StagingPool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Sources for a scatter from received frames; returns them and the staging buffer to give back."""
    if len(frames) != len(lengths):
        raise PayloadError(f"expected {len(lengths)} payload frames, got {len(frames)}")
    if fmt == "raw":
        for i, (f, n) in enumerate(zip(frames, lengths, strict=True)):
            if len(f) != n:
                raise PayloadError(f"payload frame {i} is {len(f)} B, the object is {n} B")
        with warnings.catch_warnings():
            # received frames are read-only; the scatter only reads them
            warnings.simplefilter("ignore", UserWarning)
            views = [torch.frombuffer(f, dtype=torch.uint8) for f in frames]
        if device.type != "cuda":
            return views, None
        # frames live in unpinned socket memory: one host copy into pinned staging, then DMA/kernel H2D
        staging = pool.get(sum(lengths))
        srcs = list(torch.split(staging, lengths))
        for s, v in zip(srcs, views, strict=True):
            s.copy_(v)
        return srcs, staging
    srcs = []
    for i, (f, n) in enumerate(zip(frames, lengths, strict=True)):
        t = decode_tensor(fmt, f).contiguous().view(-1).view(torch.uint8)
        if t.numel() != n:
            raise PayloadError(f"payload {i} decodes to {t.numel()} B, the object is {n} B")
        # the seed moved each decoded tensor to the GPU, then copied it into the paged cache
        srcs.append(t.to(device) if device.type == "cuda" else t)
    return srcs, None
