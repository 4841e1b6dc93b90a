"""What the scheduler side tells the workers each step: loads to run before the forward, stores after it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(slots=True)
class LoadJob:
    """Load the hit's objects into the blocks vLLM allocated for the request (one list per group)."""

    request_id: str
    token_ids: list[int]          # the hit's tokens: every chunk of them is loaded
    skip_tokens: int              # tokens vLLM already holds locally (prefix cache): their attention is not loaded
    block_ids: tuple[list[int], ...]
    extras: list[bytes] | None = None  # per chunk, what else decides its KV (cache salt, LoRA, images, embeds)


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
