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


@dataclass(frozen=True)
class FormatTraits:
    direct: bool                 # the engine reaches the arena's slots; only metadata crosses the socket
    server_imports_torch: bool   # the server rebuilds tensors (its process maps torch's libraries)
    server_holds_cuda: bool      # the server opens a CUDA context of its own (VRAM on the server's side)
    label: str                   # how reports and plots name it


TRAITS: dict[WireFormat, FormatTraits] = {
    "shm": FormatTraits(direct=True, server_imports_torch=False, server_holds_cuda=False, label="hybridkv shm"),
    "raw": FormatTraits(direct=False, server_imports_torch=False, server_holds_cuda=False, label="raw frames"),
    "pickle": FormatTraits(direct=False, server_imports_torch=True, server_holds_cuda=False, label="pickle (seed)"),
    "torch_save": FormatTraits(direct=False, server_imports_torch=True, server_holds_cuda=False,
                               label="torch.save (seed)"),
    "cuda_ipc": FormatTraits(direct=False, server_imports_torch=True, server_holds_cuda=True,
                             label="CUDA-IPC server"),
}
FORMATS: tuple[WireFormat, ...] = get_args(WireFormat)
DEFAULT_FORMAT: WireFormat = "shm"  # the zero-copy format: what a scenario's matrix runs unless it lists others
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
