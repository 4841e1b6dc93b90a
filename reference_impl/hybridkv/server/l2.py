"""The L2 tier: where objects evicted from the L1 shared-memory arena go, and where lookups refill L1 from.

An object is one (chunk key, group) pair: 16 key bytes and a group index, plus the 16-byte namespace of
the engine family it belongs to (kept for clear-by-namespace and statistics; the key already hashes
the namespace in, so it takes no part in identity). Payloads are opaque bytes.

`L2Adapter` is the interface the server's worker threads call, concurrently: `FilesystemL2` (in
`l2_fs`) on a local directory, `RedisL2` (in `l2_redis`) on a Redis/Valkey shared between hosts. Both
store the same checksummed `ObjectHeader` in front of every payload. `make_l2` builds the configured one.
"""

from __future__ import annotations

import abc
import os
import stat
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.server.config import ServerConfig

# The payload checksum is CRC-32 (zlib's polynomial, the same value as `zlib.crc32`). ISA-L's
# carry-less-multiply implementation (the `isal` package) computes it about 6x faster than zlib's on
# the same core and, like zlib, without the GIL, so checksumming keeps up with the disk even on a
# small, busy host; without the package zlib computes the same values (files stay interchangeable).
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


class L2Error(Exception):
    """The L2 tier cannot do what was asked: no room, a disk error, an unusable directory, closed."""


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

    def check_for(self, key: bytes, group: int, length: int) -> None:
        """Raise BadObject unless this header is for (key, group) with `length` payload bytes."""
        if self.key != key or self.group != group:
            raise BadObject(f"header is for {self.key.hex()}-{self.group}, not {key.hex()}-{group}")
        if self.payload_len != length:
            raise BadObject(f"header says {self.payload_len} payload bytes, expected {length}")


def check_key(key: bytes, group: int) -> None:
    """Reject a key that is not 16 bytes or a group outside u32, naming the value."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        shown = len(key) if isinstance(key, bytes | bytearray | memoryview) else type(key).__name__
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {shown!r} ({key!r:.60})")
    if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group <= MAX_GROUP:
        raise ValueError(f"group must be an int in [0, {MAX_GROUP}], got {group!r}")


def check_ns(ns: bytes) -> None:
    """Reject a namespace that is not 16 bytes, naming the value."""
    if not isinstance(ns, bytes) or len(ns) != NS_BYTES:
        raise ValueError(f"namespace must be {NS_BYTES} bytes, got {ns!r:.60}")


def byte_view(buf: memoryview | bytes | bytearray, *, writable: bool) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer, without copying it."""
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError(f"buffer must be C-contiguous, got shape {mv.shape} strides {mv.strides}")
    if writable and mv.readonly:
        raise ValueError("output buffer is read-only")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


class L2Adapter(abc.ABC):
    """A capacity-bounded, LRU-evicting object store below L1. Every method is thread-safe."""

    @abc.abstractmethod
    def put(self, key: bytes, group: int, ns: bytes, data: memoryview | bytes) -> None:
        """Store an object; once this returns, a SIGKILL of this process does not lose it.

        Idempotent: a second put of an object already held is a no-op. Evicts least-recently-used
        objects to make room. Raises `L2Error` with the reason when it cannot store the object.
        """

    @abc.abstractmethod
    def get_into(self, key: bytes, group: int, out: memoryview) -> bool:
        """Read an object into `out` (writable, exactly the object's length) and verify its checksum.

        True on success. A missing or damaged object is a miss (False): a damaged one is removed and
        never served. `out`'s contents are unspecified after False. A wrong-sized `out` is a
        `ValueError` (the caller's bug, not the store's).
        """

    @abc.abstractmethod
    def contains(self, key: bytes, group: int) -> bool:
        """Whether the object is held (from the index; no I/O)."""

    @abc.abstractmethod
    def length(self, key: bytes, group: int) -> int | None:
        """The object's payload length, or None when it is not held (from the index; no I/O)."""

    @abc.abstractmethod
    def remove(self, key: bytes, group: int) -> bool:
        """Drop an object; True if it was held."""

    @abc.abstractmethod
    def clear(self, ns: bytes | None = None) -> int:
        """Drop every object of namespace `ns` (every object when None); returns how many."""

    @abc.abstractmethod
    def touch(self, key: bytes, group: int) -> None:
        """Mark an object as just used, so LRU eviction takes it last. No-op when not held."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters and gauges: objects, bytes, capacity_bytes, puts, gets, hits, misses,
        corrupt_removed, evictions, bytes_written, bytes_read (adapters may add more)."""

    def probe(self, oids: list[tuple[bytes, int]]) -> None:
        """Warm the index for these objects in one round trip, so the `length` calls after it do no I/O.

        A no-op for adapters whose index is local; the server calls it before a lookup or a store walks
        its objects one by one.
        """
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store's resources; later calls other than stats() raise `L2Error`. Idempotent."""

    def __enter__(self) -> L2Adapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


