"""Redis Cluster for the Redis L2: our own routing of commands by slot, over one plain client per primary.

A cluster splits 16384 slots among its primaries. A key's slot is CRC16 (XMODEM) of its hash tag (what lies
between its first `{` and the next `}`, when that is not empty), else of the whole key, mod 16384. Every key of
one object carries the object's `{<key hex>-<group>}` tag (redis_meta), so an object's keys share a slot and its
pipeline goes to one node; commands for many objects (a probe, a clear) go as one pipeline per node.

The slot map comes from CLUSTER SLOTS (asked of a known primary, else of the seeds), and is followed as it
changes under us:
- MOVED <slot> <host:port>: the slot has a new owner: the map takes it, the command goes there, and the whole
  map is asked again soon (a resharding moves many slots).
- ASK <slot> <host:port>: the slot is migrating and this key is not (or no longer) on its old owner: the
  command goes to the new one after ASKING, this once. Mid-migration one object's keys may sit on both sides;
  every command we send names one key, so each finds its key wherever it is.
- TRYAGAIN: sent again after a short pause, within the link's timeout. CLUSTERDOWN (the node does not serve
  the slot now): the map is asked again, the command sent once more, then the node is taken as down.
- A node that fails (refused, reset, timed out, loading, refusing our credentials) is down for a back-off of its
  own (a StoreHealth per node, shared by the data and index links): commands for its slots get NodeDown at
  once, without the network, and the map is asked again (a replica may have taken its slots over). The objects
  of the other nodes keep serving. Only when no node answers CLUSTER SLOTS is the store as a whole down.
"""

from __future__ import annotations

import binascii
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

from hybridkv.server.l2.redis_link import NodeDown, StoreHealth, redis_client

if TYPE_CHECKING:
    from hybridkv.server.l2.redis_spec import RedisL2Spec

log = logging.getLogger("hybridkv.server.l2.redis")

SLOTS = 16384
Addr = tuple[str, int]
Command = tuple[str, tuple, dict]  # a redis.Redis method, its arguments (the key first) and keywords
_REFRESH_EVERY_S = 0.2             # the map is asked again at most this often while it is known to be stale
_MAX_ROUNDS = 16                   # redirects followed for one command (nodes that disagree cannot loop us)


def key_slot(name: str | bytes) -> int:
    """The cluster slot of a key: CRC16 of its hash tag, or of all of it when it has none."""
    b = name.encode() if isinstance(name, str) else name
    start = b.find(b"{")
    if start >= 0:
        end = b.find(b"}", start + 1)
        if end > start + 1:
            b = b[start + 1:end]
    return binascii.crc_hqx(b, 0) % SLOTS


def _redirect(err: AskError) -> tuple[int, Addr | None]:
    """The slot and the node of a MOVED / ASK reply ("3999 127.0.0.1:6381"); no host ("" or "?"): None."""
    slot, addr = str(err).split()[:2]
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    return int(slot), (host, int(port)) if host and host != "?" else None


class ClusterMap:
    """Which primary serves each slot, and each node's health; shared by the adapter's data and index links."""

    def __init__(self, seeds: tuple[Addr, ...], retry_after_s: float) -> None:
        self.seeds, self.retry_after_s = seeds, retry_after_s
        self.owner: list[Addr | None] = [None] * SLOTS
        self._health: dict[Addr, StoreHealth] = {}
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._stale = True
        self._asked_at = -1e9
        self.redirects = {"moved": 0, "asked": 0}  # MOVED and ASK replies followed

    def health(self, addr: Addr) -> StoreHealth:
        with self._lock:
            h = self._health.get(addr)
            if h is None:
                h = self._health[addr] = StoreHealth(f"cluster node {addr[0]}:{addr[1]}", self.retry_after_s,
                                                     self.mark_stale, scope="its slots are")
            return h

    def primaries(self) -> list[Addr]:
        return sorted({a for a in self.owner if a is not None})

    def count(self, redirect: str) -> None:
        with self._lock:
            self.redirects[redirect] += 1

    def stats(self) -> dict[str, int]:
        """The primaries the map names, how many of them are not backing off, and the redirects followed."""
        nodes = self.primaries()
        return {"cluster_nodes": len(nodes), "cluster_nodes_up": sum(self.health(a).up() for a in nodes),
                "cluster_moved": self.redirects["moved"], "cluster_asked": self.redirects["asked"]}

    def mark_stale(self) -> None:
        self._stale = True

    def moved(self, slot: int, addr: Addr) -> None:
        self.owner[slot] = addr
        self._stale = True

    def refresh(self, client_of: Callable[[Addr], redis.Redis], force: bool = False) -> None:
        """Ask CLUSTER SLOTS again when the map is stale (or `force`): of a primary we know, else of the seeds.
        ConnectionError when none answers and no map is known (the store is down)."""
        known = any(a is not None for a in self.owner)
        if not force and (not self._stale or (known and time.monotonic() - self._asked_at < _REFRESH_EVERY_S)):
            return
        if not self._refreshing.acquire(blocking=not known or force):
            return  # another thread is asking: the map we have serves meanwhile
        try:
            self._asked_at = time.monotonic()
            errors = []
            for addr in dict.fromkeys([*self.primaries(), *self.seeds]):
                if not self.health(addr).up() and known:
                    continue
                try:
                    reply = client_of(addr).execute_command("CLUSTER SLOTS")
                except (redis.RedisError, OSError) as e:
                    self.health(addr).failed("CLUSTER SLOTS", e)
                    errors.append(f"{addr[0]}:{addr[1]}: {type(e).__name__}: {e}")
                    continue
                self._load(reply, addr)
                return
            if not known:
                raise redis.ConnectionError(f"no cluster node answers CLUSTER SLOTS ({'; '.join(errors)})")
        finally:
            self._refreshing.release()

    def _load(self, reply: Any, asked: Addr) -> None:
        owner: list[Addr | None] = [None] * SLOTS
        for start, end, primary, *_replicas in reply:
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            addr = (host if host and host != "?" else asked[0], int(primary[1]))
            owner[int(start):int(end) + 1] = [addr] * (int(end) + 1 - int(start))
        self.owner = owner
        self._stale = False


