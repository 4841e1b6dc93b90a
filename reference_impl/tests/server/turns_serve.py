"""`hybridkv serve` with its turn settings changed, for the tests of large lookups and prefetches in turns.

    python turns_serve.py [--one-turn] [--turn-s S] [--slice N] -- SERVE-ARGS...

--one-turn: every Lookup and Prefetch runs under a clock that never ends its turn, whatever its size (the
reference a large one's answer is compared with); --turn-s and --slice: a shorter share of the loop and fewer
objects between clock reads, so that a large request takes thousands of turns and another request surely lands
between two of them.
Everything else is the real server, started and ready as `hybridkv serve` is (launch.start_server's ready line).
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time
from dataclasses import replace

from hybridkv.server.books.config import ServerConfig
from hybridkv.server.front.cli import server_argv
from hybridkv.server.front.launch import ServerProcess

# store binds turns.TURN_S as it is imported: imported first, a PrepareStore keeps its 5 ms turns
from hybridkv.server.ops import hitrule, lookup, prefetch, store, turns  # noqa: F401


def start(config: ServerConfig, *, one_turn: bool = False, turn_s: float | None = None,
          slice_objects: int | None = None) -> ServerProcess:
    """This script's server for `config`, once ready (what launch.start_server returns)."""
    flags = [*(["--one-turn"] if one_turn else []), *(["--turn-s", str(turn_s)] if turn_s is not None else []),
             *(["--slice", str(slice_objects)] if slice_objects is not None else [])]
    cfg = server_argv(replace(config, parent_pid=os.getpid())) + ["--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, __file__, *flags, "--", *cfg], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.stdout is not None
    deadline, line = time.monotonic() + 60, ""
    while time.monotonic() < deadline and proc.poll() is None and not line:
        if select.select([proc.stdout], [], [], 0.2)[0]:
            line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line} {proc.stderr.read() if proc.stderr else ''}")
    return ServerProcess(proc, config.endpoint, line.split("arena=")[1].split()[0])


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--one-turn", action="store_true")
    ap.add_argument("--turn-s", type=float)
    ap.add_argument("--slice", type=int)
    ap.add_argument("serve", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.one_turn:
        lookup.BIG_OBJECTS = prefetch.BIG_OBJECTS = 1 << 62
    if a.turn_s is not None:
        turns.TURN_S = a.turn_s
    if a.slice is not None:
        for m in (hitrule, lookup, prefetch, turns):
            m.SLICE_OBJECTS = a.slice  # type: ignore[attr-defined]
    from hybridkv.cli import main as cli

    return cli(["serve", *(a.serve[1:] if a.serve[:1] == ["--"] else a.serve)])


if __name__ == "__main__":
    sys.exit(main())
