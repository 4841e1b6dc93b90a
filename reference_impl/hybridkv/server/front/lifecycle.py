"""Start and exit hygiene: an ipc endpoint is taken over only when stale, never from a live server; at exit, every
request that reaches the socket before it closes is answered `shutting_down`."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.backend import zmq_poll

from hybridkv.wire import protocol as P
from hybridkv.wire.endpoints import default_ipc_dir, ensure_private_dir

log = logging.getLogger("hybridkv.server")


# At exit every request that reaches the socket is refused until none came for SHUTDOWN_QUIET_MS (a client answered
# just before the stop sends its next request then), for SHUTDOWN_DRAIN_S at most (a client that keeps sending
# cannot hold the exit).
SHUTDOWN_QUIET_MS = 250
SHUTDOWN_DRAIN_S = 5.0

Refuse = Callable[[bytes, int], None]  # answers `shutting_down` to one request: (routing id, request id)


class EndpointInUse(RuntimeError):
    """Another live process listens on the endpoint."""


def claim_ipc_path(path: str) -> None:
    """Make `path` free for bind: refuse a live server's socket, remove a dead one's."""
    parent = os.path.dirname(path) or "."
    if os.path.abspath(parent) == str(default_ipc_dir()):
        ensure_private_dir(default_ipc_dir())
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise EndpointInUse(f"ipc endpoint {path} exists and is not a socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise EndpointInUse(f"cannot tell whether ipc endpoint {path} is in use ({e}); refusing to take "
                                "it over") from None
        # Nobody accepts on it: the socket file of a server that is gone.
        log.info("taking over the stale ipc endpoint %s", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise EndpointInUse(f"ipc endpoint {path} is in use by a live process (another hybridkv server?); "
                        "stop it or choose another --endpoint")


def refuse_queued(sock: zmq.Socket | None, refuse: Refuse, for_s: float = SHUTDOWN_DRAIN_S) -> None:
    """Refuse every request queued in the ROUTER socket `sock` (for `for_s` at most; none when closed)."""
    if sock is None:
        return
    until = time.monotonic() + for_s
    n = 0
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        if len(frames) >= 2:
            refuse(frames[0].bytes, P.peek_envelope(frames[1].buffer)[1])
        n += 1
        if n % 64 == 0 and time.monotonic() >= until:
            return


def refuse_meanwhile(sock: zmq.Socket | None, wake_r: int, refuse: Refuse, wait_ms: int = 100) -> None:
    """While workers finish: wait up to `wait_ms` for a request or a completion (`wake_r`); refuse what came."""
    items: list[tuple[Any, int]] = [(wake_r, zmq.POLLIN)]
    if sock is not None:
        items.append((sock, zmq.POLLIN))
    for what, _ in zmq_poll(items, wait_ms):
        if what is sock:
            refuse_queued(sock, refuse)


def refuse_until_quiet(sock: zmq.Socket, refuse: Refuse) -> None:
    """The last step before the socket closes: refuse the requests that keep arriving, until none came for
    SHUTDOWN_QUIET_MS (or for SHUTDOWN_DRAIN_S in all)."""
    until = time.monotonic() + SHUTDOWN_DRAIN_S
    while (left := until - time.monotonic()) > 0 and sock.poll(SHUTDOWN_QUIET_MS, zmq.POLLIN):
        refuse_queued(sock, refuse, left)
