"""The filesystem L2 index's worst single step at a given size: one OrderedDict (the index before `lru.LruIndex`)
against `LruIndex`, the same operations on both, alternated.

Each step is what `FilesystemL2` does to its index under its lock (and the GIL, so every other thread, the
server's loop included, waits as long): a commit's insert (a new entry at the young end), a hit's move to the
young end, and an eviction of the oldest. The run fills the index to `--objects` (timing every insert), then
churns at that size (`--churn` steps, each a hit of a random object or a put that evicts the oldest and inserts
a new one; dicts with deletions resize to compact as they fill, so a full L2 meets resizes too). It prints, per
structure and phase, the worst step, the 99.99th percentile and the mean, in microseconds. The cycle collector is
off while steps are timed (its pauses are not the index's); then a full collection is timed with the index and
without it.

    python -m hybridkv_bench.microbench.l2_index [--objects 700000] [--churn 300000] [--rounds 2] [--json]

A measurement, not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hybridkv.model.keys import ObjectKey
from hybridkv.server.l2.fs import _IndexEntry
from hybridkv.server.machinery.lru import LruIndex

NS = b"ns"


@dataclass(slots=True)
class _OldEntry:  # FilesystemL2's index entry while its index was one OrderedDict
    ns: bytes
    length: int
    gen: int


class _Before:
    """The index as one OrderedDict, least recently used first, driven as FilesystemL2 drove it."""

    def __init__(self) -> None:
        self.d: OrderedDict[ObjectKey, _OldEntry] = OrderedDict()

    def insert(self, oid: ObjectKey, gen: int) -> None:
        self.d.pop(oid, None)
        self.d[oid] = _OldEntry(NS, 4096, gen)

    def hit(self, oid: ObjectKey) -> None:
        if self.d.get(oid) is not None:
            self.d.move_to_end(oid)

    def evict(self) -> None:
        self.d.popitem(last=False)


class _After:
    """The index as FilesystemL2 holds it now."""

    def __init__(self) -> None:
        self.d: LruIndex[_IndexEntry] = LruIndex()

    def insert(self, oid: ObjectKey, gen: int) -> None:
        self.d.put(_IndexEntry(oid, 4096, NS, gen))

    def hit(self, oid: ObjectKey) -> None:
        e = self.d.get(oid)
        if e is not None:
            self.d.touch(e)

    def evict(self) -> None:
        self.d.pop_oldest()


def _summary(ns: list[int]) -> dict[str, Any]:
    s = sorted(ns)
    return {"steps": len(s), "worst_us": s[-1] / 1e3, "p9999_us": s[int(len(s) * 0.9999)] / 1e3,
            "mean_us": sum(s) / len(s) / 1e3, "worst5_us": [round(x / 1e3) for x in s[:-6:-1]]}


def run_one(make: Any, objects: int, churn: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    oids = [(rng.randbytes(16), 0) for _ in range(objects + churn)]
    index = make()
    clock = time.perf_counter_ns
    fill: list[int] = []
    gc.collect()
    gc.disable()
    try:
        for gen, oid in enumerate(oids[:objects]):
            t = clock()
            index.insert(oid, gen)
            fill.append(clock() - t)
        held = oids[:objects]  # hits pick from these (some evicted meanwhile: a miss, as a get of one would be)
        hits: list[int] = []
        puts: list[int] = []
        nxt = objects
        for _ in range(churn):
            if rng.random() < 0.5:
                oid = held[rng.randrange(objects)]
                t = clock()
                index.hit(oid)
                hits.append(clock() - t)
            else:
                oid = oids[nxt]
                held[rng.randrange(objects)] = oid
                t = clock()
                index.evict()
                index.insert(oid, nxt)
                puts.append(clock() - t)
                nxt += 1
    finally:
        gc.enable()
    out: dict[str, Any] = {"fill": _summary(fill), "churn_hit": _summary(hits), "churn_put": _summary(puts)}
    del oids, held, fill, hits, puts
    out["full_gc_ms"] = _full_gc_ms()  # the index's and the process's
    del index
    out["full_gc_ms_without"] = _full_gc_ms()
    return out


def _full_gc_ms() -> float:
    gc.collect()  # the first also walks what was made since (and stops tracking the keys): the second is timed
    t = time.perf_counter_ns()
    gc.collect()
    return (time.perf_counter_ns() - t) / 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=700_000)
    ap.add_argument("--churn", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=2, help="each structure this many times, alternated")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    out: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for r in range(a.rounds):
        for name, make in (("before", _Before), ("after", _After)):
            out[name].append(run_one(make, a.objects, a.churn, seed=r))
            gc.collect()
    if a.json:
        print(json.dumps({"objects": a.objects, "churn": a.churn, **out}, indent=1))
        return
    print(f"{a.objects} objects, {a.churn} churn steps; worst / p99.99 / mean step, us")
    for name, runs in out.items():
        for i, res in enumerate(runs):
            cells = "  ".join(f"{ph} {res[ph]['worst_us']:9.0f} {res[ph]['p9999_us']:6.0f} {res[ph]['mean_us']:5.2f}"
                              for ph in ("fill", "churn_hit", "churn_put"))
            print(f"{name:6} #{i}  {cells}  full gc {res['full_gc_ms']:.0f} ms "
                  f"({res['full_gc_ms_without']:.0f} without the index)")
            print("          worst five:", "  ".join(f"{ph} {res[ph]['worst5_us']}" for ph in ("fill", "churn_hit",
                                                                                             "churn_put")))


if __name__ == "__main__":
    main()
