"""The server half of each wire format: how a commit's bytes reach the arena and how a retrieve's leave it.

One strategy per format, in one table keyed by the format's name (`hybridkv.wire.wire_formats.WireFormat`), each
chosen by how the format's bytes move (its `TRAITS[fmt].moves`). A strategy validates on the loop thread (raising
RequestError) and returns the copy work as a job for a worker thread, or None when no byte has to move (a direct
format: the engine wrote the arena itself).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import numpy as np

from hybridkv.baselines.codec import bytes_to_tensor, copy_tensor_into, decode_tensor, encode_tensor
from hybridkv.memory.arena import Arena
from hybridkv.server.books.errors import RequestError
from hybridkv.server.books.loans import Loans
from hybridkv.server.books.records import Engine, Lease, Reservation
from hybridkv.wire import protocol as P
from hybridkv.wire.wire_formats import FORMATS, TRAITS, Moves, WireFormat

if TYPE_CHECKING:
    from hybridkv.baselines.cuda_ipc import MappedEngine

E = P.ErrorCode
Job = Callable[[], Any]
_length = attrgetter("length")


class FormatStrategy(Protocol):
    def commit(self, eng: Engine, res: Reservation, msg: P.CommitStore, frames: list[Any]) -> Job | None:
        """Validate a commit; the job that copies its payload into the reservation's slots, or None."""

    def retrieve(self, eng: Engine, lease: Lease, part: slice, msg: P.Retrieve) -> list[Any] | Job:
        """The payload frames of the `part` of a lease's objects now, or a job that returns them."""


def _frame_count(res: Reservation, frames: list[Any], fmt: WireFormat) -> None:
    if len(frames) != len(res.slots):
        raise RequestError(E.BAD_PAYLOAD, f"commit of reservation {res.id} needs {len(res.slots)} payload "
                           f"frames ({fmt}), got {len(frames)}")


def _no_payload(msg: P.Message, frames: list[Any]) -> None:
    if frames:
        raise RequestError(E.BAD_PAYLOAD, f"{type(msg).__name__} carries no payload frames, got {len(frames)}")


class ShmFormat:
    """A direct format: the engine writes and reads the arena itself, only metadata crosses the socket."""

    def commit(self, eng: Engine, res: Reservation, msg: P.CommitStore, frames: list[Any]) -> Job | None:
        _no_payload(msg, frames)
        return None

    def retrieve(self, eng: Engine, lease: Lease, part: slice, msg: P.Retrieve) -> list[Any] | Job:
        raise RequestError(E.BAD_REQUEST, "shm engines read the arena at the lookup's offsets; retrieve "
                           "sends payload frames only for raw, pickle and torch_save")


class RawFormat:
    """One zero-copy payload frame per object, the object's bytes exactly."""

    def __init__(self, arena: Arena, loans: Loans, fmt: WireFormat):
        self.arena = arena
        self.loans = loans
        self.fmt = fmt

    def commit(self, eng: Engine, res: Reservation, msg: P.CommitStore, frames: list[Any]) -> Job | None:
        _frame_count(res, frames, self.fmt)
        for i, (f, s) in enumerate(zip(frames, res.slots, strict=True)):
            if len(f) != s.entry.length:
                raise RequestError(E.BAD_PAYLOAD, f"payload frame {i} (chunk {s.chunk}, group {s.group}) is "
                                   f"{len(f)} B; the object is {s.entry.length} B")

        def copy() -> None:
            for f, s in zip(frames, res.slots, strict=True):
                # numpy releases the GIL for the copy, so the loop keeps serving meanwhile
                np.copyto(np.frombuffer(self.arena.view(s.entry.offset, s.entry.length), np.uint8),
                          np.frombuffer(f.buffer, np.uint8))
        return copy

    def retrieve(self, eng: Engine, lease: Lease, part: slice, msg: P.Retrieve) -> list[Any] | Job:
        entries = lease.entries[part]
        if max(map(_length, entries), default=0) < self.loans.copy_threshold:  # the lengths in C
            # pyzmq copies each frame when the loop sends the reply, in this turn: no release can come between
            return [self.arena.view(e.offset, e.length) for e in entries]
        # zero-copy: libzmq sends the frames later, and the lease may be released before; the loan keeps the
        # slots from reuse until libzmq has let go of every frame
        return self.loans.lend(entries).views


class LegacyFormat:
    """The seed's formats (pickle, torch.save): a typed tensor per object, decoded and encoded here."""

    def __init__(self, arena: Arena, loans: Loans, fmt: WireFormat):
        self.arena = arena
        self.loans = loans
        self.fmt = fmt

    def commit(self, eng: Engine, res: Reservation, msg: P.CommitStore, frames: list[Any]) -> Job | None:
        _frame_count(res, frames, self.fmt)

        def copy() -> None:
            for f, s in zip(frames, res.slots, strict=True):
                copy_tensor_into(decode_tensor(self.fmt, f.buffer), self.arena.view(s.entry.offset, s.entry.length))
        return copy

    def retrieve(self, eng: Engine, lease: Lease, part: slice, msg: P.Retrieve) -> list[Any] | Job:
        dtypes = [eng.layout.groups[loc.group].dtype for loc in lease.locs[part]]
        loan = self.loans.lend(lease.entries[part])  # a worker encodes them later: the lease may be released before

        def encode() -> list[bytes]:
            try:  # each encoding is a copy: the frames sent hold no arena byte
                return [encode_tensor(self.fmt, bytes_to_tensor(v, dt))
                        for v, dt in zip(loan.views, dtypes, strict=True)]
            finally:
                loan.close()
        return encode


