"""Store requests of any size against real server processes: the work of a huge PrepareStore (and a lookup of
its keys) grows linearly, and it runs in turns so other clients are served meanwhile."""

from __future__ import annotations

import time

import numpy as np
from hybridkv.engine.client import CacheClient
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.wire import protocol as P
from serverkit import Engine, alive


def test_large_requests_cost_linear_work(server_factory):
    srv = server_factory("--max-keys", "65536", l1_gib=0.2)
    layout = ModelLayout(model="tiny-attn", groups=(GroupLayout(kind="attention", layer_names=("l0",),
                                                                page_bytes=64, block_tokens=16),))
    with CacheClient(srv.endpoint, timeout_s=60) as c:
        eng = Engine(c, layout=layout)
        keys = eng.keys(65536, seed=8)
        t = time.monotonic()
        prep, _ = c.call(P.PrepareStore(engine=eng.id, request="r", keys=keys,
                                        objects=[(i, 0) for i in range(len(keys))]))
        c.call(P.AbortStore(engine=eng.id, reservation=prep.reservation))
        r, _ = c.call(P.Lookup(engine=eng.id, request="r", keys=keys))
        # generous for a loaded 2-core machine; quadratic work (the old todo.pop(0)) takes minutes here
        assert time.monotonic() - t < 30 and r.hit_chunks == 0
        assert alive(srv.endpoint)


def test_a_huge_prepare_lets_other_clients_through_while_it_works(server_factory):
    """A 200,000-object PrepareStore took the loop for its whole length (0.5 to 2 s here), so a request another
    client sent just after it was answered after it. Now it works in 5 ms turns, and the other is answered first."""
    s = server_factory(l1_gib=1.0)
    groups = (GroupLayout(kind="attention", layer_names=("a",), page_bytes=4096, block_tokens=16),) + tuple(
        GroupLayout(kind="recurrent", layer_names=(f"r{i}",), page_bytes=4096, block_tokens=16) for i in range(3))
    n = 50_000
    with CacheClient(s.endpoint, timeout_s=60) as big, CacheClient(s.endpoint, timeout_s=60) as other:
        reg = big.call(P.Register(layout=ModelLayout(model="m", groups=groups), chunk_tokens=16))[0]
        keys = chunk_keys(reg.namespace, np.arange(n * 16), 16)
        msg = P.PrepareStore(engine=reg.engine, request="r", keys=keys,
                             objects=[(c, g) for c in range(n) for g in range(4)])
        done: dict[str, float] = {}
        fut = big.submit(msg)
        fut.add_done_callback(lambda _: done.setdefault("prepare", time.monotonic()))
        time.sleep(0.05)  # the prepare has arrived and started
        t = time.monotonic()
        assert other.call(P.Health())[0].status == "ok"
        done["health"] = time.monotonic()
        prep = fut.result(timeout=60)[0]
        assert len(prep.slots) == 4 * n
        assert done["health"] < done["prepare"], "the other client waited for the whole prepare"
        print(f"Health answered in {1e3 * (done['health'] - t):.1f} ms during a prepare of {4 * n} objects "
              f"that took {done['prepare'] - t:.2f} s")
