"""How bytes move: the transfer axes (`TransferAxes`: wire format, copy engine, streams, policies, commit), declared
once and extended by an engine rank's `TransferConfig`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from hybridkv_kernels import COPY_ENGINES, CopyEngine

from hybridkv.model.policy import Policy, check_policy
from hybridkv.wire.wire_formats import DEFAULT_FORMAT, FORMATS, WireFormat

Streams = Literal["single", "per_group"]
STREAM_MODES: tuple[Streams, ...] = get_args(Streams)
# fenced (the default): a store over the shm wire sends its commit with the copies (on CUDA with DMA copies; on a
# CPU once its synchronous copies are done), and the server publishes once the fence word written after them
# shows (hybridkv.server.books.fences); tested on CPU and the H200. after_copies: the classic commit, a round trip
# after the copies were waited for (always so for a payload wire and for kernel copies on CUDA).
CommitMode = Literal["fenced", "after_copies"]
COMMIT_MODES: tuple[CommitMode, ...] = get_args(CommitMode)
# What copies at the full link cost the most memory-bound compute beside them (decode attention), per direction,
# as a share of its rate alone; the cost falls in proportion as the copies are paced (the compute_beside curves in
# results/h100/2026-12-07-pm/ and results/h100/2026-12-07-night/, the higher of the two kept): loads write into the
# HBM the model reads, stores only read it.
COMPUTE_COST_AT_FULL_LINK = {"load": 0.07, "store": 0.017}
MIN_LINK_FRACTION = 0.05  # the slowest pace: below it a long load would outlast the client's timeouts


def check_pacing(max_link_fraction: float, max_compute_cost: float, link_gbps: float, where: str = "") -> None:
    """Reject a pace no copy can keep (`TransferConfig`'s pacing fields, also the vLLM connector's settings); each
    message names the setting (after `where`, e.g. "kv_connector_extra_config ") and the bad value."""
    if not MIN_LINK_FRACTION <= max_link_fraction <= 1:
        raise ValueError(f"{where}max_link_fraction must lie in [{MIN_LINK_FRACTION}, 1], got {max_link_fraction!r}")
    if not 0 <= max_compute_cost < 1:
        raise ValueError(f"{where}max_compute_cost must lie in [0, 1) (0: no cap), got {max_compute_cost!r}")
    if max_compute_cost and (low := min(max_compute_cost / c for c in COMPUTE_COST_AT_FULL_LINK.values())
                             ) < MIN_LINK_FRACTION:
        raise ValueError(f"{where}max_compute_cost {max_compute_cost!r} would pace copies to {low:.3f} of the "
                         f"link, below the slowest pace {MIN_LINK_FRACTION}")
    if not 0 <= link_gbps < float("inf"):
        raise ValueError(f"{where}link_gbps must be a finite rate >= 0 (0: measured), got {link_gbps!r}")


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
    # Pacing (CUDA): the copies move at most this share of the link on average, in slices at full speed with
    # gaps between them (hybridkv_kernels.pace); 1: unpaced
    max_link_fraction: float = 1.0
    # ... or at most this cost to memory-bound compute beside them (0: no cap): each direction is paced to the
    # share of the link that costs this (COMPUTE_COST_AT_FULL_LINK); with both set, the lower share holds
    max_compute_cost: float = 0.0
    link_gbps: float = 0.0  # the link's rate the pace is a share of; 0: measured once when a pace applies

    def __post_init__(self) -> None:
        TransferAxes.__post_init__(self)  # zero-argument super() does not reach it in a slots dataclass
        if self.chunk_tokens < 0 or self.timeout_s <= 0:
            raise ValueError(f"chunk_tokens must be >= 0 and timeout_s > 0, got {self.chunk_tokens}, {self.timeout_s}")
        check_pacing(self.max_link_fraction, self.max_compute_cost, self.link_gbps)

    def link_fraction(self, kind: Literal["store", "load"]) -> float:
        """The share of the link `kind`'s copies may move: `max_link_fraction`, lowered to what keeps their cost
        to compute beside them within `max_compute_cost` where that is set."""
        fraction = self.max_link_fraction
        if self.max_compute_cost:
            fraction = min(fraction, self.max_compute_cost / COMPUTE_COST_AT_FULL_LINK[kind])
        return fraction
