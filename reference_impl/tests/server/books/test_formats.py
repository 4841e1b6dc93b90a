"""The server's strategy per wire format is the one `hybridkv.wire.wire_formats.TRAITS` names by how the format's bytes
move, and every other trait (direct, torch on the server, CUDA on the server) follows from that one field."""

from __future__ import annotations

from hybridkv.engine.wire import WIRES, DirectWire
from hybridkv.server.books.formats import CudaIpcFormat, LegacyFormat, RawFormat, ShmFormat
from hybridkv.server.front.cli import parse
from hybridkv.server.front.loop import CacheServer
from hybridkv.wire.wire_formats import FORMATS, TRAITS

STRATEGY = {"arena": ShmFormat, "frames": RawFormat, "tensors": LegacyFormat, "cuda": CudaIpcFormat}


def test_each_formats_strategy_and_traits_follow_from_how_its_bytes_move(tmp_path):
    s = CacheServer(parse([f"--endpoint=ipc://{tmp_path}/s.sock", "--l1-gib=0.01", f"--l1-dir={tmp_path}"]))
    try:
        for fmt in FORMATS:
            t = TRAITS[fmt]
            assert type(s.ctx.formats[fmt]) is STRATEGY[t.moves], fmt
            assert issubclass(WIRES[fmt], DirectWire) == t.direct == (t.moves == "arena"), fmt
            assert t.server_holds_cuda <= t.server_imports_torch, fmt  # a CUDA context comes with torch
    finally:
        s.close()
    assert {f: TRAITS[f].moves for f in FORMATS} == {"shm": "arena", "raw": "frames", "pickle": "tensors",
                                                   "torch_save": "tensors", "cuda_ipc": "cuda"}
