"""What the scheduler side tells the workers each step: loads to run before the forward, stores after it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from hybridkv_kernels import HOLE
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hybridkv.model.layout import ModelLayout

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from hybridkv.wire import protocol as P


@dataclass(slots=True)
class PinnedHit:
    """The scheduler side's lookup of a hit, handed down to the workers: its objects stay pinned under the
    scheduler's leases until the request ends, so a worker copies them out of the arena it maps with no lookup
    of its own (a round trip on every warm request's path)."""

    arena: str  # the arena file of the server that pinned them (a server restarted since has another)
    objects: list[list[P.ObjectLoc]]  # per tensor-parallel rank, in retrieve order


@dataclass(slots=True)
class LoadJob:
    """Load the hit's objects into the blocks vLLM allocated for the request (one list per group)."""

    request_id: str
    token_ids: list[int]          # the hit's tokens: every chunk of them is loaded
    skip_tokens: int              # tokens vLLM already holds locally (prefix cache): their attention is not loaded
    block_ids: tuple[list[int], ...]  # the blocks to write, HOLE where vLLM holds KV already or none (`load_block_ids`)
    extras: list[bytes] | None = None  # per chunk, what else decides its KV (cache salt, LoRA, images, embeds)
    refused: str = ""  # why the hit's objects cannot fill vLLM's blocks: the worker fails the load (a recompute)
    pinned: PinnedHit | None = None  # the scheduler's pins of the hit; None: each worker looks it up itself


@dataclass(slots=True)
class StoreJob:
    """Store chunks start_chunk.. of token_ids, with the recurrent state at their end in the blocks vLLM offered."""

    request_id: str
    token_ids: list[int]
    start_chunk: int
    block_ids: tuple[list[int], ...]
    extras: list[bytes] | None = None


@dataclass
class HybridKVMetadata(KVConnectorMetadata):
    """One scheduler step's transfers."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    # load_mode layerwise: requests whose held attention pages are copied in this step, before its forward reads
    # them, layer by layer (`layerwise.promoted`: vLLM took them out of WAITING_FOR_REMOTE_KVS this step)
    step_loads: list[str] = field(default_factory=list)
    # how often the scheduler side registered again (the server restarted or came back): a worker seeing a new
    # value checks its own registration before this step's loads and stores (`WorkerSide._follow_scheduler`)
    server_epoch: int = 0


def chunk_extras(request: Request, n_chunks: int, chunk_tokens: int) -> list[bytes] | None:
    """Per chunk, what else vLLM's own prefix cache keys a block by (vLLM's own function: cache salt, LoRA name
    and path, multimodal inputs in the chunk, prompt embeddings), encoded stably; None when a request has none.
    Chunk keys carry them, so tenants with different `cache_salt`s, adapters or images never share KV."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    out: list[bytes] = []
    mm_idx = 0
    for i in range(n_chunks):
        extra, mm_idx = generate_block_hash_extra_keys(request, i * chunk_tokens, (i + 1) * chunk_tokens, mm_idx)
        out.append(msgspec.msgpack.encode(extra) if extra else b"")
    return out if any(out) else None


# vLLM's null block (BlockPool.null_block, the first block of the pool): what a block table holds where the request
# keeps no block, e.g. a sliding-window layer's positions outside the window.
VLLM_NULL_BLOCK = 0


def block_ids_from_vllm(layout: ModelLayout, block_ids) -> tuple[list[int], ...]:
    """vLLM's per-group block ids with its null block turned into hybridkv's HOLE in attention and sliding-window
    groups: a store then leaves out every object that would read one, a load writes nothing there. (Recurrent
    groups keep theirs: only the state block vLLM names is ever read.)"""
    return tuple([HOLE if b == VLLM_NULL_BLOCK else b for b in ids] if g.kind != "recurrent" else list(ids)
                 for g, ids in zip(layout.groups, block_ids, strict=True))


class LoadRefused(LookupError):
    """vLLM expects KV in a block that no object of the hit carries: the load must not run (a recompute)."""


def load_job(layout: ModelLayout, chunk_tokens: int, request_id: str, token_ids: list[int], skip_tokens: int,
             vllm_block_ids, extras: list[bytes] | None, pinned: PinnedHit | None = None) -> LoadJob:
    """The load of a hit into the blocks vLLM allocated for it (`load_block_ids`), or, where those blocks ask for
    KV the hit's objects lack, a refused one (`refused` says why)."""
    job = LoadJob(request_id, token_ids, skip_tokens, block_ids_from_vllm(layout, vllm_block_ids), extras,
                  pinned=pinned)
    try:
        job.block_ids = load_block_ids(layout, chunk_tokens, job)
    except LoadRefused as e:
        job.refused = str(e)
    return job


