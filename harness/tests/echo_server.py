"""A bare pyzmq ROUTER that sends every message straight back: the ceiling of a Python request round trip.

The round-trip microbenchmarks time the cache server beside this echo, on the same transport and in
the same run, so a lookup's figure reads against what any Python client and server pair could reach.
Run as its own process, like the cache server: `python echo_server.py ENDPOINT`; prints `ready` once bound.
"""

from __future__ import annotations

import sys

import zmq


def main(endpoint: str) -> None:
    """Echo until killed: blocking receive and send, no poller, no decoding (the least work a server can do)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].startswith(("ipc://", "tcp://")):
        sys.exit("usage: echo_server.py ipc://PATH | tcp://HOST:PORT")
    main(sys.argv[1])
