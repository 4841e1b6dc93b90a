"""How many clients the server takes at once: bounded by its open-file limit, never by what clients do.

libzmq accepts connections on its own I/O thread, and an accept that fails with EMFILE aborts the process on
an ipc:// endpoint and spins at 100% CPU on tcp://. So the server raises its soft open-file limit to the hard
one at start, and a gate counts connections from the socket monitor and, at its cap, closes the door: clients
connected keep being served, new ones are not let in until enough have left. (zmq_unbind would close the door,
but it also closes every connection the endpoint accepted.) On ipc the door is the socket file, renamed away:
a ZMQ client finds no socket and retries by itself. On tcp the server makes the listening socket itself and
hands it to libzmq (ZMQ_USE_FD); the door is a socket filter on it that drops every SYN, so the kernel starts
no connection and libzmq has none to accept: a client's connect waits in its kernel's SYN retries (1 s, 2 s,
4 s, ... apart) and gets in at the first one after the door opened. The cap leaves room for a burst that
arrives before the loop sees it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import socket
import struct

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("hybridkv.server")

# the server's own later files: L2 files in flight, Redis connections, logs, the metrics endpoint's connections
# (metrics_http.MAX_CONNECTIONS and its listening socket); the gate never counts them as clients
FD_RESERVE = 64


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


class IpcDoor:
    """The door of an ipc endpoint: its socket file, renamed away while closed."""

    def __init__(self, path: str):
        self.path = path
        self.closed_path = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.full")

    def shut(self) -> None:
        os.replace(self.path, self.closed_path)

    def reopen(self) -> None:
        os.replace(self.closed_path, self.path)

    def discard(self) -> None:
        """At shutdown, while closed: the renamed file goes too."""
        try:
            os.unlink(self.closed_path)
        except OSError:
            pass


SO_ATTACH_FILTER, SO_DETACH_FILTER = 26, 27  # Linux's <asm-generic/socket.h>
# classic BPF, run by the kernel on every packet to the listening socket before it starts a connection; a TCP
# socket's filter sees the packet from its TCP header: byte 13 holds the flags. Only SYNs are dropped: a
# connection the kernel accepted just before (and inherits the filter) still gets its packets.
DROP_SYNS = (
    (0x30, 0, 0, 13),          # ldb [13]          A = the TCP flags
    (0x45, 0, 1, 0x02),        # jset #SYN, 0, 1   a SYN: go on, else skip one
    (0x06, 0, 0, 0),           # ret #0            drop it
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1           keep the whole packet
)


class TcpDoor:
    """The door of a tcp endpoint: a socket filter dropping SYNs on the listening socket, while closed."""

    def __init__(self, fd: int, endpoint: str):
        self.fd, self.path = fd, endpoint  # libzmq owns the fd, and closes it with the socket

    @classmethod
    def bind(cls, sock: zmq.Socket, endpoint: str, backlog: int) -> TcpDoor:
        """Listen on `endpoint` (tcp://HOST:PORT) with a socket of our own and hand it to `sock` to accept from.
        An address in use raises zmq.ZMQError, as libzmq's own bind would."""
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # check_endpoint: 127.0.0.1 only
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq's listener: a restart rebinds
            ls.setblocking(False)  # libzmq accepts after a poll; a connection reset meanwhile must not block it
            ls.bind((host, int(port)))
            ls.listen(backlog)
        except OSError as e:
            ls.close()
            raise zmq.ZMQError(e.errno or zmq.EINVAL) from None
        fd = ls.detach()  # from here libzmq owns it: no Python object may close it later
        try:
            sock.setsockopt(zmq.USE_FD, fd)
            sock.bind(endpoint)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, endpoint)

    def _setsockopt(self, option: int, value: bytes | int) -> None:
        s = socket.socket(fileno=self.fd)
        try:
            s.setsockopt(socket.SOL_SOCKET, option, value)
        finally:
            s.detach()

    def shut(self) -> None:
        insns = (ctypes.c_ubyte * (8 * len(DROP_SYNS))).from_buffer_copy(
            b"".join(struct.pack("HBBI", *i) for i in DROP_SYNS))
        # struct sock_fprog {unsigned short len; struct sock_filter *filter}: the kernel copies the program
        self._setsockopt(SO_ATTACH_FILTER, struct.pack("HP", len(DROP_SYNS), ctypes.addressof(insns)))

    def reopen(self) -> None:
        self._setsockopt(SO_DETACH_FILTER, 0)

    def discard(self) -> None:
        pass


Door = IpcDoor | TcpDoor


class ConnectionGate:
    """Stops a ROUTER accepting before its process runs out of files, and at `max_clients` connections.

    Connections are counted from the monitor's events, checked against the open-file count every tick (the
    monitor drops events past its high-water mark in a burst). The door closes at two thirds of the files left
    after start (a third stays free for what libzmq accepts before the loop has looked) and opens again below
    90% of that."""

    def __init__(self, sock: zmq.Socket, door: Door, max_clients: int, io_threads: int):
        self.sock, self.door = sock, door
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
        self.counted = 0      # from the events; resync() corrects it from the open-file count
        self.floor = 0        # what the open-file count says at least, at the last resync
        self.connections = 0  # the larger of the two
        self.listening = True
        self.closings = 0     # times the door closed

    def resync(self) -> None:
        """Correct the count from the open files. Not on every event: listing /proc/self/fd costs more than libzmq
        takes to accept a connection. Each connection holds a file, so the count is at most the files opened since
        start (events of connections gone were dropped); and at least those less what the server's own files may
        take (events of new ones were dropped). Both bounds are taken afresh each time: files that were never
        connections (the metrics endpoint's, L2's) leave no count behind once they close."""
        held = max(0, open_fds() - self.base_fds)
        self.counted = min(self.counted, held)
        self.floor = max(0, held - 2 * FD_RESERVE // 3)
        self.connections = max(self.counted, self.floor)
        self.check()

    def drain(self) -> None:
        """Count the monitor's events, then open or close the door."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == zmq.EVENT_ACCEPTED:
                self.counted += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.counted = max(0, self.counted - 1)
            self.connections = max(self.counted, self.floor)
            if self.listening and self.connections >= self.max_clients:
                break  # close the door now, count the rest after
        self.check()

    def check(self) -> None:
        n = self.connections
        try:
            if self.listening and n >= self.max_clients:
                self.door.shut()
                self.listening = False
                self.closings += 1
                log.warning("%d clients connected, the cap (--max-clients, or what the open-file limit %d "
                            "leaves): not accepting more until some leave", n, fd_limit())
            elif not self.listening and n <= self.max_clients * 9 // 10:
                self.door.reopen()
                self.listening = True
                log.info("%d clients connected: accepting again", n)
        except OSError as e:  # someone moved the socket file: the loop goes on, the next check tries again
            log.error("cannot %s the endpoint %s: %s", "close" if self.listening else "reopen", self.door.path, e)

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        if not self.listening:
            self.door.discard()


def bind_gated(sock: zmq.Socket, endpoint: str, max_clients: int, io_threads: int) -> ConnectionGate:
    """Bind a ROUTER to `endpoint` (ipc:// or tcp://) behind a gate of `max_clients` connections."""
    backlog = listen_backlog(io_threads)
    sock.setsockopt(zmq.BACKLOG, backlog)
    if endpoint.startswith("ipc://"):
        sock.bind(endpoint)
        door: Door = IpcDoor(endpoint[len("ipc://"):])
    else:  # a listening socket of our own, to close the door with a filter
        door = TcpDoor.bind(sock, endpoint, backlog)
    return ConnectionGate(sock, door, max_clients, io_threads)