class CudaIpcFormat:
    """The CUDA-IPC baseline: the server maps the engine's GPU pages and copies them itself."""

    def __init__(self, arena: Arena, loans: Loans, enabled: bool):
        self.arena = arena
        self.loans = loans
        self.enabled = enabled
        self.mapped: dict[int, MappedEngine] = {}

    def share(self, eng: Engine, msg: P.ShareCuda) -> int:
        if not self.enabled:
            raise RequestError(E.BAD_REQUEST, "this server is CPU-only and never maps GPU memory; start it with "
                               "--cuda-ipc to measure the CUDA-IPC baseline")
        layout = eng.layout
        if [len(g) for g in msg.groups] != [g.num_layers for g in layout.groups]:
            raise RequestError(E.LAYOUT, f"shared {[len(g) for g in msg.groups]} layers per group; the layout has "
                               f"{[g.num_layers for g in layout.groups]}")
        from hybridkv.baselines.cuda_ipc import MappedEngine  # imports torch and initialises CUDA: the baseline's cost

        try:
            self.mapped[eng.id] = MappedEngine(msg.groups, self.arena.buf, [g.page_bytes for g in layout.groups])
        except (ValueError, RuntimeError) as e:
            raise RequestError(E.BAD_REQUEST, f"cannot map the engine's CUDA pages: {e}") from None
        return sum(len(g) for g in msg.groups)

    def forget(self, eng: Engine) -> None:
        self.mapped.pop(eng.id, None)

    def _job(self, eng: Engine, direction: Literal["gather", "scatter"], objects: list[tuple[int, int, int, int]],
             blocks: bytes) -> Job:
        """Validate a copy of (chunk, group, offset, length) objects from/to engine blocks: `blocks` is their
        block ids packed, objects in order, each object's count given by its length."""
        mapped = self.mapped.get(eng.id)
        if mapped is None:
            raise RequestError(E.BAD_REQUEST, f"engine {eng.id} shared no CUDA pages (send share_cuda first)")
        ids = P.unpack_ints(blocks)
        plan, at = [], 0
        for i, (c, g, off, length) in enumerate(objects):
            grp = eng.layout.groups[g]
            n, rest = divmod(length, grp.num_layers * grp.page_bytes)
            if rest or at + n > len(ids):
                raise RequestError(E.BAD_REQUEST, f"object {i} (chunk {c}, group {g}) is {length} B: "
                                   f"{len(ids) - at} block ids left of {len(ids)} do not fill it with pages of "
                                   f"{grp.num_layers} layers")
            plan.append((g, list(ids[at:at + n]), off, length))
            at += n
        if at != len(ids):
            raise RequestError(E.BAD_REQUEST, f"{len(ids)} block ids for objects of {at} blocks")
        return lambda: mapped.copy(direction, plan)

    def commit(self, eng: Engine, res: Reservation, msg: P.CommitStore, frames: list[Any]) -> Job | None:
        _no_payload(msg, frames)
        return self._job(eng, "gather", [(s.chunk, s.group, s.entry.offset, s.entry.length) for s in res.slots],
                         cast(bytes, msg.blocks))

    def retrieve(self, eng: Engine, lease: Lease, part: slice, msg: P.Retrieve) -> list[Any] | Job:
        entries = lease.entries[part]
        job = self._job(eng, "scatter", [(loc.chunk, loc.group, e.offset, e.length)
                                         for loc, e in zip(lease.locs[part], entries, strict=True)],
                        cast(bytes, msg.blocks))
        loan = self.loans.lend(entries)  # a worker copies them later: the lease may be released before

        def run() -> list[Any]:
            try:
                job()
            finally:
                loan.close()
            return []
        return run


class Formats:
    """The table: one strategy per wire format, by the format's traits."""

    def __init__(self, loans: Loans, cuda_ipc: bool):
        self.cuda = CudaIpcFormat(loans.arena, loans, cuda_ipc)
        self.table: dict[WireFormat, FormatStrategy] = {fmt: self._strategy(loans.arena, loans, fmt)
                                                        for fmt in FORMATS}

    def _strategy(self, arena: Arena, loans: Loans, fmt: WireFormat) -> FormatStrategy:
        """The strategy for how `fmt`'s bytes move (`TRAITS[fmt].moves`)."""
        make: dict[Moves, Callable[[], FormatStrategy]] = {
            "arena": ShmFormat,  # the engine's copies wrote the arena: nothing moves here
            "frames": lambda: RawFormat(arena, loans, fmt),
            "tensors": lambda: LegacyFormat(arena, loans, fmt),  # the server rebuilds the seed's tensors
            "cuda": lambda: self.cuda,  # the server maps the engine's GPU pages and copies itself
        }
        return make[TRAITS[fmt].moves]()

    def __getitem__(self, fmt: WireFormat) -> FormatStrategy:
        return self.table[fmt]
