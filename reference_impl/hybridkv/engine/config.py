"""How bytes move: the transfer axes (`TransferAxes`: wire format, copy engine, streams, policies, commit), declared
once and extended by an engine rank's `TransferConfig`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from hybridkv_kernels import COPY_ENGINES, CopyEngine

from hybridkv.policy import Policy, check_policy
from hybridkv.wire_formats import DEFAULT_FORMAT, FORMATS, WireFormat

Streams = Literal["single", "per_group"]
STREAM_MODES: tuple[Streams, ...] = get_args(Streams)
# fenced (the default): a store over the shm wire sends its commit with the copies (on CUDA with DMA copies; on a
# CPU once its synchronous copies are done), and the server publishes once the fence word written after them
# shows (hybridkv.server.books.fences); tested on CPU and the H200. after_copies: the classic commit, a round trip
# after the copies were waited for (always so for a payload wire and for kernel copies on CUDA).
CommitMode = Literal["fenced", "after_copies"]
COMMIT_MODES: tuple[CommitMode, ...] = get_args(CommitMode)


@dataclass(frozen=True, slots=True)
class TransferAxes:
    """The transfer axes, declared once: how bytes move between an engine and the server, whoever moves them
    (`TransferConfig` for an engine rank, the connector's `ConnectorSettings`, a bench case's settings extend it);
    validated at construction."""

    wire_format: WireFormat = DEFAULT_FORMAT
    # auto: DMA at every page size where the driver batches memcpys (the copy engines leave the SMs to the
    # model, where a copy kernel competes with its matmuls), else DMA from 1 MiB pages and the kernel below;
    # kernel / dma / triton / torch pin a choice (see hybridkv_kernels.dispatch)
    copy_engine: CopyEngine = "auto"
    streams: Streams = "single"        # single: every group on one stream; per_group: a stream per group (the seed's)
    # boundary: recurrent state only at the last hit chunk; all: every chunk (the seed's)
    retrieve_policy: Policy = "boundary"
    store_policy: Policy = "boundary"  # boundary: recurrent state only at the last stored chunk; all: every chunk
    commit: CommitMode = "fenced"  # after_copies: the classic round trip once the copies are done

    def __post_init__(self) -> None:
        for fld, allowed in (("wire_format", FORMATS), ("copy_engine", COPY_ENGINES),
                             ("streams", STREAM_MODES), ("commit", COMMIT_MODES)):
            if getattr(self, fld) not in allowed:
                raise ValueError(f"{fld} must be one of {allowed}, got {getattr(self, fld)!r}")
        check_policy(self.retrieve_policy)
        check_policy(self.store_policy)

    def axes(self) -> dict[str, Any]:
        """The axes by name, in declaration order (a subclass's own fields left out)."""
        return {f.name: getattr(self, f.name) for f in fields(TransferAxes)}


@dataclass(frozen=True, slots=True)
class TransferConfig(TransferAxes):
    """How an engine rank moves bytes: the transfer axes and the rank's own settings; validated at construction."""

    chunk_tokens: int = 0              # 0: the layout's unified block size
    tp_rank: int = 0
    salt: str = ""
    timeout_s: float = 60.0
    name: str = ""

    def __post_init__(self) -> None:
        TransferAxes.__post_init__(self)  # zero-argument super() does not reach it in a slots dataclass
        if self.chunk_tokens < 0 or self.timeout_s <= 0:
            raise ValueError(f"chunk_tokens must be >= 0 and timeout_s > 0, got {self.chunk_tokens}, {self.timeout_s}")
