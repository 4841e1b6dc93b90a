"""What the scheduler side tells the workers each step: loads to run before the forward, stores after it."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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
