"""The lookup the latency benchmarks time (a 71-chunk lookup, on CPU-sized objects): 71 chunks of
tiny-hybrid, every group of every chunk stored, so a lookup of them is a full hit."""

from __future__ import annotations

import numpy as np
from hybridkv.engine.client import CacheClient
from hybridkv.model.keys import chunk_keys
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P

CHUNKS = 71
CHUNK_TOKENS = 80  # tiny-hybrid's default chunk


def store_chunks(client: CacheClient, chunks: int = CHUNKS) -> tuple[int, list[bytes]]:
    """Register a tiny-hybrid engine on `client` and store `chunks` chunks of it (unless a store before did);
    returns the engine id and the chunks' keys."""
    layout = preset_layout("tiny-hybrid")
    reg, _ = client.call(P.Register(layout=layout, chunk_tokens=0))
    keys = chunk_keys(reg.namespace, np.arange(chunks * CHUNK_TOKENS) % 5000, CHUNK_TOKENS)
    prep, _ = client.call(P.PrepareStore(engine=reg.engine, request="s", keys=keys, objects=[
        (k, g) for k in range(chunks) for g in range(len(layout.groups))]))
    if prep.slots:
        client.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation))
    return reg.engine, keys
