"""The Redis L2's deletions (and touches) of whole objects, bounded by the keys that exist, never by a meta's claim.

A meta says how many data keys its object has, but it is a claim by whoever could write the store: 2**64 bytes in
chunks of 1 would be a key name per byte. So an object's data keys go a window at a time (`chunk_rounds`), and its
walk ends at the first window that finds none of them: a put writes them all, so past a gap are only orphans of an
object the store evicted in part, which its LRU or TTL takes. A clear (`clear_batch`) deletes a batch's metas first
(what readers look for), then their chunks this way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from hybridkv.server.l2.redis_cluster import ClusterLink
from hybridkv.server.l2.redis_meta import MetaCodec

WINDOW = 64          # data keys of one object named by one command
ROUND_NAMES = 4096   # data keys named in one round trip


def each(link: Any, command: str, groups: list[list[str]]) -> list[int]:
    """`command` (unlink, touch) over each group of names, one multi-key command per group in one round trip: how
    many keys of each group it found (a redis.Redis, or a ClusterLink's single-key commands)."""
    if isinstance(link, ClusterLink):
        return link.each(command, groups)
    pipe = link.pipeline(transaction=False)
    for names in groups:
        getattr(pipe, command)(*names)
    return list(pipe.execute())


def chunk_rounds(link: Any, command: str, objects: list[tuple[str, int | None]]) -> Iterator[int]:
    """`command` over the data keys [0, n) of each (names' base, n) in `objects`, n being what its meta claims (None:
    unknown), WINDOW keys of one object per command, ROUND_NAMES keys per round trip; yields how many keys each
    round found. An object's walk ends at n or at a window that found none of its keys (the module doc)."""
    todo = deque((base, 0, n) for base, n in objects if n is None or n > 0)
    while todo:
        sent: list[tuple[str, int, int, int | None]] = []
        named = 0
        while todo and named < ROUND_NAMES:
            base, start, n = todo.popleft()
            end = start + WINDOW if n is None else min(n, start + WINDOW)
            sent.append((base, start, end, n))
            named += end - start
        found = each(link, command, [[f"{base}{i}" for i in range(start, end)] for base, start, end, _ in sent])
        for (base, _, end, n), k in zip(sent, found, strict=True):
            if k and (n is None or end < n):
                todo.append((base, end, n))
        yield sum(found)


def clear_batch(link: Any, codec: MetaCodec, metas: list[bytes],
                namespaces: frozenset[bytes] | None) -> Iterator[dict[bytes, int]]:
    """Delete the objects of `namespaces` (every one when None) among these names from a SCAN: the metas in one
    command (at most the batch), yielding how many objects per namespace, then their chunks, a piece per round."""
    metas = [m for m in metas if codec.is_meta_name(m)]
    if not metas:
        yield {}
        return
    names, chunks, counts = codec.cleared(metas, link.mget(metas), namespaces)
    if names:
        link.unlink(*names)
    yield counts
    for _ in chunk_rounds(link, "unlink", chunks):
        yield {}
