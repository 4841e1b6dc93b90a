"""What the cycle collector costs the server's loop with a large L1 and L2 index: a full collection's pause, and
the young collections between, while objects are stored and evicted.

    python -m hybridkv_bench.microbench.gc_pause [--objects 1000000] [--churn 300000] [--l2-objects 700000]
                                                [--tick 20000] [--json]

In one process, as the server's loop keeps them: an L1 (`L1Cache` on a real shared-memory arena) filled with
`--objects` READY objects of 4 groups, and an L2 index (`lru.LruIndex`, the filesystem L2's) of `--l2-objects`.
The collector is set as the loop sets it (`gc.freeze()` of what start made, no automatic full collection). Then
`--churn` more objects are stored, each evicting the oldest (and the index turns over as many), with a young
collection every `--tick` objects as the loop's tick makes one (0: none, as before the loop made them). Prints
the full collection after the fill, the worst young collection during the churn, and the full collection after
it: the pause the loop's periodic full collection makes (`loop.FULL_GC_EVERY_S`). A measurement, not a test;
needs --objects x 4 KiB of /dev/shm (or --shm-dir).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from typing import Any

from hybridkv.memory.arena import SLOT_ALIGN, Arena
from hybridkv.server.books.l1 import L1Cache, NoSlot
from hybridkv.server.machinery.lru import Indexed, LruIndex

GROUPS = 4
NS = b"gc-pause-ns-0001"


def timed_ms(fn: Any, *args: Any) -> float:
    t = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t) * 1e3


class Filler:
    """Stores into the L1 and the L2 index, one object at a time, with a young collection every `tick` objects."""

    def __init__(self, l1: L1Cache, index: LruIndex[Indexed], l2_objects: int, tick: int):
        self.l1, self.index, self.l2_objects, self.tick = l1, index, l2_objects, tick
        self.young_ms: list[float] = []

    def store(self, lo: int, hi: int) -> None:
        l1, index, tick = self.l1, self.index, self.tick
        for i in range(lo, hi):
            key = i.to_bytes(16, "little")
            e = l1.reserve(key, i % GROUPS, NS, 1)
            assert not isinstance(e, NoSlot), f"no slot: {e}"
            l1.make_ready(e)
            if self.l2_objects:
                if len(index) >= self.l2_objects:
                    index.pop_oldest()
                index.put(Indexed(oid=(key, i % GROUPS), size=1))
            if tick and i % tick == 0:
                self.young_ms.append(timed_ms(gc.collect, 0))


def measure(objects: int, churn: int, l2_objects: int, tick: int, shm_dir: str) -> dict[str, Any]:
    thresholds = gc.get_threshold()
    directory = tempfile.TemporaryDirectory(prefix="gc-pause-", dir=shm_dir)
    arena = Arena(objects * SLOT_ALIGN, directory.name)
    try:
        gc.collect()
        gc.freeze()  # as serve_forever: what start made is never walked
        gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
        f = Filler(L1Cache(arena), LruIndex(), l2_objects, tick)
        t = time.perf_counter()
        f.store(0, objects)
        fill_s = time.perf_counter() - t
        full_fill = timed_ms(gc.collect)
        f.young_ms.clear()
        f.store(objects, objects + churn)
        tracked = len(gc.get_objects())
        full_churn = timed_ms(gc.collect)
        full_quiet = timed_ms(gc.collect)
        assert len(f.l1) == objects and len(f.index) == min(l2_objects, objects + churn)
        return {"objects": objects, "churn": churn, "l2_objects": l2_objects, "tick": tick, "fill_s": fill_s,
                "full_gc_after_fill_ms": full_fill, "full_gc_after_churn_ms": full_churn,
                "full_gc_quiet_ms": full_quiet, "tracked_before_full_gc": tracked,
                "worst_young_gc_ms": max(f.young_ms, default=0.0), "young_gcs": len(f.young_ms)}
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        arena.close()
        directory.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="hybridkv_bench.microbench.gc_pause",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--churn", type=int, default=300_000)
    ap.add_argument("--l2-objects", type=int, default=700_000)
    ap.add_argument("--tick", type=int, default=20_000, help="objects between young collections (0: none)")
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for name in ("objects", "churn", "l2_objects", "tick"):
        if getattr(args, name) < (1 if name == "objects" else 0):
            ap.error(f"--{name.replace('_', '-')} must be {'positive' if name == 'objects' else 'at least 0'}")
    res = measure(args.objects, args.churn, args.l2_objects, args.tick, args.shm_dir)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"L1 {res['objects']:,} objects, L2 index {res['l2_objects']:,}, churn {res['churn']:,} "
              f"(young collection every {res['tick'] or 'never'}): full collection after the fill "
              f"{res['full_gc_after_fill_ms']:.1f} ms, after the churn {res['full_gc_after_churn_ms']:.1f} ms "
              f"({res['tracked_before_full_gc']:,} tracked objects), quiet {res['full_gc_quiet_ms']:.1f} ms; "
              f"worst young collection {res['worst_young_gc_ms']:.2f} ms of {res['young_gcs']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
