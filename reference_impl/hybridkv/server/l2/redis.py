"""Redis / Valkey L2: objects shared between hosts through one store, checked on every read.

Every object is one meta key and its data keys (`redis_meta` names them). A put writes the data keys,
then the meta key, in one pipeline: a reader that finds the meta finds a whole object or a damaged one
(a missing or short chunk, a checksum mismatch), which is a miss and is deleted, never served. The
store's own maxmemory policy evicts keys; an object with a key gone is a miss. While the store is
unreachable every call is a miss (puts raise `L2Error`) without touching the network, for a back-off
that doubles up to 8 s, with one log line per 10 s.

A meta is a claim by whoever can write the store, checked before it costs anything: a read names the keys of
the length the server expects (its layout's), whatever the meta claims (`_read`); removals and clears go by the
keys that exist (`redis_keys`), so a meta claiming 2**64 bytes costs one window, not a key name per chunk.

The server loop asks `length` for every object of a lookup, so lengths are kept in a local index (`redis_known`:
trusted for `index_ttl_s`, misses for `miss_ttl_s`) and `probe` fills it for many objects in one round trip; queries
from the loop use their own connections with a short timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import redis

from hybridkv.server.l2.base import L2Adapter, L2Error, byte_view, check_key, check_ns
from hybridkv.server.l2.header import BadObject, ObjectHeader, crc32
from hybridkv.server.l2.redis_cluster import ClusterLink, store_links
from hybridkv.server.l2.redis_keys import WINDOW, chunk_rounds, clear_batch
from hybridkv.server.l2.redis_known import KnownLengths
from hybridkv.server.l2.redis_link import DOWN, StoreHealth
from hybridkv.server.l2.redis_meta import Forged, MetaCodec

if TYPE_CHECKING:
    from hybridkv.server.l2.redis_spec import RedisL2Spec

log = logging.getLogger(__name__)

_MAX_INDEX = 1 << 20          # known lengths kept; the oldest are forgotten (and asked again)
_PROBE_BATCH = 1024           # meta keys per pipeline
_MAX_GROUP_SPAN = 16          # groups of one chunk probed together by length()
_COUNTERS = ("puts", "gets", "hits", "misses", "corrupt_removed", "forged", "evicted_seen", "bytes_written",
             "bytes_read", "store_errors", "probes")


class RedisL2(L2Adapter):
    """L2 on a Redis or Valkey server that several hybridkv servers may share (see the module doc)."""

    def __init__(self, spec: RedisL2Spec) -> None:
        self.spec = spec
        self._codec = MetaCodec(spec.prefix, spec.mac_key)
        self.capacity_bytes = 0  # the store's maxmemory bounds it, not us
        self._data, self._meta = store_links(spec)  # two redis.Redis clients, or two ClusterLinks (redis_cluster)
        self._lock = threading.Lock()  # the counters and `_closed`
        self._known = KnownLengths(spec.index_ttl_s, spec.miss_ttl_s, _MAX_INDEX)
        # A store that went away may come back empty (a restart): nothing known before it still holds.
        self._health = StoreHealth(spec.url, spec.retry_after_s, self._known.forget_all)
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        self._group_span = 1  # groups per chunk seen so far (length() probes them together)
        self._ex = spec.ttl_s or None
        try:
            self._data.ping()
        except DOWN as e:
            # A store that is down at start is a store that is down: misses until it comes back.
            self._health.failed("ping at start", e)

    def __repr__(self) -> str:
        return f"RedisL2({self.spec.url!r}, prefix={self.spec.prefix!r})"

    # ---- the L2Adapter interface ----

    def put(self, key: bytes, group: int, ns: bytes, data: memoryview | bytes) -> None:
        """Write the data keys then the meta key in one pipeline; skipped when the store has the object."""
        check_key(key, group)
        check_ns(ns)
        view = byte_view(data, writable=False)
        size = view.nbytes
        self._check_open()
        okey = (key, group)
        if self._known.fresh_length(okey, ns) == size:
            self._count(puts=1)
            return
        self._check_up("put")
        try:
            old: Any = self._data.get(self._codec.meta_key(key, group))
            hdr: ObjectHeader | None = self._codec.parse(old, key, group)[0] if old is not None else None
        except BadObject:
            hdr = None  # overwritten below
        except DOWN as e:
            self._down("put", e)
        if hdr is not None and hdr.ns != ns:
            self._known.remember(okey, hdr.payload_len, hdr.ns)
            raise L2Error(f"object {key.hex()}-{group} is held under another namespace: not replaced")
        if hdr is not None and hdr.payload_len == size:
            self._known.remember(okey, size, ns)  # another host stored it: same key, same bytes
            self._count(puts=1)
            self._health.ok()
            return
        cb = self.spec.chunk_bytes
        meta = self._codec.pack(ObjectHeader(ns, key, group, size, crc32(view, 0)), cb, view)
        names = self._codec.data_keys(key, group, size, cb)
        pipe = self._data.pipeline(transaction=False)
        for i, name in enumerate(names):
            pipe.set(name, view[i * cb:(i + 1) * cb], ex=self._ex)  # memoryview slices: sent without a copy
        pipe.set(self._codec.meta_key(key, group), meta, ex=self._ex)
        try:
            res = pipe.execute(raise_on_error=False)
        except DOWN as e:
            self._down("put", e)
        errors = [r for r in res if isinstance(r, Exception)]
        if errors:
            self._delete_quietly([self._codec.meta_key(key, group), *names])
            self._count(store_errors=1)
            raise L2Error(f"redis L2 {self.spec.url} refused object {key.hex()}-{group} ({size} B): {errors[0]}")
        self._health.ok()
        self._known.remember(okey, size, ns)
        self._count(puts=1, bytes_written=size)

    def get_into(self, key: bytes, group: int, out: memoryview, ns: bytes | None = None) -> bool:
        """Read meta and chunks in one pipeline, check header (and namespace), sizes and the crc32 into `out`."""
        check_key(key, group)
        out = byte_view(out, writable=True)
        self._check_open()
        okey = (key, group)
        known = self._known.fresh_length(okey)
        if known is not None and known != out.nbytes:
            raise ValueError(f"out is {out.nbytes} bytes but object {key.hex()}-{group} is {known} bytes")
        self._count(gets=1)
        if not self._health.up():
            self._count(misses=1)
            return False
        try:
            ok = self._read(key, group, out, ns)
        except DOWN as e:
            self._health.failed("get", e)
            self._count(misses=1, store_errors=1)
            return False
        except Forged as e:
            log.warning("L2 redis: removed forged object %s-%d: %s", key.hex(), group, e)
            self._count(misses=1, forged=1)
            return False
        except BadObject as e:
            log.warning("L2 redis: removed bad object %s-%d: %s", key.hex(), group, e)
            self._count(misses=1, corrupt_removed=1)
            return False
        self._health.ok()
        if not ok:
            self._count(misses=1)
            return False
        self._count(hits=1, bytes_read=out.nbytes)
        return True

    def length(self, key: bytes, group: int, ns: bytes | None = None) -> int | None:
        """The object's payload length, from the local index or one short query; None when missing or down (or
        of another namespace than `ns`)."""
        check_key(key, group)
        self._check_open()
        okey = (key, group)
        fresh, known = self._known.fresh(okey, ns)
        if fresh:
            return known
        # The loop asks for every group of a chunk in turn: one round trip answers them all.
        self._group_span = min(max(self._group_span, group + 1), _MAX_GROUP_SPAN)
        self.probe([okey, *((key, g) for g in range(self._group_span) if g != group)])
        return self._known.length(okey, ns)

    def probe(self, oids: list[tuple[bytes, int]]) -> None:
        """Fetch the meta keys of the objects not freshly known, in pipelines, into the index."""
        self._check_open()
        todo = self._known.stale(oids)
        if not todo or not self._health.up():
            return
        self._count(probes=1)
        bad: list[tuple[bytes, int, bool]] = []  # key, group, forged
        try:
            for i in range(0, len(todo), _PROBE_BATCH):
                batch = todo[i:i + _PROBE_BATCH]
                metas: list[Any] = self._meta.mget([self._codec.meta_key(k, g) for k, g in batch])
                for (k, g), raw in zip(batch, metas, strict=True):
                    if raw is None:
                        self._known.remember((k, g), None, b"")
                        continue
                    try:
                        hdr, _ = self._codec.parse(raw, k, g)
                    except BadObject as e:
                        bad.append((k, g, isinstance(e, Forged)))
                        self._known.remember((k, g), None, b"")
                        continue
                    self._known.remember((k, g), hdr.payload_len, hdr.ns)
        except DOWN as e:
            self._health.failed("index query", e)
            self._count(store_errors=1)
            return
        self._health.ok()
        for k, g, forged in bad:
            log.warning("L2 redis: removed object %s-%d with a %s", k.hex(), g, "meta without a MAC" if forged
                        else "bad header")
            base = self._codec.data_base(k, g)  # of a length it cannot tell: a window of its chunks, in one command
            self._delete_quietly([self._codec.meta_key(k, g), *(f"{base}{i}" for i in range(WINDOW))])
            self._count(**{"forged" if forged else "corrupt_removed": 1})

    def remove(self, key: bytes, group: int) -> bool:
        """Delete the object's meta, then its data keys (`redis_keys.chunk_rounds`); True if the meta key existed."""
        check_key(key, group)
        self._check_open()
        self._check_up("remove")
        length = self._known.fresh_length((key, group))
        chunks: int | None = 0 if length is None else -(-length // self.spec.chunk_bytes)
        try:
            raw: Any = self._data.get(self._codec.meta_key(key, group))
            if raw is not None:
                try:
                    hdr, cb = self._codec.parse(raw, key, group)
                    chunks = max(chunks or 0, -(-hdr.payload_len // cb))
                except BadObject:
                    chunks = None  # how many it had cannot be told
            removed = self._data.delete(self._codec.meta_key(key, group))
            sum(chunk_rounds(self._data, "unlink", [(self._codec.data_base(key, group), chunks)]))  # every round
        except DOWN as e:
            self._down("remove", e)
        self._known.forget((key, group))
        return raw is not None and removed > 0

    def clear_walk(self, namespaces: frozenset[bytes] | None) -> Iterator[dict[bytes, int]]:
        """Delete every object of `namespaces` under our prefix (every object under it when None), a SCAN batch
        of _PROBE_BATCH names per piece; what this server knows of the store is forgotten at the end."""
        self._check_open()
        self._check_up("clear")
        try:
            batch: list[bytes] = []
            for name in self._data.scan_iter(match=self._codec.scan_match(), count=1000):
                batch.append(name)
                if len(batch) >= _PROBE_BATCH:
                    yield from clear_batch(self._data, self._codec, batch, namespaces)
                    batch = []
            yield from clear_batch(self._data, self._codec, batch, namespaces)
        except DOWN as e:
            self._down("clear", e)
        finally:  # also when a Clear stops mid-way
            self._known.forget_all()

    def touch(self, key: bytes, group: int) -> None:
        """Refresh the keys' LRU clock in the store (TOUCH); a no-op when missing or down."""
        check_key(key, group)
        self._check_open()
        length = self._known.fresh_length((key, group))
        if length is None or not self._health.up():
            return
        try:
            self._data.touch(self._codec.meta_key(key, group))
            chunks = -(-length // self.spec.chunk_bytes)  # a probe may have learnt `length` from any meta
            sum(chunk_rounds(self._data, "touch", [(self._codec.data_base(key, group), chunks)]))  # every round
        except DOWN as e:
            self._health.failed("touch", e)

    def stats(self) -> dict[str, int]:
        """Counters, the objects this server knows the store holds, and whether the store is up."""
        objects, held_bytes = self._known.totals()
        with self._lock:
            return {"objects": objects, "bytes": held_bytes,
                    "capacity_bytes": self.capacity_bytes, "store_up": int(self._health.up()),
                    **self._counters, **(self._data.stats() if isinstance(self._data, ClusterLink) else {})}

    def close(self) -> None:
        """Close the connections; the store keeps the objects for other servers and restarts."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for c in (self._data, self._meta):
            c.connection_pool.disconnect()

    # ---- internals ----

    def _read(self, key: bytes, group: int, out: memoryview, ns: bytes | None) -> bool:
        """Fill `out` from the store; False for a missing object (or one of another namespace than `ns`: another
        tenant's, kept), BadObject for a damaged one, once its keys are deleted.

        The meta comes with the chunks our chunk size names; one of another chunk size costs one more round trip.
        The meta names no key before its chunk size is checked against the range any writer may use and its length
        against `out`'s (the server's layout's): at most out.nbytes / 64 KiB + 1 keys are read or deleted, whatever
        it claims. The MAC covers the payload: checked once those chunks are read, before a byte is served."""
        size, cb = out.nbytes, self.spec.chunk_bytes
        smallest = cb  # the smallest chunk size this object's keys may be named for (its removal names them all)
        try:
            meta, chunks = self._fetch(key, group, size, cb)
            if meta is None:
                # Chunks without a meta may be a put in flight: left alone (the store's LRU or TTL takes orphans).
                self._known.forget((key, group))
                return False
            hdr, their_cb = self._codec.parse(meta, key, group)
            if ns is not None and hdr.ns != ns:
                self._known.remember((key, group), hdr.payload_len, hdr.ns)
                return False
            hdr.check_for(key, group, size)
            if their_cb != cb:  # written by a server with another chunk size: its keys, once
                smallest = min(cb, their_cb)
                again, chunks = self._fetch(key, group, size, their_cb)
                if again != meta:  # replaced or removed meanwhile: a miss, not damage (and no third try)
                    self._known.forget((key, group))
                    return False
                cb = their_cb
            pos = 0
            for i, c in enumerate(chunks):
                want = min(cb, size - pos)
                if c is None:
                    self._count(evicted_seen=1)
                    raise BadObject(f"chunk {i} of {len(chunks)} is gone (evicted by the store?)")
                if len(c) != want:
                    raise BadObject(f"chunk {i} is {len(c)} bytes, expected {want}")
                out[pos:pos + want] = c
                pos += want
            if crc32(out, 0) != hdr.payload_crc:
                raise BadObject("payload checksum mismatch")
            self._codec.check_mac(meta, out)
        except BadObject:
            self._known.forget((key, group))
            self._delete_quietly([self._codec.meta_key(key, group),
                                  *self._codec.data_keys(key, group, size, smallest)])
            raise
        self._known.remember((key, group), size, hdr.ns)
        return True

    def _fetch(self, key: bytes, group: int, size: int, cb: int) -> tuple[Any, list[Any]]:
        """The meta value and the `size` bytes' chunks of `cb` bytes, in one pipeline (None where missing)."""
        pipe = self._data.pipeline(transaction=False)
        pipe.get(self._codec.meta_key(key, group))
        for name in self._codec.data_keys(key, group, size, cb):
            pipe.get(name)
        meta, *chunks = pipe.execute(raise_on_error=False)
        err = next((x for x in (meta, *chunks) if isinstance(x, Exception)), None)
        if err is not None:
            raise BadObject(f"the store answered {type(err).__name__}: {err}")
        return meta, chunks

    def _delete_quietly(self, names: list) -> None:
        try:
            self._data.unlink(*names)
        except (redis.RedisError, OSError) as e:
            log.debug("L2 redis: cannot delete %d keys: %s", len(names), e)

    def _count(self, **inc: int) -> None:
        with self._lock:
            for name, n in inc.items():
                self._counters[name] += n

    def _check_open(self) -> None:
        if self._closed:
            raise L2Error(f"{self!r} is closed")

    def _check_up(self, what: str) -> None:
        if not self._health.up():
            raise L2Error(f"redis L2 {self.spec.url} is unreachable: {what} refused for "
                          f"{self._health.down_until - time.monotonic():.1f} s more")

    def _down(self, what: str, exc: BaseException) -> NoReturn:
        """Record a connection failure and raise L2Error for it."""
        self._health.failed(what, exc)
        self._count(store_errors=1)
        raise L2Error(f"redis L2 {self.spec.url} unreachable during {what}: {type(exc).__name__}: {exc}") from exc
