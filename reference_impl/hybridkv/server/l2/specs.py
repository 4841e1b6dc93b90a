"""What L2 a server runs with: one spec per kind of adapter, the registry of kinds, and the seed's
`--l2-adapter` JSON parsed into a spec (and a spec written back as that JSON, for `server_argv`).

A spec is a frozen value: it is checked when built, compares equal field by field, and builds its own
adapter with `open()`. A new kind of L2 is its adapter's module and its spec here, with one line in
`SPEC_KINDS`; the config, the CLI and the server loop take it as they are.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from hybridkv.server.l2.redis_meta import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES

if TYPE_CHECKING:
    from hybridkv.server.l2.base import L2Adapter

GIB = 1 << 30
MIB = 1 << 20

log = logging.getLogger(__name__)


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

    # the seed's --l2-adapter JSON keys for this kind; values are checked by __post_init__
    json_keys: ClassVar[frozenset[str]] = frozenset({"base_path", "max_capacity_gb", "fsync"})

    def __post_init__(self) -> None:
        if not self.base_path:
            raise L2ConfigError("fs L2 needs a base_path (a directory)")
        if self.capacity_bytes <= 0:
            raise L2ConfigError(f"fs L2 capacity must be positive, got {self.capacity_bytes} B")

    @classmethod
    def from_json(cls, kind: str, d: dict[str, Any]) -> FsL2Spec:
        for need in ("base_path", "max_capacity_gb"):
            if need not in d:
                raise L2ConfigError(f'--l2-adapter type "{kind}" needs "{need}"')
        return cls(str(_typed(d, "base_path", str)), int(_number(d, "max_capacity_gb") * GIB),
                   bool(_typed(d, "fsync", bool, False)))

    def to_json(self) -> dict[str, Any]:
        """The --l2-adapter JSON that `from_json` turns back into this spec."""
        return {"type": "fs", "base_path": self.base_path, "max_capacity_gb": self.capacity_bytes / GIB,
                "fsync": self.fsync}

    def open(self) -> L2Adapter:
        from hybridkv.server.l2.fs import FilesystemL2

        l2 = FilesystemL2(self.base_path, self.capacity_bytes, fsync=self.fsync)
        if short := self.disk_shortfall(l2.stats()["disk_bytes"]):  # serving goes on: a failed write is counted
            log.warning("L2: capacity %.3f GiB, but %s has room for %.3f GiB (free + what L2 holds): once the disk "
                        "fills, writes fail (ENOSPC) and objects leave L1 with no L2 copy", self.capacity_bytes / GIB,
                        self.base_path, (self.capacity_bytes - short) / GIB)
        return l2

    def disk_shortfall(self, held: int = 0) -> int:
        """The bytes of the capacity that the directory's disk has no room for (its free space plus `held`, what the
        L2 holds there already); 0 when it all fits."""
        return max(0, self.capacity_bytes - shutil.disk_usage(self.base_path).free - held)

    def describe(self) -> str:
        """The L2 as the server's ready line shows it."""
        return f"{self.base_path} ({self.capacity_bytes / GIB:g} GiB)"


_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys", "redis+cluster", "rediss+cluster", "valkey+cluster",
            "valkeys+cluster")


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
    # where the password and the MAC key were read from (kept so that `to_json` can name them, not show them)
    password_file: str = ""
    password_env: str = ""
    mac_key_file: str = ""

    json_keys: ClassVar[frozenset[str]] = frozenset({
        "url", "prefix", "max_capacity_gb", "chunk_mb", "timeout_s", "meta_timeout_s", "connect_timeout_s",
        "max_connections", "ttl_s", "index_ttl_s", "miss_ttl_s", "retry_after_s", "username", "password_file",
        "password_env", "mac_key_file", "tls_ca_file", "tls_cert_file", "tls_key_file"})

    def __post_init__(self) -> None:
        from urllib.parse import urlsplit

        shown = self.shown_url
        user = self.url.split("://", 1)[-1].rpartition("@")[0]
        if any(c in user for c in ":/?#"):  # checked first: urlsplit's own errors would quote bits of it
            raise L2ConfigError(f"redis L2 url {shown} carries a " + ("user or password: give username and "
                                if self.cluster else "password: it would show in ps and logs; give ")
                                + "password_file or password_env instead")
        try:
            u = urlsplit(self.url)
            port = None if self.cluster else u.port
        except ValueError as e:
            raise L2ConfigError(f"redis L2 url {shown!r} does not parse: {e}") from None
        if u.scheme not in _SCHEMES:
            raise L2ConfigError(f"redis L2 url must be redis://HOST:PORT/DB (or rediss://, unix://, "
                                f"redis+cluster://HOST:PORT,HOST:PORT), got {shown!r}")
        if self.cluster:
            self.seeds  # noqa: B018 -- parsed here to reject a bad seed list at the door
        elif u.scheme != "unix" and not u.hostname:
            raise L2ConfigError(f"redis L2 url {shown!r} has no host")
        if u.scheme != "unix" and u.path.strip("/") and not u.path.strip("/").isdigit():
            raise L2ConfigError(f"redis L2 url {shown!r}: the path must be a database number")
        if self.cluster and u.path.strip("/") not in ("", "0"):
            raise L2ConfigError(f"redis L2 url {shown!r}: a cluster has database 0 only")
        del port  # parsed above only to reject a bad port with this message
        if not self.prefix or any(c.isspace() or c in "{}" for c in self.prefix):
            raise L2ConfigError(f"redis L2 prefix must be non-empty without spaces, {{ or }} (a cluster's hash tag "
                                f"is the object's), got {self.prefix!r}")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:  # what a reader accepts in a meta
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
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if getattr(self, name) and not self.tls:
                raise L2ConfigError(f"redis L2 {name} needs a rediss:// (TLS) url, got {shown!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise L2ConfigError("redis L2 tls_cert_file and tls_key_file go together (a client certificate and "
                                "its key)")
        if self.mac_key and len(self.mac_key) < MIN_MAC_KEY_BYTES:
            raise L2ConfigError(f"redis L2 mac key is {len(self.mac_key)} bytes; at least {MIN_MAC_KEY_BYTES}")

    @property
    def cluster(self) -> bool:
        """A Redis Cluster (redis+cluster://, rediss+cluster://, valkey+cluster://, valkeys+cluster://)."""
        return self.url.split("://", 1)[0].endswith("+cluster")

    @property
    def shown_url(self) -> str:
        """The url as error messages show it: without anything before its last '@' (a user and password, which
        may hold '/', '#' or ':' and so end up anywhere in what urlsplit makes of it)."""
        scheme, sep, rest = self.url.rpartition("://")[0], "://", self.url.split("://", 1)[-1]
        return (scheme + sep if scheme else "") + ("***@" + rest.rsplit("@", 1)[-1] if "@" in rest else rest)

    @property
    def tls(self) -> bool:
        return self.url.split("://", 1)[0].split("+")[0] in ("rediss", "valkeys")

    @property
    def seeds(self) -> tuple[tuple[str, int], ...]:
        """A cluster url's seed nodes, the ones asked first for the cluster's map: (host, port), port 6379 if not
        given."""
        from urllib.parse import urlsplit

        netloc = self.url.split("://", 1)[-1].split("/", 1)[0]
        if "@" in netloc:
            raise L2ConfigError(f"redis L2 url {self.shown_url} carries a user or password: give username and "
                                "password_file or password_env instead")
        seeds = []
        for part in netloc.split(","):
            try:
                u = urlsplit(f"//{part}")
                seeds.append((u.hostname or "", u.port or 6379))
            except ValueError as e:
                raise L2ConfigError(f"redis L2 url {self.shown_url!r}: seed {part!r} does not parse: {e}") from None
            if not seeds[-1][0]:
                raise L2ConfigError(f"redis L2 url {self.shown_url!r}: seed {part!r} has no host")
        return tuple(seeds)

    @classmethod
    def from_json(cls, kind: str, d: dict[str, Any]) -> RedisL2Spec:
        if "url" not in d:
            raise L2ConfigError(f'--l2-adapter type "{kind}" needs "url" (redis://HOST:PORT/DB)')
        kw: dict[str, Any] = {"url": _typed(d, "url", str)}
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
            kw["password_file"] = str(_typed(d, "password_file", str))
            kw["password"] = read_secret(kw["password_file"], "password_file").decode()
        if "password_env" in d:
            var = kw["password_env"] = str(_typed(d, "password_env", str))
            if not os.environ.get(var):
                raise L2ConfigError(f"--l2-adapter password_env {var}: that environment variable is not set")
            kw["password"] = os.environ[var]
        if "mac_key_file" in d:
            kw["mac_key_file"] = str(_typed(d, "mac_key_file", str))
            kw["mac_key"] = read_secret(kw["mac_key_file"], "mac_key_file")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if name in d:
                kw[name] = str(_typed(d, name, str))
        if "tls_key_file" in d:
            read_secret(str(kw["tls_key_file"]), "tls_key_file", content=False)
        return cls(**kw)

    def to_json(self) -> dict[str, Any]:
        """The --l2-adapter JSON that `from_json` turns back into this spec: secrets by where they came from,
        never by value (a command line shows in ps)."""
        by_value = (self.password and not (self.password_file or self.password_env)) or (self.mac_key and
                                                                                      not self.mac_key_file)
        if by_value:
            raise L2ConfigError(f"redis L2 {self.url}: a password or MAC key given by value cannot go on a command "
                                "line; build the spec from password_file / password_env / mac_key_file")
        d: dict[str, Any] = {"type": "redis", "url": self.url, "prefix": self.prefix,
                             "chunk_mb": self.chunk_bytes / MIB}
        for name in ("timeout_s", "meta_timeout_s", "connect_timeout_s", "max_connections", "ttl_s", "index_ttl_s",
                     "miss_ttl_s", "retry_after_s", "username", "password_file", "password_env", "mac_key_file",
                     "tls_ca_file", "tls_cert_file", "tls_key_file"):
            value = getattr(self, name)
            if value != RedisL2Spec.__dataclass_fields__[name].default:
                d[name] = value
        return d

    def open(self) -> L2Adapter:
        from hybridkv.server.l2.redis import RedisL2

        return RedisL2(self)

    def describe(self) -> str:
        """The L2 as the server's ready line shows it."""
        return f"redis {'cluster ' if self.cluster else ''}{self.url} prefix {self.prefix}"


L2Spec = FsL2Spec | RedisL2Spec

# --l2-adapter's "type" -> the spec it builds
SPEC_KINDS: dict[str, type[FsL2Spec] | type[RedisL2Spec]] = {"fs": FsL2Spec, "redis": RedisL2Spec,
                                                              "valkey": RedisL2Spec}


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
    spec = SPEC_KINDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        *first, last = (f'"{k}"' for k in SPEC_KINDS)
        raise L2ConfigError(f'--l2-adapter "type" must be {", ".join(first)} or {last}, got {kind!r}')
    _no_unknown(kind, d, spec.json_keys)
    return spec.from_json(kind, d)


def _no_unknown(kind: str, d: dict, known: frozenset[str]) -> None:
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
