"""An L2 workload file (scenarios/l2/*.toml): which L2, which model, how many documents, where the L2 lives and
how hard its ceilings are probed; strictly decoded, and shrunk for a quick run."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

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
