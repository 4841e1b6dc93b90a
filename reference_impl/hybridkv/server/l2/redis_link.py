"""The Redis L2's link to its store: clients with bounded waits, and whether the store is believed up.

A failed command opens a back-off (doubling from `retry_after_s` to 8 s) during which the adapter
answers without the network, and logs one line per 10 s; the first success after it logs once more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("hybridkv.server.l2.redis")  # the adapter's log: one logger for its lines

# Failures of a whole command or connection: the store is down, unreachable, loading, refusing our
# credentials... not one object damaged (a per-key error inside a read pipeline is that object's).
DOWN = (redis.RedisError, OSError)
_MAX_BACKOFF_S = 8.0
_LOG_EVERY_S = 10.0


class NodeDown(redis.ConnectionError):
    """One node of a cluster cannot serve an object's slot right now (its own back-off, in redis_cluster): a miss
    for that object, not the whole store down."""


def redis_client(url: str, timeout_s: float, connect_s: float, conns: int, username: str = "",
                 password: str = "", tls: dict[str, str] | None = None) -> redis.Redis:
    """A client whose pool blocks at `conns` connections and retries a dead connection once, at once;
    AUTH with `password` (and `username`, an ACL user) on every new connection when given; on rediss://
    the store's certificate is verified (against `tls["ca"]`, else the system's CAs) for the url's host,
    and `tls["cert"]` / `tls["key"]` are this client's certificate."""
    if url.startswith("valkey"):
        url = "redis" + url[len("valkey"):]  # valkey:// and valkeys:// speak the Redis protocol
    extra: dict[str, object] = {}
    if url.startswith("rediss://"):
        tls = tls or {}
        extra = {"ssl_cert_reqs": "required", "ssl_check_hostname": True, "ssl_ca_certs": tls.get("ca") or None,
                 "ssl_certfile": tls.get("cert") or None, "ssl_keyfile": tls.get("key") or None}
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=conns, timeout=timeout_s, socket_timeout=timeout_s,
        socket_connect_timeout=connect_s, retry=Retry(NoBackoff(), 1), health_check_interval=0,
        username=username or None, password=password or None, **extra)
    return redis.Redis(connection_pool=pool)


class StoreHealth:
    """Whether the store is believed reachable; failures open a doubling back-off and log rate-limited."""

    def __init__(self, url: str, retry_after_s: float, on_down: Callable[[], None], scope: str = "L2 is") -> None:
        """`scope`: what the warning says is misses meanwhile ("L2 is", or a cluster node's "its slots are")."""
        self.url, self.retry_after_s, self.on_down, self.scope = url, retry_after_s, on_down, scope
        self._lock = threading.Lock()
        self.down_until = 0.0
        self.backoff = 0.0
        self.errors = 0
        self._unlogged = 0
        self._last_log = -_LOG_EVERY_S

    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def failed(self, what: str, exc: BaseException) -> None:
        """Record a connection failure: everything is a miss until the back-off ends. A cluster node's failure
        (NodeDown) is that node's own back-off, already recorded: the store as a whole is not down."""
        if isinstance(exc, NodeDown):
            return
        self.on_down()
        now = time.monotonic()
        with self._lock:
            self.errors += 1
            self.backoff = min(max(self.backoff * 2, self.retry_after_s), _MAX_BACKOFF_S)
            self.down_until = now + self.backoff
            if now - self._last_log < _LOG_EVERY_S:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._last_log = self._unlogged, 0, now
        log.warning("L2 redis %s unreachable (%s: %s: %s); %s misses for %.1f s%s", self.url, what,
                    type(exc).__name__, exc, self.scope, self.backoff,
                    f" ({unlogged} more failures since the last line)" if unlogged else "")

    def ok(self) -> None:
        if self.backoff:
            with self._lock:
                was, self.backoff = self.backoff, 0.0
            if was:
                log.warning("L2 redis %s reachable again", self.url)
