"""The store / retrieve policy rule, in one place: which (chunk, group) objects a chunk range stores or
loads, and which of an engine's blocks hold each object.

- `boundary`: every attention object of every chunk, and the recurrent state only at the last chunk
  (what resuming the prefix needs: DESIGN's hit rule).
- `all`: every group's object for every chunk (the seed's behaviour).

Sliding-window groups are the same under both: a store writes every chunk's object (the chunk's last
`tail_blocks` blocks, `GroupLayout.tail_blocks`), and resuming at n chunks needs only the objects of the
chunks vLLM still reads, from `GroupLayout.window_start_chunk(n)` on: vLLM frees the KV of every token
before n·chunk - window + 1.

The engine (what to store, where to copy), the server (what a lookup pins) and the harness's simulated
engine use these functions. The harness's expected-hit oracle (`hybridkv_bench.workloads`) keeps its
own independent statement of the rule on purpose: it checks this one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Literal, cast, get_args

from hybridkv.model.layout import ModelLayout

Policy = Literal["boundary", "all"]
POLICIES: tuple[Policy, ...] = get_args(Policy)


def check_policy(policy: str) -> Policy:
    """The policy, or ValueError naming the bad value."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return cast(Policy, policy)


def _pairs(first: int, n: int, starts: Sequence[int]) -> list[tuple[int, int]]:
    """(chunk, group) for chunks first..n-1, chunk-major, groups in order, group g from chunk starts[g] on."""
    if first >= n:
        return []
    always = [g for g, at in enumerate(starts) if at <= first]
    lo = min([n, *(at for at in starts if at > first)])  # below it, the groups of every chunk alone
    if len(always) == 1:  # one attention group (every preset's boundary list): the pairs made in C
        head = list(zip(range(first, lo), repeat(always[0])))
    else:
        head = [(c, g) for c in range(first, lo) for g in always]
    return head + [(c, g) for c in range(lo, n) for g, at in enumerate(starts) if c >= at]


def chunk_objects(layout: ModelLayout, policy: str, first: int, n: int) -> list[tuple[int, int]]:
    """(chunk, group) objects a store of chunks first..n-1 writes under `policy`, chunk-major, groups in
    layout order. Attention and sliding-window groups at every chunk; recurrent groups at every chunk under
    `all`, at chunk n-1 only under `boundary`."""
    every = check_policy(policy) == "all"
    return _pairs(first, n, [max(0, n - 1) if g.kind == "recurrent" and not every else 0 for g in layout.groups])


def resume_objects(layout: ModelLayout, policy: str, n: int, skip: int = 0,
                   chunk_tokens: int = 0) -> list[tuple[int, int]]:
    """Objects an engine loads to resume at n chunks when it already holds the first `skip` chunks'
    attention: chunks skip..n-1 under `policy` (a sliding-window group's only from its window's first chunk
    on; `chunk_tokens` is needed then), plus the boundary state when every chunk is held."""
    out = _pairs(min(skip, n), n, _resume_starts(layout, policy, n, chunk_tokens))
    if n and skip >= n:
        out.extend((n - 1, g) for g in layout.recurrent_groups)
    return out


def resume_slices(layout: ModelLayout, policy: str, n: int, skip: int, chunk_tokens: int,
                  objects: int) -> Iterator[list[tuple[int, int]]]:
    """`resume_objects(layout, policy, n, skip, chunk_tokens)` in pieces of whole chunks, about `objects` objects
    each (the boundary states, when they are needed, last): the pieces joined are its list. A large lookup pins
    a piece at a time (server/ops/lookup.py)."""
    starts = _resume_starts(layout, policy, n, chunk_tokens)
    step = max(1, objects // max(1, len(layout.groups)))
    for lo in range(min(skip, n), n, step):
        yield _pairs(lo, min(n, lo + step), starts)
    if n and skip >= n:
        yield [(n - 1, g) for g in layout.recurrent_groups]


def _resume_starts(layout: ModelLayout, policy: str, n: int, chunk_tokens: int) -> list[int]:
    """Per group, the first chunk whose object a resume at n chunks needs."""
    every = check_policy(policy) == "all"
    if layout.sliding_groups and chunk_tokens <= 0:
        raise ValueError("a layout with sliding-window groups needs chunk_tokens to know which chunks a resume reads")
    return [0 if g.kind == "attention" or (every and g.kind == "recurrent") else g.window_start_chunk(n, chunk_tokens)
            for g in layout.groups]


def resume_bytes(layout: ModelLayout, policy: str, n: int, skip: int, object_bytes: Sequence[int],
                 chunk_tokens: int = 0) -> int:
    """Bytes of resume_objects(layout, policy, n, skip, chunk_tokens) in O(groups), without building the list:
    a lookup counts what it hands out on every hit."""
    first = min(skip, n)
    total = sum(max(0, n - max(first, at)) * object_bytes[g]
                for g, at in enumerate(_resume_starts(layout, policy, n, chunk_tokens)))
    if n and skip >= n:
        total += sum(object_bytes[g] for g in layout.recurrent_groups)
    return total


def object_blocks(layout: ModelLayout, chunk_tokens: int, group: int, chunk: int,
                  block_ids: Sequence[int]) -> Sequence[int]:
    """The blocks of one group's block list that hold object (chunk, group): the chunk's blocks for
    attention, its last `tail_blocks` for a sliding-window group, its last block (the state after its last
    token) for a recurrent group."""
    grp = layout.groups[group]
    bpc = chunk_tokens // grp.block_tokens
    if len(block_ids) < (chunk + 1) * bpc:
        raise ValueError(f"group {group} has {len(block_ids)} block ids; chunk {chunk} needs "
                         f"{(chunk + 1) * bpc} ({bpc} per chunk of {chunk_tokens} tokens)")
    end = (chunk + 1) * bpc
    return block_ids[end - grp.tail_blocks(chunk_tokens):end]
