"""The Lookup hit rule (DESIGN.md), shared by Lookup and Prefetch: in turns for a large request
(`hit_length_turns`, its questions asked in pieces of SLICE_OBJECTS), or in one call (`hit_length`, the same
generator under a clock that never ends the turn)."""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.server.books.records import Engine
from hybridkv.server.machinery.table import ObjectKeys
from hybridkv.server.ops.context import Context
from hybridkv.server.ops.turns import SLICE_OBJECTS, TURN, Clock, Steps


def hit_length(ctx: Context, eng: Engine, keys: list[bytes], policy: str, missing: ObjectKeys,
               foreign: ObjectKeys) -> int:
    """Longest n such that every needed object of chunks < n exists in the engine's namespace, every recurrent
    group has its state at chunk n-1 (DESIGN.md: a prefix without its state is a miss at that length) and every
    sliding-window group its objects of the chunks its window at n reaches (`GroupLayout.window_start_chunk`).
    Objects of another namespace under these keys are misses, collected in `foreign`. In one call: the rule of
    `hit_length_turns` under a clock that never ends the turn."""
    steps = hit_length_turns(ctx, eng, keys, policy, missing, foreign, _NEVER)
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise AssertionError("a turn ended under a clock that never ends one")


_NEVER = Clock(endless=True)


def hit_length_turns(ctx: Context, eng: Engine, keys: list[bytes], policy: str, missing: ObjectKeys,
                     foreign: ObjectKeys, clock: Clock) -> Steps[int]:
    """The hit rule (`hit_length`), its questions asked in pieces with a turn between them when the clock says
    so. The pieces are answered at different times: what a later turn finds gone is a miss when the lookup
    pins it, and the rule is asked again (lookup.py)."""
    layout, ns = eng.layout, eng.ns
    every = policy == "all"
    groups = [g for g, grp in enumerate(layout.groups)
              if grp.kind == "attention" or (every and grp.kind == "recurrent")]
    lengths = eng.object_bytes
    n = yield from _available(ctx, keys, 0, len(keys), groups, lengths, missing, ns, foreign, clock)
    recurrent = layout.recurrent_groups
    sliding = layout.sliding_groups
    available = ctx.objects.available_prefix
    known: dict[int, int] = {}
    steps = 0
    # Per sliding group, the first chunk c such that its objects of chunks c..n-1 are known available: a
    # shorter length re-reads only the chunks its window reaches below c, so each chunk is read once per group
    # however often the search steps down (re-reading a whole long window per step was keys^2 / 2 reads).
    while n > 0:
        steps += len(recurrent) + 1
        if steps >= SLICE_OBJECTS:  # a long walk down, one length at a time
            steps = 0
            if clock.over():
                yield TURN
        if not available(keys[n - 1:n], recurrent, lengths, missing, ns, foreign):
            n -= 1
            continue
        # A sliding object missing at chunk c fails every length in (c, n]: each of their windows reaches c.
        # So the search jumps to c.
        at = n
        for (start, lo), gs in _by_window_start(layout, sliding, n, eng.chunk_tokens, known).items():
            have = yield from _available(ctx, keys, start, lo, gs, lengths, missing, ns, foreign, clock)
            if have < lo - start:
                at = min(at, start + have)
        if at == n:
            return n
        n = at
    return 0


def _available(ctx: Context, keys: list[bytes], lo: int, hi: int, groups: Sequence[int], lengths: list[int],
               missing: ObjectKeys, ns: bytes, foreign: ObjectKeys, clock: Clock) -> Steps[int]:
    """`available_prefix(keys[lo:hi], ...)` in pieces of SLICE_OBJECTS objects (the full-hit question still in C
    per piece); stops at the first piece that is not all available."""
    available = ctx.objects.available_prefix
    step = max(1, SLICE_OBJECTS // max(1, len(groups)))
    i = lo
    while i < hi:
        j = min(hi, i + step)
        have = available(keys[i:j], groups, lengths, missing, ns, foreign)
        if have < j - i:
            return i + have - lo
        i = j
        if i < hi and clock.over():
            yield TURN
    return hi - lo


def count_foreign(ctx: Context, foreign: ObjectKeys) -> None:
    """A request that named objects of another namespace is counted once (namespace_refusals)."""
    if foreign:
        ctx.counters.namespace_refusals += 1


def count_hit(ctx: Context, eng: Engine, n: int, l2_chunks: int, probe: bool) -> None:
    """Count a lookup's hit of n chunks, l2_chunks of them read back from L2 (its tier)."""
    c, tokens = ctx.counters, eng.chunk_tokens
    c.hit_chunks += n
    c.hit_tokens += n * tokens
    if probe:
        c.probe_hit_chunks += n
        c.probe_hit_tokens += n * tokens
    elif l2_chunks:
        c.hit_chunks_l2 += l2_chunks
        c.hit_tokens_l2 += l2_chunks * tokens


def _by_window_start(layout, sliding: list[int], n: int, chunk_tokens: int,
                     known: dict[int, int]) -> dict[tuple[int, int], list[int]]:
    """The sliding groups with chunks to read at n, by (first chunk their window at n reaches, first chunk
    already known available); one entry when they share a window. `known` moves down to those first chunks."""
    out: dict[tuple[int, int], list[int]] = {}
    for g in sliding:
        start, lo = layout.groups[g].window_start_chunk(n, chunk_tokens), known.get(g, n)
        if start < lo:
            out.setdefault((start, lo), []).append(g)
            known[g] = start
    return out
