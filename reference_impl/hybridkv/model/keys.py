"""Chunk keys: a rolling hash over the token prefix inside a namespace.

key_0 = H(namespace, tokens of chunk 0), key_i = H(key_{i-1}, tokens of chunk i), with H = BLAKE2b-128
over little-endian uint32 token ids. Nothing depends on PYTHONHASHSEED, so keys are the same in every
process and after restarts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np

from hybridkv.model.layout import LayoutError, ModelLayout

KEY_BYTES = 16
ObjectKey = tuple[bytes, int]  # (chunk key, group): one object, in L1, L2 and on the wire


def namespace(layout: ModelLayout, tp_rank: int, chunk_tokens: int, salt: str = "") -> bytes:
    """The 16-byte namespace of one engine rank: model, layout fingerprint, rank, chunk size, salt."""
    if not 0 <= tp_rank < layout.tp_size:
        raise LayoutError(f"tp_rank {tp_rank} outside [0, {layout.tp_size})")
    layout.check_chunk_tokens(chunk_tokens)
    fields = ("hybridkv-ns-v1", layout.model, layout.fingerprint(), layout.tp_size, tp_rank, chunk_tokens, salt)
    return hashlib.blake2b(msgspec.msgpack.encode(fields), digest_size=KEY_BYTES).digest()


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chunk_keys(ns: bytes, tokens: Sequence[int] | np.ndarray, chunk_tokens: int,
               extras: Sequence[bytes] | None = None) -> list[bytes]:
    """Keys of every full chunk of `tokens` (a trailing partial chunk has no key: it is never cached).

    `extras[i]`, where given and not empty, is what else decides chunk i's KV beside its tokens (under vLLM:
    the cache salt, LoRA adapter, images in the chunk, prompt embeddings): it enters key i, and through the
    chain every later key. Chunks without extras keep the token-only key."""
    if len(ns) != KEY_BYTES:
        raise ValueError(f"namespace must be {KEY_BYTES} bytes, got {len(ns)}")
    data = _token_bytes(tokens)
    step = 4 * chunk_tokens
    keys: list[bytes] = []
    prev = ns
    for i, off in enumerate(range(0, len(data) - step + 1, step)):
        extra = extras[i] if extras is not None and i < len(extras) else b""
        # after the fixed-length token bytes, a tagged length keeps (tokens, extra) pairs apart
        tail = b"x" + len(extra).to_bytes(4, "little") + extra if extra else b""
        prev = hashlib.blake2b(prev + data[off:off + step] + tail, digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys
