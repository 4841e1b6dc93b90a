"""The spec of a Redis / Valkey L2 (redis.py; on a Redis Cluster, redis_cluster.py): where the store is, how its
keys are named and chunked, its timeouts, and its secrets (read at the edge, never shown)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from hybridkv.server.l2.redis_meta import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from hybridkv.server.l2.specs import MIB, L2ConfigError, adapter_class, number, read_secret, typed

if TYPE_CHECKING:
    from hybridkv.server.l2.base import L2Adapter

MIN_MAC_KEY_BYTES = 16

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
    def from_json(cls, kind: str, d: dict[str, Any], env: Mapping[str, str]) -> RedisL2Spec:
        """The spec of the seed's --l2-adapter JSON `d` (its "type" taken out); a password_env is looked up in
        `env`, the environment the edge (the CLI) passes down."""
        if "url" not in d:
            raise L2ConfigError(f'--l2-adapter type "{kind}" needs "url" (redis://HOST:PORT/DB)')
        kw: dict[str, Any] = {"url": typed(d, "url", str)}
        if "prefix" in d:
            kw["prefix"] = typed(d, "prefix", str)
        if "chunk_mb" in d:
            kw["chunk_bytes"] = int(number(d, "chunk_mb") * MIB)
        for name in ("timeout_s", "meta_timeout_s", "connect_timeout_s", "index_ttl_s", "miss_ttl_s",
                     "retry_after_s"):
            if name in d:
                kw[name] = float(number(d, name))
        for name in ("max_connections", "ttl_s"):
            if name in d:
                kw[name] = typed(d, name, int)
        if "max_capacity_gb" in d:
            number(d, "max_capacity_gb")  # accepted for the seed's sake; the store's maxmemory bounds it
        if "username" in d:
            kw["username"] = typed(d, "username", str)
        if "password_file" in d and "password_env" in d:
            raise L2ConfigError("--l2-adapter: give password_file or password_env, not both")
        if "password_file" in d:
            kw["password_file"] = str(typed(d, "password_file", str))
            kw["password"] = read_secret(kw["password_file"], "password_file").decode()
        if "password_env" in d:
            var = kw["password_env"] = str(typed(d, "password_env", str))
            if not env.get(var):
                raise L2ConfigError(f"--l2-adapter password_env {var}: that environment variable is not set")
            kw["password"] = env[var]
        if "mac_key_file" in d:
            kw["mac_key_file"] = str(typed(d, "mac_key_file", str))
            kw["mac_key"] = read_secret(kw["mac_key_file"], "mac_key_file")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if name in d:
                kw[name] = str(typed(d, name, str))
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
        return adapter_class("hybridkv.server.l2.redis", "RedisL2")(self)

    def describe(self) -> str:
        """The L2 as the server's ready line shows it."""
        return f"redis {'cluster ' if self.cluster else ''}{self.url} prefix {self.prefix}"
