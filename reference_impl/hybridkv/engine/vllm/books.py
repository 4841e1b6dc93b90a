"""The scheduler side's books: what it remembers of each hit it reported and each live request, and its
counters. Plain records, touched only by `scheduler_side.SchedulerSide`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from hybridkv.engine.vllm.plan import PinnedHit

HitTier = Literal["l1", "l2", "unknown"]  # where a hit's objects were: memory, disk, or either


@dataclass(slots=True)
class PendingHit:
    """A hit reported to vLLM, waiting for its blocks."""

    token_ids: list[int]
    skip_tokens: int
    leases: list[tuple[int, int]]  # (engine, lease) per rank: one pin set per request, however often vLLM asks
    extras: list[bytes] | None
    tier: HitTier
    pinned: PinnedHit | None = None  # the lookup's objects, for the workers (None: ranks' hits differ)


@dataclass(slots=True)
class SchedulerStats:
    """Counters of what the scheduler side decided (hits in tokens)."""

    lookups: int = 0
    lookups_deferred: int = 0  # "not yet" answers: the prefix's L2 reads were still running
    lookup_failures: int = 0
    lookup_s: float = 0.0
    hit_tokens: int = 0
    hit_tokens_l1: int = 0  # the hit's objects were all in the server's memory
    hit_tokens_l2: int = 0  # part of the prefix was read back from the server's disk first
    hit_tokens_unknown: int = 0  # the lookup read L2 itself, if at all (a server with L2, l2_wait_s 0)
    loads_planned: int = 0
    stores_planned: int = 0


@dataclass(slots=True)
class RequestTrack:
    """What the scheduler side remembers of a live request."""

    stored_chunks: int = 0
    looked_up: bool = False
    tier: HitTier | None = None  # of the load planned for it (vLLM asks after update_state_after_alloc)
    l2_since: float = 0.0  # when its first "not yet" was answered (its prefix's L2 reads started); 0: never
    refused: bool = False  # its load was refused (vLLM's blocks did not match the objects) or failed on some rank:
    # no external hit for it again
