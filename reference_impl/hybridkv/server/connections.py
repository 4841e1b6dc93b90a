"""How many clients the server takes at once: bounded by its open-file limit, never by what clients do.

libzmq accepts connections on its own I/O thread, and an accept that fails with EMFILE aborts the process on
an ipc:// endpoint and spins at 100% CPU on tcp://. So the server raises its soft open-file limit to the hard
one at start, and on ipc a gate counts connections from the socket monitor and, at its cap, renames the
socket file away: clients connected keep being served, new ones find no socket (a ZMQ client retries by
itself) until enough have left and the name comes back. (zmq_unbind would do for tcp too, but it closes
every connection the endpoint accepted.) The cap leaves room for a burst that arrives before the loop sees it.
"""

from __future__ import annotations

import logging
import os
import resource

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("hybridkv.server")

FD_RESERVE = 64  # the server's own later files: L2 files in flight, Redis connections, logs


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (an unprivileged process may); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:  # a hard limit above the kernel's nr_open
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return FD_RESERVE


def listen_backlog(io_threads: int) -> int:
    """The kernel's queue of connections not yet accepted: libzmq accepts all of them even after the gate
    closed, so under a low open-file limit it must be a small part of the room the gate leaves."""
    return max(8, min(100, (fd_limit() - open_fds() - FD_RESERVE - 4 * io_threads) // 8))


def fd_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class ConnectionGate:
    """Stops an ipc ROUTER accepting before its process runs out of files, and at `max_clients` connections.

    Connections are counted from the monitor's events, checked against the open-file count every tick (the
    monitor drops events past its high-water mark in a burst). The door closes at two thirds of the files left
    after start (a third stays free for what libzmq accepts before the loop has looked) and opens again below
    90% of that."""

    def __init__(self, sock: zmq.Socket, path: str, max_clients: int, io_threads: int):
        self.sock, self.path = sock, path
        self.closed_path = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.full")
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.base_fds = open_fds()
        spare = fd_limit() - self.base_fds - FD_RESERVE - 4 * io_threads
        if spare < 16:
            raise OSError(f"the open-file limit {fd_limit()} leaves room for {max(spare, 0)} clients; "
                          "raise it (ulimit -n)")
        self.max_clients = min(max_clients, spare * 2 // 3) if max_clients else spare * 2 // 3
        if max_clients > self.max_clients:
            log.warning("--max-clients %d lowered to %d: the open-file limit is %d", max_clients,
                        self.max_clients, fd_limit())
        self.connections = 0  # from the events; resync() corrects it from the open-file count
        self.listening = True
        self.closings = 0     # times the door closed

    def resync(self) -> None:
        """Take the open-file count as the connection count when it is higher (the monitor dropped events).
        Not on every event: listing /proc/self/fd costs more than libzmq takes to accept a connection."""
        self.connections = max(self.connections, open_fds() - self.base_fds - 2 * FD_RESERVE // 3)
        self.check()

    def drain(self) -> None:
        """Count the monitor's events, then open or close the door."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == zmq.EVENT_ACCEPTED:
                self.connections += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.connections = max(0, self.connections - 1)
            if self.listening and self.connections >= self.max_clients:
                break  # close the door now, count the rest after
        self.check()

    def check(self) -> None:
        n = self.connections
        try:
            if self.listening and n >= self.max_clients:
                os.replace(self.path, self.closed_path)
                self.listening = False
                self.closings += 1
                log.warning("%d clients connected, the cap (--max-clients, or what the open-file limit %d "
                            "leaves): not accepting more until some leave", n, fd_limit())
            elif not self.listening and n <= self.max_clients * 9 // 10:
                os.replace(self.closed_path, self.path)
                self.listening = True
                log.info("%d clients connected: accepting again", n)
        except OSError as e:  # someone moved the socket file: the loop goes on, the next check tries again
            log.error("cannot %s the ipc socket file %s: %s", "close" if self.listening else "reopen",
                      self.path, e)

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        if not self.listening:
            try:
                os.unlink(self.closed_path)
            except OSError:
                pass
