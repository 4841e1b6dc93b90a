"""Routing ids a client cannot foresee: libzmq's ROUTER aborts the whole process when the id it makes up for a new
connection is one that another connection already chose for itself.

A connection that sends no routing id (every client of ours) gets one from the ROUTER: a zero byte and a 32-bit
counter, which starts at libc's rand() when the socket is made and goes up by one per connection. A connection may
also send its own id, and libzmq checks that id against the ids in use, but not the made-up ones: when the counter
comes to an id a connection chose, `zmq_assert` in add_out_pipe ends the server (SIGABRT), whoever connected last.
Nothing in Python ever seeds libc's rand(), so every server's first connection got 00 6b8b4567, the next 00 6b8b4568,
and so on: a local client that connected once with each of the next few ids stopped the server for everyone at the
next engine's connect. Seeded from os.urandom before the socket is made, the counter starts anywhere in 2**31: a
client must now guess it (or connect millions of times past the ids it holds) instead of knowing it.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("hybridkv.server")


def unpredictable_routing_ids() -> None:
    """Seed libc's rand(), which libzmq draws a new ROUTER socket's first routing id from; call before making it."""
    try:
        libc = ctypes.CDLL(None)
        libc.srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))
    except (OSError, AttributeError) as e:  # no libc to seed (not glibc/musl): the ids stay libzmq's own
        log.warning("cannot seed the routing ids of new connections: %s", e)
