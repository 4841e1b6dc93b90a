"""The Redis L2's names and meta values: what key holds what, and the meta value's bytes.

Keys (all under the configured prefix, one deployment or tenant per prefix):

    <prefix>m:{<key hex>-<group>}      the 64-byte ObjectHeader (as in FilesystemL2) + u32 chunk size
                                       (+ a 32-byte HMAC-SHA256 on a server with a MAC key)
    <prefix>d:{<key hex>-<group>}:<i>  payload bytes [i * chunk, (i + 1) * chunk)

`{<key hex>-<group>}` is the keys' hash tag: on a Redis Cluster every key of one object is in one slot, so on one
node, and one pipeline reads or writes the whole object (a prefix holds no braces: specs checks it).

A meta value is a claim by whoever could write the store: `parse` refuses a chunk size outside the range any
writer may be configured with, so a reader's keys number at most the expected length / 64 KiB, and `cleared`
hands out chunk counts, never a list of names built from a claimed length.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from typing import Any

from hybridkv.server.l2.header import HEADER_BYTES, KEY_BYTES, BadObject, ObjectHeader

CHUNK = struct.Struct("<I")
MIN_CHUNK_BYTES = 64 * 1024   # the chunk sizes a writer may be configured with (RedisL2Spec.chunk_bytes)
MAX_CHUNK_BYTES = 512 << 20
META_BYTES = HEADER_BYTES + CHUNK.size
MAC_BYTES = 32  # HMAC-SHA256, after the chunk size, in the meta of a server with a MAC key
_META_NAME = re.compile(rb"m:\{[0-9a-f]{%d}-[0-9]{1,9}\}" % (2 * KEY_BYTES))


class Forged(BadObject):
    """An object without a valid MAC, on a server that has the key: never served."""


class MetaCodec:
    """The key names under one prefix, and meta values packed and checked with one MAC key (or none)."""

    def __init__(self, prefix: str, mac_key: bytes) -> None:
        self.prefix, self.mac_key = prefix, mac_key
        self._prefix_bytes = prefix.encode()

    def meta_key(self, key: bytes, group: int) -> str:
        return f"{self.prefix}m:{{{key.hex()}-{group}}}"

    def data_base(self, key: bytes, group: int) -> str:
        """The data keys' names without their index."""
        return f"{self.prefix}d:{{{key.hex()}-{group}}}:"

    def data_keys(self, key: bytes, group: int, size: int, cb: int) -> list[str]:
        """Every data key of an object of `size` bytes in chunks of `cb`: for a size the caller expects, never one
        a meta claims (it may claim 2**64 bytes)."""
        base = self.data_base(key, group)
        return [f"{base}{i}" for i in range(-(-size // cb))]

    def scan_match(self) -> bytes:
        """SCAN MATCH's pattern for our meta keys: the prefix with glob metacharacters escaped."""
        return "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix).encode() + b"m:*"

    def is_meta_name(self, name: bytes) -> bool:
        """Whether all of `name` after the prefix is our meta key's grammar: SCAN's glob also matches other
        prefixes that extend ours ("t" + "m:*" is all of tenant "tm:")."""
        return _META_NAME.fullmatch(name, len(self._prefix_bytes)) is not None

    def pack(self, header: ObjectHeader, cb: int, payload: memoryview) -> bytes:
        meta = header.pack() + CHUNK.pack(cb)
        return meta + self.mac(meta, payload) if self.mac_key else meta

    def mac(self, meta: bytes, payload: memoryview) -> bytes:
        """HMAC-SHA256 over the meta (header: namespace, key, group, length, crc; chunk size) and the payload."""
        mac = hmac.new(self.mac_key, meta, hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def check_mac(self, meta: bytes, payload: memoryview) -> None:
        if self.mac_key and not hmac.compare_digest(meta[META_BYTES:], self.mac(meta[:META_BYTES], payload)):
            raise Forged("no valid MAC: not written by a server with our key")

    def parse(self, raw: bytes, key: bytes, group: int) -> tuple[ObjectHeader, int]:
        """The header and chunk size of (key, group)'s meta value; BadObject (Forged) naming what is wrong."""
        want = META_BYTES + (MAC_BYTES if self.mac_key else 0)
        if len(raw) != want:
            if self.mac_key and len(raw) == META_BYTES:
                raise Forged("no MAC: written by a server without our key, or by someone else")
            raise BadObject(f"meta value is {len(raw)} bytes, expected {want}")
        hdr = ObjectHeader.unpack(raw[:HEADER_BYTES])
        if hdr.key != key or hdr.group != group:
            raise BadObject(f"meta is for {hdr.key.hex()}-{hdr.group}")
        (cb,) = CHUNK.unpack_from(raw, HEADER_BYTES)
        if not MIN_CHUNK_BYTES <= cb <= MAX_CHUNK_BYTES:
            raise BadObject(f"chunk size {cb} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]: no writer's")
        return hdr, cb

    def cleared(self, metas: list[bytes], values: list[Any], namespaces: frozenset[bytes] | None
                ) -> tuple[list[bytes], list[tuple[str, int | None]], dict[bytes, int]]:
        """For a clear of `namespaces` (every one when None), among these meta keys of ours and their values: the
        meta keys to delete, the data keys' names without their index with the chunk count each meta claims (None
        where its chunk size is no writer's), and how many objects they are per namespace."""
        names: list[bytes] = []
        chunks: list[tuple[str, int | None]] = []
        counts: dict[bytes, int] = {}
        for name, raw in zip(metas, values, strict=True):
            if raw is None:
                continue
            try:
                hdr = ObjectHeader.unpack(raw[:HEADER_BYTES])
                (cb,) = CHUNK.unpack_from(raw, HEADER_BYTES)
            except (BadObject, struct.error):
                if namespaces is None:
                    names.append(name)  # damaged, and its name is ours: gone in a clear of everything
                continue  # whose namespace it was cannot be told: not for a clear of one namespace
            if name != self.meta_key(hdr.key, hdr.group).encode():
                continue  # a header copied under another name: not the object this name stands for
            if namespaces is not None and hdr.ns not in namespaces:
                continue
            names.append(name)
            n = -(-hdr.payload_len // cb) if MIN_CHUNK_BYTES <= cb <= MAX_CHUNK_BYTES else None
            chunks.append((self.data_base(hdr.key, hdr.group), n))
            counts[hdr.ns] = counts.get(hdr.ns, 0) + 1
        return names, chunks, counts