def load_block_ids(layout: ModelLayout, chunk_tokens: int, job: LoadJob) -> tuple[list[int], ...]:
    """The blocks a load writes, per group: HOLE for every block vLLM already holds (its local prefix-cache hit,
    below `skip_tokens`) or holds none of (outside a sliding window). LoadRefused when vLLM allocated a block the
    hit's objects do not carry (a sliding-window block outside the chunk tails hybridkv stores, or before the
    window's first chunk): left unwritten, that block would hold KV vLLM takes for real."""
    hit = len(job.token_ids)
    out = []
    for g, (grp, ids) in enumerate(zip(layout.groups, job.block_ids, strict=True)):
        if grp.kind == "recurrent":
            out.append(ids)
            continue
        b = grp.block_tokens
        local = job.skip_tokens // b
        ids = [HOLE] * min(local, len(ids)) + list(ids[local:])
        if grp.kind == "sliding":
            bpc, tail = chunk_tokens // b, grp.tail_blocks(chunk_tokens)
            first = grp.window_start_chunk(hit // chunk_tokens, chunk_tokens)
            for j in range(local, min(len(ids), hit // b)):
                c = j // bpc
                if ids[j] != HOLE and (c < first or j < (c + 1) * bpc - tail):
                    raise LoadRefused(
                        f"vLLM expects the KV of tokens [{j * b}, {(j + 1) * b}) of sliding-window group {g} "
                        f"(window {grp.window}) for a hit of {hit} tokens, which hybridkv does not store: it keeps "
                        f"the last {tail} blocks of each chunk from chunk {first} on")
        out.append(ids)
    return tuple(out)


def boundary_stores(layout: ModelLayout, chunk_tokens: int, req: Request, offers: list[tuple[int, int, int]],
                    blocks, stored_chunks: int) -> list[StoreJob]:
    """A hybrid's stores: one per boundary vLLM offers (`boundary_state_offloads`: (group, block, tokens)) that ends
    a chunk past `stored_chunks` and has a state for every recurrent group, the state read from the exact block
    vLLM names, with the chunks' attention and sliding-window blocks up to it."""
    recurrent = set(layout.recurrent_groups)
    by_boundary: dict[int, dict[int, int]] = {}
    for group, block_id, boundary in offers:
        if boundary % chunk_tokens == 0 and group in recurrent:
            by_boundary.setdefault(boundary, {})[group] = block_id
    jobs = []
    for boundary in sorted(by_boundary):
        states = by_boundary[boundary]
        n = boundary // chunk_tokens
        if set(states) != recurrent or n <= stored_chunks or boundary > req.num_tokens:
            continue
        ids = block_ids_from_vllm(layout, blocks)
        for g, block_id in states.items():
            # the state is where vLLM says it is, not where its position would put it
            at = n * (chunk_tokens // layout.groups[g].block_tokens) - 1
            if len(ids[g]) <= at:
                ids[g].extend([0] * (at + 1 - len(ids[g])))
            ids[g][at] = block_id
        if any(len(ids[g]) < n * (chunk_tokens // grp.block_tokens) for g, grp in enumerate(layout.groups)):
            continue
        jobs.append(StoreJob(req.request_id, list(req.all_token_ids[:boundary]), stored_chunks, ids,
                             chunk_extras(req, n, chunk_tokens)))
        stored_chunks = n
    return jobs


def step_stores(layout: ModelLayout, chunk_tokens: int, req: Request, end: int, blocks,
                stored_chunks: int) -> list[StoreJob]:
    """A model without recurrent groups (attention and sliding windows: Gemma 3, gpt-oss): a chunk is resumable as
    soon as its KV is computed, so the step whose forward computes tokens up to `end` stores the chunks it
    completes, in that step, while their sliding-window blocks are all held (vLLM frees a block that leaves the
    window at a later step's start)."""
    n = end // chunk_tokens
    if n <= stored_chunks or any(len(blocks[g]) < n * (chunk_tokens // grp.block_tokens)
                                 for g, grp in enumerate(layout.groups)):
        return []
    return [StoreJob(req.request_id, list(req.all_token_ids[:n * chunk_tokens]), stored_chunks,
                     block_ids_from_vllm(layout, blocks), chunk_extras(req, n, chunk_tokens))]
