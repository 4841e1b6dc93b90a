"""The object header every L2 adapter stores in front of a payload, and the payload checksum.

64 bytes: magic, version, data offset, group, namespace, key, payload length, payload CRC-32, then the
CRC-32 of those fields, so a torn or scribbled header is caught before its fields are trusted
(reference_impl/L2.md has the layout).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The payload checksum is CRC-32 (zlib's polynomial, the same value as `zlib.crc32`). ISA-L's
# carry-less-multiply implementation (the `isal` package) computes it several times faster than zlib's
# on the same core (L2.md, "File format", has the figures) and, like zlib, without the GIL, so
# checksumming keeps up with the disk even on a small, busy host; without the package zlib computes the
# same values (files stay interchangeable).
crc32: Callable[[Any, int], int]
try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives identical values
    crc32 = zlib.crc32
    CRC32_IMPL = "zlib"
else:
    crc32 = _isal_crc32
    CRC32_IMPL = "isal"

KEY_BYTES = 16
NS_BYTES = 16
MAX_GROUP = 0xFFFFFFFF  # groups are stored as u32


MAGIC = b"HKVL2OBJ"
FORMAT_VERSION = 1
# magic, version, header length, group, namespace, key, payload length, payload crc32; then the
# crc32 of those 60 bytes, so a torn or scribbled header is caught before its fields are trusted.
_FIELDS = struct.Struct("<8sHHI16s16sQI")
_HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _HEADER_CRC.size  # 64


class BadObject(Exception):
    """A stored object that must not be served: the message says what is wrong with it."""


@dataclass(slots=True, frozen=True)
class ObjectHeader:
    """The fixed 64-byte header in front of every object's payload, in every adapter."""

    ns: bytes
    key: bytes
    group: int
    payload_len: int
    payload_crc: int

    def pack(self, data_offset: int = HEADER_BYTES) -> bytes:
        """The 64 header bytes; `data_offset` (where the payload starts) is recorded in them."""
        fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, data_offset, self.group, self.ns, self.key,
                              self.payload_len, self.payload_crc)
        return fields + _HEADER_CRC.pack(crc32(fields, 0))

    @classmethod
    def unpack(cls, raw: bytes | memoryview, data_offset: int = HEADER_BYTES) -> ObjectHeader:
        """Parse and check a header written with `data_offset`; raises BadObject naming what is wrong."""
        if len(raw) < HEADER_BYTES:
            raise BadObject(f"header truncated: {len(raw)} of {HEADER_BYTES} bytes")
        fields = bytes(raw[:_FIELDS.size])
        magic, version, header_len, group, ns, key, payload_len, payload_crc = _FIELDS.unpack(fields)
        if magic != MAGIC:
            raise BadObject(f"bad magic {magic!r}")
        (header_crc,) = _HEADER_CRC.unpack_from(raw, _FIELDS.size)
        if crc32(fields, 0) != header_crc:
            raise BadObject("header checksum mismatch")
        if version != FORMAT_VERSION or header_len != data_offset:
            raise BadObject(f"format version {version} / data offset {header_len}, "
                            f"this reader knows {FORMAT_VERSION} / {data_offset}")
        return cls(ns, key, group, payload_len, payload_crc)

    def check_for(self, key: bytes, group: int, length: int, ns: bytes | None = None) -> None:
        """Raise BadObject unless this header is for (key, group) with `length` payload bytes (and of namespace
        `ns`, when given)."""
        if ns is not None and self.ns != ns:
            raise BadObject(f"header is of namespace {self.ns.hex()}, not {ns.hex()}")
        if self.key != key or self.group != group:
            raise BadObject(f"header is for {self.key.hex()}-{self.group}, not {key.hex()}-{group}")
        if self.payload_len != length:
            raise BadObject(f"header says {self.payload_len} payload bytes, expected {length}")
