"""An engine that stores into a cache server until it is killed (the L2 SIGKILL test's load).

    python l2_store_loop.py ENDPOINT PRESET FIRST_SEED

Stores one fresh chunk (every group) per request, keys from `Engine.keys(1, seed=i)` for i from
FIRST_SEED on, and every third round looks an older chunk up again, so the server spills and
prefetches all the time. Prints `ready` once the first chunks are stored, then runs until killed.
"""

from __future__ import annotations

import sys

from hybridkv.engine.client import CacheClient
from hybridkv.model.presets import preset_layout
from hybridkv.wire import protocol as P
from serverkit import Engine


def main(endpoint: str, preset: str, first: int) -> None:
    """Store and look up forever; the parent kills the server, then this process."""
    client = CacheClient(endpoint, timeout_s=30)
    eng = Engine(client, layout=preset_layout(preset))
    i = first
    while True:
        eng.store(eng.keys(1, seed=i), request=str(i))
        if i % 3 == 0 and i > first:
            keys = eng.keys(1, seed=first + (i * 7919) % (i - first))
            res = eng.lookup(keys, policy="all", request=f"l{i}")
            eng.check(keys, res)
            if res.lease:
                client.call(P.Release(engine=eng.id, lease=res.lease))
        if i == first + 2:
            print("ready", flush=True)
        i += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
