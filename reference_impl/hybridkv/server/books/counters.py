"""The server's counters: one typed struct, reported by Stats."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class Counters:
    """Server-wide counters (gauges are computed when Stats asks)."""
    requests: int = 0
    errors: int = 0
    lookups: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    lookup_l2_waits: int = 0            # pinned lookups that had to wait for an L2 read before answering
    prefetch_requests: int = 0
    prefetch_objects_started: int = 0   # L2 -> L1 reads started by Prefetch requests (also in l2_prefetches)
    prefetch_objects_in_l1: int = 0     # objects a Prefetch found READY in L1 already
    prefetch_objects_refused: int = 0   # objects a Prefetch could not bring in: no evictable room in L1
    objects_committed: int = 0
    bytes_committed: int = 0
    objects_skipped_present: int = 0
    objects_refused: int = 0
    objects_aborted: int = 0
    commits_fenced: int = 0             # commits sent with their copies, published once the fence word showed
    fence_timeouts: int = 0             # fenced commits whose word never showed within --client-timeout
    l2_spills: int = 0
    l2_spill_bytes: int = 0
    l2_spill_failures: int = 0
    l2_prefetches: int = 0
    l2_prefetch_bytes: int = 0
    l2_prefetch_failures: int = 0
    l2_clear_walks: int = 0             # walks of the L2 index for Clears (the Clears waiting together share one)
    engines_registered: int = 0
    engines_reclaimed: int = 0
    reservations_reclaimed: int = 0
    # loop turns longer than loop.STALLED_S (the server stopped, paused or swapped out): excused from engines' silence
    loop_stalls: int = 0
    bad_messages: int = 0
    limit_refusals: int = 0
    forbidden_refusals: int = 0
    # requests that named objects the server holds under another namespace (a client sending keys not of its
    # own registration): answered as misses for them, or refused for them (prepare)
    namespace_refusals: int = 0
    # hits by tier and in tokens (the Prometheus metrics and `hybridkv status`): a hit chunk is of tier l2 when a
    # lookup had to read one of its objects back from L2, probe when the lookup pinned nothing (pin=False)
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_chunks_l2: int = 0
    hit_tokens_l2: int = 0
    probe_hit_chunks: int = 0
    probe_hit_tokens: int = 0
    bytes_leased: int = 0               # bytes of the objects lookups pinned for their engines to load

    def as_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)
