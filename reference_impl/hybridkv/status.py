"""`hybridkv status`: a running cache server summed up for an operator (like `redis-cli info` or `nvidia-smi`).

It sends the protocol's Status request, which every client may send, so it works on a server started without
--admin; the reply holds server-wide totals and sizes only (docs/trust-model.md). Runs anywhere the endpoint
is reachable; never imports torch.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

NEAR_LIMIT = 0.8  # a bound used this much or more is listed under "near limits"
BAR = 24


def add_arguments(p: argparse.ArgumentParser) -> None:
    import os

    from hybridkv.wire.endpoints import ENDPOINT_ENV, endpoint_from

    p.add_argument("--endpoint", default=endpoint_from(os.environ),
                   help=f"the server's endpoint (default: ${ENDPOINT_ENV} if set, else where `hybridkv serve` listens "
                        "by default: %(default)s)")
    p.add_argument("--watch", type=float, default=None, metavar="S",
                   help="show it again every S seconds until Ctrl-C")
    p.add_argument("--timeout", type=float, default=2.0, metavar="S",
                   help="seconds to wait for the server's answer (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the server's Status reply as JSON instead")


MAX_REPLY_BYTES = 64 << 10  # a real reply is a few KiB; a larger one is refused unread (libzmq drops it)
MAX_TEXT = 80  # characters of any text the reply holds (version, error codes) that are shown
ABSURD = float(1 << 62)  # no count, size or second of a real server comes near it
UNKNOWN = "?"
LISTED = 16  # error codes and recent errors shown at most (a real server has 12 codes and keeps 8 errors)


def text(value: object, limit: int = MAX_TEXT, json: bool = False) -> str:
    """`value` as text safe for a terminal: every control or format character (ESC, CR, BEL, bidi overrides)
    escaped as Python writes it (json: as JSON writes it, for JSON text, where they occur only inside strings), and
    at most `limit` characters."""
    s = value if isinstance(value, str) else repr(value)
    escape = json_escape if json else lambda c: c.encode("unicode_escape").decode("ascii")
    out = "".join(c if c.isprintable() else escape(c) for c in s[:limit])
    return out + ("..." if len(s) > limit else "")


def json_escape(c: str) -> str:
    """One character as a JSON string escape (a surrogate pair above U+FFFF)."""
    units = c.encode("utf-16-be")
    return "".join(f"\\u{int.from_bytes(units[i:i + 2]):04x}" for i in range(0, len(units), 2))


def figure(table: object, key: str) -> float | None:
    """table[key] when it is a figure a server can have (a finite number, 0 or more, below ABSURD); else None,
    shown as "?"."""
    value = table.get(key) if isinstance(table, dict) else None
    return number(value)


def bound(limits: object, key: str) -> float | None:
    """A configured bound: as figure(), and above 0 (the server takes no bound of 0)."""
    value = figure(limits, key)
    return value if value else None


def number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if 0 <= value < ABSURD else None  # `not` of nan: every comparison with it is false


def bar(used: float | None, capacity: float | None) -> str:
    """[#####.....] 42%: a bar of BAR characters and the percentage; "?" where the figures cannot be."""
    if used is None or capacity is None or used > capacity:
        return f"[{UNKNOWN * BAR}]   {UNKNOWN}"
    frac = used / capacity if capacity > 0 else 0.0
    n = min(BAR, round(frac * BAR))
    return f"[{'#' * n}{'.' * (BAR - n)}] {100 * frac:3.0f}%"


def size(nbytes: float | None) -> str:
    if nbytes is None:
        return UNKNOWN
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def duration(s: float | None) -> str:
    """12.3 s under a minute, else 4m 05s, 2h 03m 04s, 1d 2h 03m 04s."""
    if s is None:
        return UNKNOWN
    if s < 60:
        return f"{s:.1f} s"
    s = int(s)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return (f"{d}d " if d else "") + (f"{h}h " if d or h else "") + f"{m}m {s % 60:02d}s"


def num(n: float | None) -> str:
    return UNKNOWN if n is None else f"{round(n):,}"


def count(n: float | None, noun: str) -> str:
    return f"{num(n)} {noun}" + ("" if n == 1 else "s")


def rate(part: float | None, whole: float | None) -> str:
    if part is None or whole is None or part > whole:
        return UNKNOWN
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def gbps(nbytes: float | None, seconds: float) -> str:
    return UNKNOWN if nbytes is None else f"{nbytes / seconds / 1e9:.3g}"


def near_limits(f: dict, lim: dict) -> list[str]:
    """The configured bounds used NEAR_LIMIT or more, one phrase each (a bound or a figure unknown: not listed)."""
    out = []
    for what, used, most in (("engines", figure(f, "engines"), bound(lim, "max_engines")),
                             ("leases of one engine", figure(f, "leases_max_engine"), bound(lim, "max_leases")),
                             ("reservations of one engine", figure(f, "reservations_max_engine"),
                              bound(lim, "max_reservations"))):
        if used is not None and most and used / most >= NEAR_LIMIT:
            out.append(f"{what} {num(used)} of {num(most)} ({100 * used / most:.0f}%)")
    return out


def render(endpoint: str, r) -> str:
    """The summary of one StatusResult, as lines of text. Any reply renders: a figure that is missing or that no
    server can have (negative, nan, inf, absurdly large) shows as "?", and text is escaped (text())."""
    f, lim, w = r.figures, r.limits, r.window
    g = lambda key: figure(f, key)  # noqa: E731
    pid = r.pid if number(r.pid) and isinstance(r.pid, int) else UNKNOWN
    lines = [f"hybridkv server at {text(endpoint, 200)}: version {text(r.version)}, pid {pid}, "
             f"up {duration(number(r.uptime_s))}"]
    lines.append(f"  L1  {bar(g('l1_bytes_used'), g('l1_capacity_bytes'))}  {size(g('l1_bytes_used'))} of "
                 f"{size(g('l1_capacity_bytes'))}, {num(g('l1_objects'))} objects ({num(g('l1_pinned_objects'))} "
                 f"pinned), {num(g('l1_evictions'))} evicted")
    if g("l2_capacity_bytes") != 0:
        lines.append(f"  L2  {bar(g('l2_bytes'), g('l2_capacity_bytes'))}  {size(g('l2_bytes'))} of "
                     f"{size(g('l2_capacity_bytes'))}, {num(g('l2_objects'))} objects, {num(g('l2_evictions'))} "
                     f"evicted, {num(g('l2_corrupt_removed'))} corrupt removed")
    else:
        lines.append("  L2  none")
    ws = number(r.window_s)
    if ws:
        wf = lambda key: figure(w, key)  # noqa: E731
        lines.append(f"  last {duration(ws)}: hit rate {rate(wf('hit_chunks'), wf('lookup_chunks'))} of "
                     f"{num(wf('lookup_chunks'))} chunks looked up; stored {gbps(wf('bytes_committed'), ws)} GB/s, "
                     f"loaded {gbps(wf('bytes_leased'), ws)} GB/s, spilled {gbps(wf('l2_spill_bytes'), ws)} GB/s, "
                     f"reloaded {gbps(wf('l2_prefetch_bytes'), ws)} GB/s; {count(wf('requests'), 'request')}, "
                     f"{count(wf('errors'), 'error')}")
    elif ws is None:
        lines.append(f"  last {UNKNOWN}: the reply's window is {text(r.window_s)}")
    else:
        lines.append("  last minute: no figures yet (the server samples its totals once a second)")
    lines.append(f"  since start: hit rate {rate(g('hit_chunks'), g('lookup_chunks'))} of {num(g('lookup_chunks'))} "
                 f"chunks ({num(g('hit_tokens'))} of {num(g('lookup_tokens'))} tokens, {num(g('hit_chunks_l2'))} "
                 f"chunks back from L2); stored {size(g('bytes_committed'))}, loaded {size(g('bytes_leased'))}; "
                 f"{count(g('requests'), 'request')}, {count(g('errors'), 'error')}")
    lines.append(f"  engines {num(g('engines'))} of {num(bound(lim, 'max_engines'))} in {num(g('namespaces'))} "
                 f"namespaces; leases {num(g('leases'))} (one engine at most {num(g('leases_max_engine'))} of "
                 f"{num(bound(lim, 'max_leases'))}); reservations {num(g('reservations'))} (one engine at most "
                 f"{num(g('reservations_max_engine'))} of {num(bound(lim, 'max_reservations'))}); "
                 f"{num(g('parked'))} requests waiting")
    near = near_limits(f, lim)
    lines.append("  near limits: " + ("; ".join(near) if near else "none"))
    if r.errors:
        codes = sorted(r.errors.items())
        lines.append("  errors by code: " + ", ".join(f"{text(code)} {num(number(n))}" for code, n in codes[:LISTED])
                     + (f" and {len(codes) - LISTED} more codes" if len(codes) > LISTED else ""))
        lines.append("  last errors: " + "; ".join(f"{text(e.request)} {text(e.code)} {duration(number(e.age_s))} ago"
                                                   for e in r.recent_errors[:LISTED]))
    else:
        lines.append("  errors: none")
    if any(UNKNOWN in line for line in lines):
        lines.append(f"  {UNKNOWN}: a figure the reply lacks, or one no server can have (negative, nan, inf)")
    return "\n".join(lines)


def ask(endpoint: str, timeout_s: float):
    """The server's StatusResult; UserError (one line, exit 2) when none answers or the reply is bad.

    A socket of its own, not CacheClient: a reply that does not decode is this command's error to name (the
    client would drop it and time out), and a reply over MAX_REPLY_BYTES is refused before it is read."""
    import msgspec
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from hybridkv.cli import UserError
    from hybridkv.wire import protocol as P

    if endpoint.startswith("ipc://") and not Path(endpoint[len("ipc://"):]).exists():
        raise UserError(f"no cache server at {text(endpoint, 200)}: the socket file does not exist")
    where = text(endpoint, 200)
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    # libzmq drops the connection of a frame over MAXMSGSIZE: the monitor tells that from a silent server
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(endpoint)
        sock.send(P.encode(P.Status(id=1)))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        until = time.monotonic() + timeout_s
        while True:
            left = until - time.monotonic()
            ready = dict(poller.poll(max(0, int(left * 1000)))) if left > 0 else {}
            if sock in ready:
                frames = sock.recv_multipart()
                break
            if monitor in ready:
                recv_monitor_message(monitor)
                raise UserError(f"the server at {where} closed the connection before its Status reply was read "
                                f"(it stopped, or sent a reply over {MAX_REPLY_BYTES >> 10} KiB, which is refused)")
            if not ready and left <= 0:
                raise UserError(f"no cache server answered at {where} within {timeout_s:g} s")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    try:
        reply = P.decode_reply(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise UserError(f"the server at {where} sent a bad Status reply: {text(str(e))}") from None
    except Exception as e:  # noqa: BLE001 - a hostile frame may trip anything (RecursionError among them)
        raise UserError(f"the server at {where} sent a bad Status reply: {type(e).__name__}") from None
    if isinstance(reply, P.Error):
        raise UserError(f"the server at {where} refused Status ({text(reply.code)}: {text(reply.message)}); "
                        "an older hybridkv?")
    if not isinstance(reply, P.StatusResult):
        raise UserError(f"the server at {where} answered Status with {type(reply).__name__}")
    if len(frames) > 1:
        raise UserError(f"the server at {where} sent a bad Status reply: {len(frames) - 1} payload frames after it")
    return reply


HOME, CLEAR_SCREEN, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[2J", "\x1b[K", "\x1b[J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def frame(text: str, first: bool) -> str:
    """`text` drawn over the previous frame on a terminal: the cursor goes home and each line is rewritten, its
    rest and the lines below cleared. Only the first frame clears the screen: a clear per frame pushes a screen
    into the terminal's scrollback at each refresh in many terminals (VTE, tmux)."""
    return (HOME + CLEAR_SCREEN if first else HOME) + text.replace("\n", CLEAR_LINE + "\n") + CLEAR_LINE + CLEAR_BELOW


def run(args: argparse.Namespace) -> int:
    import math

    import msgspec

    from hybridkv.cli import UserError

    if args.watch is not None and not 0 < args.watch < math.inf:
        raise UserError(f"--watch must be a positive number of seconds, got {args.watch:g}")
    if not 0 < args.timeout < math.inf:
        raise UserError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    redraw = sys.stdout.isatty() and args.watch is not None and not args.json
    # Watching, Ctrl-C (SIGINT) ends the loop between two asks, not inside one (its socket then closed unread)
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if args.watch is not None else None
    first = True
    try:
        while True:
            r = ask(args.endpoint, args.timeout)
            if args.json:
                print(text(msgspec.json.encode(r).decode(), limit=MAX_REPLY_BYTES * 8, json=True), flush=True)
            elif redraw:
                print((HIDE_CURSOR if first else "") + frame(render(args.endpoint, r), first), end="", flush=True)
            else:
                print(("" if first else "\n") + render(args.endpoint, r), flush=True)
            first = False
            if args.watch is None or stop.wait(args.watch):
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if redraw and not first:
            print(SHOW_CURSOR, end="", flush=True)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