class ClusterLink:
    """The subset of redis.Redis the adapter uses (get, mget, pipeline, delete, unlink, touch, scan_iter, ping) and
    `each` (a multi-key command per object, in one round), each command sent to the node that serves its key's
    slot, redirects followed (see the module doc)."""

    def __init__(self, cmap: ClusterMap, node_url: Callable[[Addr], str], timeout_s: float, connect_s: float,
                 conns: int, **auth: Any) -> None:
        self._map, self._timeout = cmap, timeout_s
        self._new = lambda addr: redis_client(node_url(addr), timeout_s, connect_s, conns, **auth)
        self._clients: dict[Addr, redis.Redis] = {}
        self._lock = threading.Lock()
        self.connection_pool = self  # close() disconnects every node's pool, as with one client

    def client(self, addr: Addr) -> redis.Redis:
        with self._lock:
            c = self._clients.get(addr)
            if c is None:
                c = self._clients[addr] = self._new(addr)
            return c

    def run(self, cmds: list[Command]) -> list[Any]:
        """Every command's reply in order: a per-key error as its exception, NodeDown where the slot's node is
        down or the slot kept moving until the timeout."""
        self._map.refresh(self.client)
        deadline = time.monotonic() + self._timeout
        out: list[Any] = [None] * len(cmds)
        todo: dict[int, tuple[Addr | None, bool]] = {i: (self._map.owner[key_slot(c[1][0])], False)
                                                      for i, c in enumerate(cmds)}
        clusterdown: set[int] = set()
        for _round in range(_MAX_ROUNDS):
            if not todo:
                break
            groups: dict[tuple[Addr | None, bool], list[int]] = {}
            for i, route in todo.items():
                groups.setdefault(route, []).append(i)
            todo, pause = {}, False
            for (addr, asking), idx in groups.items():
                for i, r in zip(idx, self._send(addr, asking, [cmds[i] for i in idx]), strict=True):
                    slot = key_slot(cmds[i][1][0])
                    if isinstance(r, MovedError | AskError) and addr is not None:  # (None: NodeDown)
                        rslot, to = _redirect(r)
                        to = to or addr
                        if isinstance(r, MovedError):
                            self._map.moved(rslot, to)
                        self._map.count("moved" if isinstance(r, MovedError) else "asked")
                        todo[i] = (to, not isinstance(r, MovedError))
                    elif isinstance(r, TryAgainError):
                        todo[i], pause = (self._map.owner[slot], False), True
                    elif isinstance(r, ClusterDownError) and i not in clusterdown and addr is not None:
                        clusterdown.add(i)
                        self._map.mark_stale()
                        todo[i] = (None, False)  # routed again once the map is asked below
                    elif isinstance(r, ClusterDownError) and addr is not None:
                        self._map.health(addr).failed("a command (CLUSTERDOWN)", r)
                        out[i] = NodeDown(f"cluster node {addr[0]}:{addr[1]}: CLUSTERDOWN {r}")
                    else:
                        out[i] = r
            if not todo:
                break
            if any(route[0] is None for route in todo.values()):
                self._map.mark_stale()
                self._map.refresh(self.client)  # at most every 0.2 s: a slot that no node serves is a miss
                todo = {i: (self._map.owner[key_slot(cmds[i][1][0])] if a is None else a, k)
                        for i, (a, k) in todo.items()}
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if pause:
                time.sleep(min(0.01, left))
        for i in todo:
            out[i] = NodeDown(f"slot {key_slot(cmds[i][1][0])} still moving (redirected or TRYAGAIN until the "
                              f"link's {self._timeout} s or {_MAX_ROUNDS} tries were spent)")
        return out

    def _send(self, addr: Addr | None, asking: bool, cmds: list[Command]) -> list[Any]:
        """One pipeline to one node (ASKING before each command when asked to); NodeDown for each when it fails."""
        if addr is None:
            return [NodeDown(f"slot {key_slot(c[1][0])} is served by no node the cluster knows") for c in cmds]
        health = self._map.health(addr)
        if not health.up():
            self._map.mark_stale()  # asked again (every 0.2 s at most): a replica may have its slots by now
            return [NodeDown(f"cluster node {addr[0]}:{addr[1]} is down (backing off)")] * len(cmds)
        pipe = self.client(addr).pipeline(transaction=False)
        for method, args, kw in cmds:
            if asking:
                pipe.execute_command("ASKING")
            getattr(pipe, method)(*args, **kw)
        try:
            res = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as e:
            health.failed(f"{len(cmds)} commands", e)
            return [NodeDown(f"cluster node {addr[0]}:{addr[1]}: {type(e).__name__}: {e}")] * len(cmds)
        health.ok()
        return res[1::2] if asking else res

    # ---- the redis.Redis methods the adapter calls ----

    def ping(self) -> bool:
        self._map.refresh(self.client, force=True)
        return True

    def get(self, name: str) -> Any:
        (r,) = self.run([("get", (name,), {})])
        if isinstance(r, Exception):
            raise r
        return r

    def mget(self, names: list) -> list[Any]:
        """The values, None where missing, not a string (as MGET) or on a node that is down."""
        return [None if isinstance(r, Exception) else r for r in self.run([("get", (n,), {}) for n in names])]

    def delete(self, *names: Any) -> int:
        return self._count("delete", names)

    def unlink(self, *names: Any) -> int:
        return self._count("unlink", names)

    def touch(self, *names: Any) -> int:
        return self._count("touch", names)

    def _count(self, method: str, names: tuple) -> int:
        return self.each(method, [names])[0]

    def each(self, method: str, groups: list) -> list[int]:
        """`method` (delete, unlink, touch) over each group of names: how many keys of each group it found. One
        single-key command per name (a multi-key one is refused across slots, and mid-migration)."""
        res = self.run([(method, (n,), {}) for names in groups for n in names])
        err = next((r for r in res if isinstance(r, Exception)), None)
        if err is not None:
            raise err
        out, i = [], 0
        for names in groups:
            out.append(sum(res[i:i + len(names)]))
            i += len(names)
        return out

    def pipeline(self, transaction: bool = False) -> ObjectPipeline:
        return ObjectPipeline(self)

    def scan_iter(self, match: bytes, count: int) -> Iterator[bytes]:
        """SCAN every primary in turn (each holds only its slots' keys); a node that is down is skipped, logged."""
        self._map.refresh(self.client)
        for addr in self._map.primaries():
            health = self._map.health(addr)
            try:
                if not health.up():
                    raise NodeDown("backing off")
                yield from self.client(addr).scan_iter(match=match, count=count)
            except (redis.RedisError, OSError) as e:
                health.failed("SCAN", e)
                log.warning("L2 redis: SCAN skipped cluster node %s:%d (%s): its keys are left", *addr, e)

    def stats(self) -> dict[str, int]:
        return self._map.stats()

    def disconnect(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
        for c in clients:
            c.connection_pool.disconnect()


class ObjectPipeline:
    """The commands of one object's put or read, sent by ClusterLink.run (one node, one round trip, unless its
    slot is moving)."""

    def __init__(self, link: ClusterLink) -> None:
        self._link = link
        self._cmds: list[Command] = []

    def set(self, name: str, value: Any, ex: int | None = None) -> None:
        self._cmds.append(("set", (name, value), {"ex": ex}))

    def get(self, name: str) -> None:
        self._cmds.append(("get", (name,), {}))

    def execute(self, raise_on_error: bool = False) -> list[Any]:
        """The replies (a per-key error as its exception); NodeDown raised when the object's node is down."""
        res = self._link.run(self._cmds)
        down = next((r for r in res if isinstance(r, NodeDown)), None)
        if down is not None:
            raise down
        if raise_on_error and (err := next((r for r in res if isinstance(r, Exception)), None)) is not None:
            raise err
        return res


def store_links(spec: RedisL2Spec) -> tuple[Any, Any]:
    """The adapter's data link (long timeout, `max_connections`) and index link (`meta_timeout_s`, 4
    connections): two redis.Redis clients on one store, or two ClusterLinks sharing one map of the cluster."""
    auth: dict[str, Any] = {"username": spec.username, "password": spec.password,
                            "tls": {"ca": spec.tls_ca_file, "cert": spec.tls_cert_file, "key": spec.tls_key_file}}
    meta_connect = min(spec.connect_timeout_s, spec.meta_timeout_s)
    if not spec.cluster:
        return (redis_client(spec.url, spec.timeout_s, spec.connect_timeout_s, spec.max_connections, **auth),
                redis_client(spec.url, spec.meta_timeout_s, meta_connect, 4, **auth))
    scheme = "rediss" if spec.tls else "redis"
    cmap = ClusterMap(spec.seeds, spec.retry_after_s)

    def node_url(addr: Addr) -> str:
        return f"{scheme}://{f'[{addr[0]}]' if ':' in addr[0] else addr[0]}:{addr[1]}/0"

    return (ClusterLink(cmap, node_url, spec.timeout_s, spec.connect_timeout_s, spec.max_connections, **auth),
            ClusterLink(cmap, node_url, spec.meta_timeout_s, meta_connect, 4, **auth))
