"""Bulk integers as int32 little-endian bytes (the protocol's packed fields; docs/protocol.md, Packed integers)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any

__all__ = ["pack_ints", "pack_pairs", "packed_field", "unpack_ints"]


def pack_ints(values: Iterable[int]) -> bytes:
    """int32 little-endian bytes of `values`; ValueError for one outside int32."""
    try:
        a = array("i", values)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"not an int32: {e}") from None
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_ints(blob: bytes) -> Sequence[int]:
    """The int32s of `blob` (its length a multiple of 4), without a copy on little-endian hosts."""
    if sys.byteorder == "little":
        return memoryview(blob).cast("i")
    a = array("i")
    a.frombytes(blob)
    a.byteswap()
    return a


def pack_pairs(pairs: Iterable[tuple[int, int]]) -> bytes:
    """(chunk, group) pairs as PrepareStore.objects sends them."""
    return pack_ints(chain.from_iterable(pairs))


def packed_field(value: Any, what: str, item_bytes: int = 4) -> bytes:
    """A packed field as sent, or its short list form packed (a message's `__post_init__`, on decode too); a
    ValueError unless it is whole items of `item_bytes` (4: int32s, 8: (chunk, group) pairs)."""
    if not isinstance(value, bytes):
        value = pack_ints(chain.from_iterable(value))
    if len(value) % item_bytes:
        raise ValueError(f"{what}: packed int32 {'pairs' if item_bytes == 8 else 'values'}, so a multiple of "
                         f"{item_bytes} bytes, not {len(value)}")
    return value
