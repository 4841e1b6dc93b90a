"""The wire formats and what each one is: the one table every part reads (engine, server, harness, gate).

A *direct* format (`shm`) moves no payload over the socket: the engine's copies read and write the server's
arena slots. The others send the bytes as frames. The legacy formats (`pickle`, `torch_save`) are the seed's:
the server rebuilds tensors, so it imports torch. `cuda_ipc` is upstream LMCache's mode, in which the server
maps the engine's GPU pages and copies itself: it holds a CUDA context and VRAM, and a server accepts it only
when started with `--cuda-ipc`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

WireFormat = Literal["shm", "raw", "pickle", "torch_save", "cuda_ipc"]
# How a format's bytes move between the engine's pages and the arena; every other trait follows from it.
#   arena:   the engine's copies read and write the arena's slots; only metadata crosses the socket (direct)
#   frames:  the bytes cross the socket as frames, copied to and from the slots as they are
#   tensors: the frames hold the seed's serialized tensors, which the server rebuilds (it imports torch)
#   cuda:    the server maps the engine's GPU pages and copies itself (a CUDA context and VRAM of its own)
Moves = Literal["arena", "frames", "tensors", "cuda"]


@dataclass(frozen=True)
class FormatTraits:
    moves: Moves
    label: str  # how reports and plots name it

    @property
    def direct(self) -> bool:
        """The engine reaches the arena's slots; only metadata crosses the socket."""
        return self.moves == "arena"

    @property
    def server_imports_torch(self) -> bool:
        """The server rebuilds tensors (its process maps torch's libraries)."""
        return self.moves in ("tensors", "cuda")

    @property
    def server_holds_cuda(self) -> bool:
        """The server opens a CUDA context of its own (VRAM on the server's side)."""
        return self.moves == "cuda"


# The one table of what each format is: the engine's route (engine/routes.open_route), its wire's kind
# (engine/wire.WIRES, checked against it), the server's strategy (server/books/formats.Formats) and the harness read it.
TRAITS: dict[WireFormat, FormatTraits] = {
    "shm": FormatTraits("arena", "hybridkv shm"),
    "raw": FormatTraits("frames", "raw frames"),
    "pickle": FormatTraits("tensors", "pickle (seed)"),
    "torch_save": FormatTraits("tensors", "torch.save (seed)"),
    "cuda_ipc": FormatTraits("cuda", "CUDA-IPC server"),
}
FORMATS: tuple[WireFormat, ...] = get_args(WireFormat)
DEFAULT_FORMAT: WireFormat = "shm"          # an engine's format unless told otherwise: the direct one
DEFAULT_PAYLOAD_FORMAT: WireFormat = "raw"  # a Retrieve's format unless told otherwise: frames, no serializing
assert set(FORMATS) == set(TRAITS), "every wire format has its traits"


def traits(fmt: str) -> FormatTraits:
    """The traits of a format named by a user, a file or a message; a clear error for any other name."""
    try:
        return TRAITS[fmt]  # type: ignore[index]
    except KeyError:
        raise ValueError(f"unknown wire format {fmt!r}; known: {', '.join(FORMATS)}") from None


def label(fmt: str) -> str:
    """A report's name for a format (an unknown one, read from an old run, as it is)."""
    t = TRAITS.get(fmt)  # type: ignore[call-overload]
    return t.label if t else fmt
