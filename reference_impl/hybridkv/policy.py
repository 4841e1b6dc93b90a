"""The store / retrieve policy rule, in one place: which (chunk, group) objects a chunk range stores or
loads, and which of an engine's blocks hold each object.

- `boundary`: every attention object of every chunk, and the recurrent state only at the last chunk
  (what resuming the prefix needs: DESIGN's hit rule).
- `all`: every group's object for every chunk (the seed's behaviour).

The engine (what to store, where to copy), the server (what a lookup pins) and the harness's simulated
engine use these functions. The harness's expected-hit oracle (`hybridkv_bench.workloads`) keeps its
own independent statement of the rule on purpose: it checks this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Literal, cast, get_args

from hybridkv.layout import ModelLayout

Policy = Literal["boundary", "all"]
POLICIES: tuple[Policy, ...] = get_args(Policy)


def check_policy(policy: str) -> Policy:
    """The policy, or ValueError naming the bad value."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return cast(Policy, policy)


def chunk_objects(layout: ModelLayout, policy: str, first: int, n: int) -> list[tuple[int, int]]:
    """(chunk, group) objects of chunks first..n-1 under `policy`, chunk-major, groups in layout order.
    Recurrent groups appear at every chunk under `all`, at chunk n-1 only under `boundary`."""
    every = check_policy(policy) == "all"
    if first >= n:
        return []
    groups = range(len(layout.groups))
    # the same list as one comprehension over every (chunk, group) with the rule per pair, without asking
    # each group's kind per chunk: a server lookup of a long prompt builds it for every hit
    inner = groups if every else layout.attention_groups
    if len(inner) == 1:  # one attention group (every preset's boundary list): the pairs made in C
        head = list(zip(range(first, n - 1), repeat(inner[0])))
    else:
        head = [(c, g) for c in range(first, n - 1) for g in inner]
    return head + [(n - 1, g) for g in groups]


def resume_objects(layout: ModelLayout, policy: str, n: int, skip: int = 0) -> list[tuple[int, int]]:
    """Objects an engine loads to resume at n chunks when it already holds the first `skip` chunks'
    attention: chunks skip..n-1 under `policy`, plus the boundary state when every chunk is held."""
    out = chunk_objects(layout, policy, min(skip, n), n)
    if n and skip >= n:
        out.extend((n - 1, g) for g in layout.recurrent_groups)
    return out


def resume_bytes(layout: ModelLayout, policy: str, n: int, skip: int, object_bytes: Sequence[int]) -> int:
    """Bytes of resume_objects(layout, policy, n, skip) in O(groups), without building the list: a lookup
    counts what it hands out on every hit."""
    chunks = n - min(skip, n)
    attention = sum(object_bytes[g] for g in layout.attention_groups)
    recurrent = sum(object_bytes[g] for g in layout.recurrent_groups)
    every = check_policy(policy) == "all"
    return chunks * attention + (chunks if every else min(chunks, 1)) * recurrent + (recurrent if n and skip >= n
                                                                                    else 0)


def object_blocks(layout: ModelLayout, chunk_tokens: int, group: int, chunk: int,
                  block_ids: Sequence[int]) -> Sequence[int]:
    """The blocks of one group's block list that hold object (chunk, group): the chunk's blocks for
    attention, the chunk's last block (the state after its last token) for a recurrent group."""
    grp = layout.groups[group]
    bpc = chunk_tokens // grp.block_tokens
    if len(block_ids) < (chunk + 1) * bpc:
        raise ValueError(f"group {group} has {len(block_ids)} block ids; chunk {chunk} needs "
                         f"{(chunk + 1) * bpc} ({bpc} per chunk of {chunk_tokens} tokens)")
    if grp.kind == "attention":
        return block_ids[chunk * bpc:(chunk + 1) * bpc]
    return block_ids[(chunk + 1) * bpc - 1:(chunk + 1) * bpc]