GIB = 1 << 30
MIB = 1 << 20


class L2ConfigError(ValueError):
    """An L2 adapter setting that cannot work; the message names the setting and the value."""


MIN_MAC_KEY_BYTES = 16


def read_secret(path: str, what: str, content: bool = True) -> bytes:
    """A password or key from a file only its owner can read (surrounding whitespace dropped); with
    `content` False only that check (a TLS key, which OpenSSL reads itself)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise L2ConfigError(f"--l2-adapter {what} {path}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise L2ConfigError(f"--l2-adapter {what} {path} is open to other users (mode "
                                f"{oct(stat.S_IMODE(st.st_mode))}); chmod 600 it")
        if not content:
            return b""
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(1 << 16).strip()
    finally:
        os.close(fd)
    if not data:
        raise L2ConfigError(f"--l2-adapter {what} {path} is empty")
    return data


@dataclass(frozen=True, slots=True)
class FsL2Spec:
    """A filesystem L2: `base_path`, a payload capacity, and whether every file is fsynced."""

    base_path: str
    capacity_bytes: int
    fsync: bool = False

    def __post_init__(self) -> None:
        if not self.base_path:
            raise L2ConfigError("fs L2 needs a base_path (a directory)")
        if self.capacity_bytes <= 0:
            raise L2ConfigError(f"fs L2 capacity must be positive, got {self.capacity_bytes} B")


@dataclass(frozen=True, slots=True)
class RedisL2Spec:
    """A Redis/Valkey L2 shared between hosts; capacity and eviction are the store's own (maxmemory)."""

    url: str
    prefix: str = "hybridkv:"        # every key starts with it: one deployment or tenant per prefix
    chunk_bytes: int = 8 * MIB       # a larger value is split into keys of this size (one request each)
    timeout_s: float = 5.0           # one object's SET/GET pipeline, on a worker thread
    meta_timeout_s: float = 0.05     # one index query, on the server loop: a slow store costs hits, not a stall
    connect_timeout_s: float = 0.5
    max_connections: int = 16
    ttl_s: int = 0                   # 0: keys never expire (use allkeys-lru); else SET EX, for volatile-* policies
    index_ttl_s: float = 2.0         # how long a known length is trusted before the store is asked again
    miss_ttl_s: float = 0.25         # how long a known miss is trusted (another host may store it meanwhile)
    retry_after_s: float = 0.5       # after a connection failure, everything is a miss this long (doubling, <= 8 s)
    # AUTH (a requirepass password, or an ACL user and its password), read at the edge from a file or an
    # environment variable (read_secret): never in the url or on the command line, never in a repr
    username: str = ""
    password: str = field(default="", repr=False)
    # HMAC-SHA256 key: every object written carries a MAC over its header and payload, and an object
    # without a valid one is never served (counted `forged`). Anyone who can write the store can forge a CRC.
    mac_key: bytes = field(default=b"", repr=False)
    # TLS (rediss:// or valkeys://): the CA that signed the store's certificate (default: the system's), and
    # this server's certificate and key where the store asks clients for one (tls-auth-clients)
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    def __post_init__(self) -> None:
        from urllib.parse import urlsplit

        try:
            u = urlsplit(self.url)
            port = u.port
        except ValueError as e:
            raise L2ConfigError(f"redis L2 url {self.url!r} does not parse: {e}") from None
        if u.scheme not in ("redis", "rediss", "unix", "valkey", "valkeys"):
            raise L2ConfigError(f"redis L2 url must be redis://HOST:PORT/DB (or rediss://, unix://), got {self.url!r}")
        if u.scheme != "unix" and not u.hostname:
            raise L2ConfigError(f"redis L2 url {self.url!r} has no host")
        if u.scheme != "unix" and u.path.strip("/") and not u.path.strip("/").isdigit():
            raise L2ConfigError(f"redis L2 url {self.url!r}: the path must be a database number")
        del port  # parsed above only to reject a bad port with this message
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise L2ConfigError(f"redis L2 prefix must be non-empty without spaces, got {self.prefix!r}")
        if not 64 * 1024 <= self.chunk_bytes <= 512 * MIB:
            raise L2ConfigError(f"redis L2 chunk_bytes must be in [64 KiB, 512 MiB], got {self.chunk_bytes}")
        for name in ("timeout_s", "meta_timeout_s", "connect_timeout_s", "retry_after_s"):
            if not getattr(self, name) > 0:
                raise L2ConfigError(f"redis L2 {name} must be > 0, got {getattr(self, name)!r}")
        if self.index_ttl_s < 0 or self.miss_ttl_s < 0 or self.ttl_s < 0:
            raise L2ConfigError("redis L2 index_ttl_s, miss_ttl_s and ttl_s must be >= 0")
        if not 1 <= self.max_connections <= 1024:
            raise L2ConfigError(f"redis L2 max_connections must be in 1..1024, got {self.max_connections}")
        if u.password is not None:
            raise L2ConfigError(f"redis L2 url {u.scheme}://{u.hostname}:{u.port}{u.path} carries a password: "
                                "it would show in ps and logs; give password_file or password_env instead")
        tls = u.scheme in ("rediss", "valkeys")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if getattr(self, name) and not tls:
                raise L2ConfigError(f"redis L2 {name} needs a rediss:// (TLS) url, got {self.url!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise L2ConfigError("redis L2 tls_cert_file and tls_key_file go together (a client certificate and "
                                "its key)")
        if self.mac_key and len(self.mac_key) < MIN_MAC_KEY_BYTES:
            raise L2ConfigError(f"redis L2 mac key is {len(self.mac_key)} bytes; at least {MIN_MAC_KEY_BYTES}")


L2Spec = FsL2Spec | RedisL2Spec

# The seed's --l2-adapter JSON keys and ours, per type; values are checked by the spec classes.
_FS_KEYS = {"base_path", "max_capacity_gb", "fsync"}
_REDIS_KEYS = {"url", "prefix", "max_capacity_gb", "chunk_mb", "timeout_s", "meta_timeout_s",
               "connect_timeout_s", "max_connections", "ttl_s", "index_ttl_s", "miss_ttl_s", "retry_after_s",
               "username", "password_file", "password_env", "mac_key_file", "tls_ca_file", "tls_cert_file",
               "tls_key_file"}


def parse_l2_adapter(text: str) -> L2Spec:
    """Parse the seed's `--l2-adapter` JSON: {"type":"fs",...} or {"type":"redis"|"valkey","url":...}."""
    import json

    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise L2ConfigError(f"--l2-adapter is not JSON ({e.msg} at character {e.pos}): {text!r:.200}") from None
    except RecursionError:
        raise L2ConfigError(f"--l2-adapter nests too deeply to be an adapter's settings: {text!r:.200}") from None
    if not isinstance(d, dict):
        raise L2ConfigError(f"--l2-adapter must be a JSON object, got {type(d).__name__}: {text!r:.200}")
    if "password" in d:
        raise L2ConfigError("--l2-adapter takes no password (it would show in ps and logs): give password_file "
                            "(a file only you can read) or password_env (the name of an environment variable)")
    kind = d.pop("type", None)
    if kind == "fs":
        _no_unknown(kind, d, _FS_KEYS)
        for need in ("base_path", "max_capacity_gb"):
            if need not in d:
                raise L2ConfigError(f'--l2-adapter type "fs" needs "{need}"')
        return FsL2Spec(str(_typed(d, "base_path", str)), int(_number(d, "max_capacity_gb") * GIB),
                        bool(_typed(d, "fsync", bool, False)))
    if kind in ("redis", "valkey"):
        _no_unknown(kind, d, _REDIS_KEYS)
        if "url" not in d:
            raise L2ConfigError(f'--l2-adapter type "{kind}" needs "url" (redis://HOST:PORT/DB)')
        kw: dict[str, object] = {"url": _typed(d, "url", str)}
        if "prefix" in d:
            kw["prefix"] = _typed(d, "prefix", str)
        if "chunk_mb" in d:
            kw["chunk_bytes"] = int(_number(d, "chunk_mb") * MIB)
        for name in ("timeout_s", "meta_timeout_s", "connect_timeout_s", "index_ttl_s", "miss_ttl_s",
                     "retry_after_s"):
            if name in d:
                kw[name] = float(_number(d, name))
        for name in ("max_connections", "ttl_s"):
            if name in d:
                kw[name] = _typed(d, name, int)
        if "max_capacity_gb" in d:
            _number(d, "max_capacity_gb")  # accepted for the seed's sake; the store's maxmemory bounds it
        if "username" in d:
            kw["username"] = _typed(d, "username", str)
        if "password_file" in d and "password_env" in d:
            raise L2ConfigError("--l2-adapter: give password_file or password_env, not both")
        if "password_file" in d:
            kw["password"] = read_secret(str(_typed(d, "password_file", str)), "password_file").decode()
        if "password_env" in d:
            var = str(_typed(d, "password_env", str))
            if not os.environ.get(var):
                raise L2ConfigError(f"--l2-adapter password_env {var}: that environment variable is not set")
            kw["password"] = os.environ[var]
        if "mac_key_file" in d:
            kw["mac_key"] = read_secret(str(_typed(d, "mac_key_file", str)), "mac_key_file")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if name in d:
                kw[name] = str(_typed(d, name, str))
        if "tls_key_file" in d:
            read_secret(str(kw["tls_key_file"]), "tls_key_file", content=False)
        return RedisL2Spec(**kw)  # type: ignore[arg-type]
    raise L2ConfigError(f'--l2-adapter "type" must be "fs", "redis" or "valkey", got {kind!r}')


def _no_unknown(kind: str, d: dict, known: set[str]) -> None:
    extra = sorted(set(d) - known)
    if extra:
        raise L2ConfigError(f"--l2-adapter type {kind!r} does not take {extra}; it takes {sorted(known)}")


def _typed(d: dict, name: str, typ: type, default: object = None) -> object:
    v = d.get(name, default)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise L2ConfigError(f"--l2-adapter {name!r} must be {typ.__name__}, got {v!r}")
    return v


def _number(d: dict, name: str) -> float:
    v = d[name]
    # JSON's 1e400 is inf: a size that cannot become bytes
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1 << 32:
        raise L2ConfigError(f"--l2-adapter {name!r} must be a positive number below {1 << 32}, got {v!r}")
    return float(v)


def make_l2(config: ServerConfig) -> L2Adapter | None:
    """The L2 adapter a server configuration asks for, or None without L2."""
    spec = config.l2_spec
    if isinstance(spec, RedisL2Spec):
        from hybridkv.server.l2_redis import RedisL2

        return RedisL2(spec)
    if isinstance(spec, FsL2Spec):
        from hybridkv.server.l2_fs import FilesystemL2

        return FilesystemL2(spec.base_path, spec.capacity_bytes, fsync=spec.fsync)
    return None
