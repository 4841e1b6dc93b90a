"""The hit rule against hostile sliding-window layouts, on real server processes: a lookup whose short window
misses everywhere costs linear work, and the hit over random holes is the longest length every window covers."""

from __future__ import annotations

import time

import numpy as np
from hybridkv.engine.client import CacheClient
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.wire import protocol as P


def sliding(name: str, window: int) -> GroupLayout:
    return GroupLayout(kind="sliding", layer_names=(name,), page_bytes=2, block_tokens=1, window=window)


def test_a_lookup_whose_short_window_misses_everywhere_is_linear_not_quadratic(server_factory):
    """A sliding-only layout: group 0's window of 2 tokens needs chunk n-1 at every length, and it is never
    stored; group 1's window of 2**32 tokens needs every chunk, all stored. The hit rule went down one length at
    a time and re-read group 1's whole window at each: keys^2 / 2 set lookups for one Lookup (16 s at 32,768
    keys, every other client waiting). Now each chunk is read once per group: 60-75 ms here (a full attention hit
    of as many keys: 12-29 ms)."""
    s = server_factory(l1_gib=0.5)
    n = 1 << 15
    layout = ModelLayout(model="m", groups=(sliding("a", 2), sliding("b", 1 << 32)))
    with CacheClient(s.endpoint, timeout_s=120) as c, CacheClient(s.endpoint, timeout_s=120) as other:
        reg = c.call(P.Register(layout=layout, chunk_tokens=1))[0]
        keys = chunk_keys(reg.namespace, np.arange(n), 1)
        prep = c.call(P.PrepareStore(engine=reg.engine, request="r", keys=keys,
                                     objects=[(i, 1) for i in range(n)]))[0]
        c.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation))
        for pin in (False, True):
            done: dict[str, float] = {}
            t = time.monotonic()
            fut = c.submit(P.Lookup(engine=reg.engine, request="r", keys=keys, pin=pin))
            fut.add_done_callback(lambda _, done=done: done.setdefault("lookup", time.monotonic()))
            time.sleep(0.01)
            t0 = time.monotonic()
            assert other.call(P.Health())[0].status == "ok"
            wait = time.monotonic() - t0
            res = fut.result(timeout=120)[0]
            took = done["lookup"] - t
            print(f"pin={pin}: lookup of {n} keys {1e3 * took:.1f} ms, other client waited {1e3 * wait:.1f} ms")
            assert res.hit_chunks == 0
            assert wait < 0.5 and took < 0.5, (took, wait)


def test_the_hit_over_random_holes_is_the_longest_length_every_window_covers(server_factory):
    """The hit rule's search (it remembers what each group has shown available) against the rule read
    literally, length by length, over random holes in groups of different windows."""
    s = server_factory()
    rng = np.random.default_rng(7)
    groups = (sliding("a", 3), sliding("b", 6), sliding("c", 17), sliding("d", 6),
              GroupLayout(kind="attention", layer_names=("e",), page_bytes=2, block_tokens=1),
              GroupLayout(kind="recurrent", layer_names=("f",), page_bytes=2, block_tokens=1))
    layout = ModelLayout(model="m", groups=groups)
    starts = [lambda m: 0, lambda m: max(0, m - 1)]  # attention: every chunk; recurrent: the last (m > 0)
    n = 40
    with CacheClient(s.endpoint, timeout_s=30) as c:
        reg = c.call(P.Register(layout=layout, chunk_tokens=2))[0]
        for trial in range(30):
            keys = chunk_keys(reg.namespace, rng.integers(0, 1 << 30, n * 2), 2)
            held = {(i, g) for i in range(n) for g in range(6) if rng.random() > 0.02 * (trial % 4)}
            prep = c.call(P.PrepareStore(engine=reg.engine, request="r", keys=keys, objects=sorted(held)))[0]
            c.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation))
            want = max(m for m in range(n + 1) if all(
                (i, g) in held for g, grp in enumerate(groups)
                for i in range(grp.window_start_chunk(m, 2) if g < 4 else starts[g - 4](m), m)))
            assert c.call(P.Lookup(engine=reg.engine, request="r", keys=keys))[0].hit_chunks == want, trial
