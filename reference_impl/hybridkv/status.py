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
from pathlib import Path

NEAR_LIMIT = 0.8  # a bound used this much or more is listed under "near limits"
BAR = 24


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hybridkv.endpoints import default_endpoint

    p.add_argument("--endpoint", default=default_endpoint(), help="the server's endpoint (default: %(default)s)")
    p.add_argument("--watch", type=float, default=None, metavar="S",
                   help="show it again every S seconds until Ctrl-C")
    p.add_argument("--timeout", type=float, default=2.0, metavar="S",
                   help="seconds to wait for the server's answer (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the server's Status reply as JSON instead")


def bar(used: float, capacity: float) -> str:
    """[#####.....] 42%: a bar of BAR characters and the percentage."""
    frac = used / capacity if capacity > 0 else 0.0
    n = min(BAR, round(frac * BAR))
    return f"[{'#' * n}{'.' * (BAR - n)}] {100 * frac:3.0f}%"


def size(nbytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def duration(s: float) -> str:
    """12.3 s under a minute, else 4m 05s, 2h 03m 04s, 1d 2h 03m 04s."""
    if s < 60:
        return f"{s:.1f} s"
    s = int(s)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return (f"{d}d " if d else "") + (f"{h}h " if d or h else "") + f"{m}m {s % 60:02d}s"


def count(n: float, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def rate(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def near_limits(f: dict, lim: dict) -> list[str]:
    """The configured bounds used NEAR_LIMIT or more, one phrase each."""
    out = []
    for what, used, bound in (("engines", f["engines"], lim["max_engines"]),
                              ("leases of one engine", f["leases_max_engine"], lim["max_leases"]),
                              ("reservations of one engine", f["reservations_max_engine"], lim["max_reservations"])):
        if bound and used / bound >= NEAR_LIMIT:
            out.append(f"{what} {used:,} of {bound:,} ({100 * used / bound:.0f}%)")
    return out


def render(endpoint: str, r) -> str:
    """The summary of one StatusResult, as lines of text."""
    f, lim, w, ws = r.figures, r.limits, r.window, r.window_s
    lines = [f"hybridkv server at {endpoint}: version {r.version}, pid {r.pid}, up {duration(r.uptime_s)}"]
    lines.append(f"  L1  {bar(f['l1_bytes_used'], f['l1_capacity_bytes'])}  {size(f['l1_bytes_used'])} of "
                 f"{size(f['l1_capacity_bytes'])}, {f['l1_objects']:,} objects ({f['l1_pinned_objects']:,} pinned), "
                 f"{f['l1_evictions']:,} evicted")
    if f["l2_capacity_bytes"]:
        lines.append(f"  L2  {bar(f['l2_bytes'], f['l2_capacity_bytes'])}  {size(f['l2_bytes'])} of "
                     f"{size(f['l2_capacity_bytes'])}, {f['l2_objects']:,} objects, {f['l2_evictions']:,} evicted, "
                     f"{f['l2_corrupt_removed']:,} corrupt removed")
    else:
        lines.append("  L2  none")
    if ws > 0:
        gbps = {k: w[k] / ws / 1e9 for k in ("bytes_committed", "bytes_leased", "l2_spill_bytes", "l2_prefetch_bytes")}
        lines.append(f"  last {duration(ws)}: hit rate {rate(w['hit_chunks'], w['lookup_chunks'])} of "
                     f"{w['lookup_chunks']:,} chunks looked up; stored {gbps['bytes_committed']:.3g} GB/s, loaded "
                     f"{gbps['bytes_leased']:.3g} GB/s, spilled {gbps['l2_spill_bytes']:.3g} GB/s, reloaded "
                     f"{gbps['l2_prefetch_bytes']:.3g} GB/s; {count(w['requests'], 'request')}, "
                     f"{count(w['errors'], 'error')}")
    else:
        lines.append("  last minute: no figures yet (the server samples its totals once a second)")
    lines.append(f"  since start: hit rate {rate(f['hit_chunks'], f['lookup_chunks'])} of {f['lookup_chunks']:,} "
                 f"chunks ({f['hit_tokens']:,} of {f['lookup_tokens']:,} tokens, {f['hit_chunks_l2']:,} chunks back "
                 f"from L2); stored {size(f['bytes_committed'])}, loaded {size(f['bytes_leased'])}; "
                 f"{count(f['requests'], 'request')}, {count(f['errors'], 'error')}")
    lines.append(f"  engines {f['engines']:,} of {lim['max_engines']:,} in {f['namespaces']:,} namespaces; "
                 f"leases {f['leases']:,} (one engine at most {f['leases_max_engine']:,} of {lim['max_leases']:,}); "
                 f"reservations {f['reservations']:,} (one engine at most {f['reservations_max_engine']:,} of "
                 f"{lim['max_reservations']:,}); {f['parked']:,} requests waiting")
    near = near_limits(f, lim)
    lines.append("  near limits: " + ("; ".join(near) if near else "none"))
    if r.errors:
        lines.append("  errors by code: " + ", ".join(f"{code} {n:,}" for code, n in sorted(r.errors.items())))
        lines.append("  last errors: " + "; ".join(f"{e.request} {e.code} {duration(e.age_s)} ago"
                                                   for e in r.recent_errors))
    else:
        lines.append("  errors: none")
    return "\n".join(lines)


def ask(endpoint: str, timeout_s: float):
    """The server's StatusResult; UserError (one line, exit 2) when none answers."""
    from hybridkv import protocol as P
    from hybridkv.cli import UserError
    from hybridkv.engine.client import CacheClient, ServerError, ServerTimeout

    if endpoint.startswith("ipc://") and not Path(endpoint[len("ipc://"):]).exists():
        raise UserError(f"no cache server at {endpoint}: the socket file does not exist")
    client = CacheClient(endpoint, timeout_s=timeout_s)
    try:
        reply, _ = client.call(P.Status())
    except ServerTimeout:
        raise UserError(f"no cache server answered at {endpoint} within {timeout_s:g} s") from None
    except ServerError as e:
        raise UserError(f"the server at {endpoint} refused Status ({e.code}: {e.message}); "
                        "an older hybridkv?") from None
    finally:
        client.close()
    if not isinstance(reply, P.StatusResult):
        raise UserError(f"the server at {endpoint} answered Status with {type(reply).__name__}")
    return reply


def run(args: argparse.Namespace) -> int:
    import msgspec

    from hybridkv.cli import UserError

    if args.watch is not None and not args.watch > 0:
        raise UserError(f"--watch must be a positive number of seconds, got {args.watch:g}")
    if not args.timeout > 0:
        raise UserError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    clear = sys.stdout.isatty() and args.watch is not None
    # Watching, Ctrl-C (SIGINT) ends the loop between two asks: raised inside the client (its lock taken, its
    # I/O thread starting or being joined) it could leave the client stuck in its close, and the command with it
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if args.watch is not None else None
    try:
        while True:
            r = ask(args.endpoint, args.timeout)
            text = msgspec.json.encode(r).decode() if args.json else render(args.endpoint, r)
            print(("\x1b[H\x1b[2J" if clear else "") + text, flush=True)
            if args.watch is None or stop.wait(args.watch):
                return 0
            if not clear and not args.json:
                print(flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
