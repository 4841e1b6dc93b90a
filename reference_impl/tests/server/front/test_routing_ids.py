"""A client that chooses its own routing id cannot stop the server: libzmq's ROUTER aborts the process when the id it
makes up for a new connection is already a chosen one (front/routing_ids.py), and it made them up from a counter
every server started at the same value."""

from __future__ import annotations

import zmq
from hybridkv.wire import protocol as P
from serverkit import alive

# the routing id libzmq's ROUTER gave the first connection of every process that never seeded libc's rand()
UNSEEDED_FIRST_ID = 0x6B8B4567


def test_routing_ids_chosen_ahead_of_the_next_connections_leave_the_server_serving(server_factory):
    """A hostile client holds connections under the ids the server would have made up next (00 6b8b4567 and on,
    what it gave before it seeded them), then engines connect: they are served, and the server lives."""
    s = server_factory()
    ctx = zmq.Context.instance()
    held = []
    try:
        for k in range(32):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.ROUTING_ID, b"\x00" + (UNSEEDED_FIRST_ID + k).to_bytes(4, "big"))
            d.connect(s.endpoint)
            d.send(P.encode(P.Health()))
            held.append(d)
        for d in held:  # each is connected and answered: the server took its chosen id
            assert d.poll(10_000), "a connection with a chosen routing id was not answered"
            d.recv()
        for _ in range(8):  # each a new connection, with an id made up by the server
            assert alive(s.endpoint)
        assert s.alive()
    finally:
        for d in held:
            d.close(linger=0)
