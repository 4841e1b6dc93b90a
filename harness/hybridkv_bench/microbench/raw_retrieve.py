"""The raw format's Retrieve against a real server: GB/s of the reply frames beside the host memcpy ceiling.

One client stores `objects` objects of `object_kib` KiB (one attention group), holds a lease on them, then times
`rounds` Retrieves of the whole lease (the server's send of its zero-copy frames, the socket, the client's receive),
each followed by a Lookup and a Release as an engine would issue them (not timed: the next round's lease). The
ceiling is a host memcpy of the same bytes timed right after each Retrieve: the socket copies each byte at least
once, so the retrieve cannot beat it, and on a shared machine a round's ratio to its own ceiling moves less than
either figure alone. The first reply's bytes are checked.

    python -m hybridkv_bench.microbench.raw_retrieve [--object-kib 256 1024] [--objects 64] [--rounds 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import numpy as np
from hybridkv.engine.client import CacheClient
from hybridkv.model.keys import chunk_keys
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.server.books.config import ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P
from hybridkv.wire.wire_formats import TRAITS

# the raw format, by what it is: frames of the objects' bytes, which the server neither decodes nor copies itself
RAW = next(f for f, t in TRAITS.items() if not (t.direct or t.server_imports_torch or t.server_holds_cuda))
CHUNK_TOKENS = 256
BLOCK_TOKENS = 16


def layout_of(object_bytes: int) -> ModelLayout:
    """One attention group whose object (a chunk of CHUNK_TOKENS tokens) is `object_bytes`."""
    page = object_bytes // (CHUNK_TOKENS // BLOCK_TOKENS)
    return ModelLayout(model=f"raw-{object_bytes}", groups=(
        GroupLayout(kind="attention", layer_names=("l0",), page_bytes=page, block_tokens=BLOCK_TOKENS),))


def case(endpoint: str, object_bytes: int, objects: int, rounds: int) -> dict:
    with CacheClient(endpoint, timeout_s=120) as c:
        reg, _ = c.call(P.Register(layout=layout_of(object_bytes), chunk_tokens=CHUNK_TOKENS))
        tokens = np.random.default_rng(object_bytes).integers(0, 50000, objects * CHUNK_TOKENS)
        keys = chunk_keys(reg.namespace, tokens, CHUNK_TOKENS)
        data = [np.random.default_rng(i).integers(0, 256, object_bytes, dtype=np.uint8) for i in range(objects)]
        prep, _ = c.call(P.PrepareStore(engine=reg.engine, request="s", keys=keys,
                                        objects=[(i, 0) for i in range(objects)]))
        assert len(prep.slots) == objects, prep.refused[:1]
        c.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation, format=RAW),
               [data[s.chunk] for s in prep.slots])
        samples, ceilings, ratios = [], [], []
        src, dst = np.ones(objects * object_bytes, np.uint8), np.empty(objects * object_bytes, np.uint8)
        for r in range(rounds + 1):  # the first is a warm-up
            hit, _ = c.call(P.Lookup(engine=reg.engine, request="r", keys=keys, policy="all"))
            assert hit.hit_chunks == objects
            t = time.perf_counter()
            rep, frames = c.call(P.Retrieve(engine=reg.engine, lease=hit.lease, format=RAW))
            dt = time.perf_counter() - t
            if r == 0:
                for o, f in zip(rep.objects, frames, strict=True):
                    assert np.array_equal(np.frombuffer(f, np.uint8), data[o.chunk]), o.chunk
            else:
                t = time.perf_counter()
                np.copyto(dst, src)
                ceiling = time.perf_counter() - t
                samples.append(objects * object_bytes / dt / 1e9)
                ceilings.append(objects * object_bytes / ceiling / 1e9)
                ratios.append(ceiling / dt)
            del frames
            c.call(P.Release(engine=reg.engine, lease=hit.lease))
        c.call(P.Unregister(engine=reg.engine))
    return {"object_bytes": object_bytes, "objects": objects, "reply_bytes": objects * object_bytes,
            "gbps_p50": statistics.median(samples), "gbps_max": max(samples), "rounds": rounds,
            "ceiling_gbps_p50": statistics.median(ceilings), "ratio_p50": statistics.median(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--object-kib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sock_dir = tempfile.mkdtemp(prefix="hkv-raw-")
    need = max(a.object_kib) * 1024 * a.objects * len(a.object_kib)
    srv = start_server(ServerConfig(l1_bytes=2 * need + (64 << 20), endpoint=f"ipc://{sock_dir}/s.sock"))
    try:
        rows = [case(srv.endpoint, kib * 1024, a.objects, a.rounds) for kib in a.object_kib]
    finally:
        srv.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(f"raw retrieve, {r['objects']} x {r['object_bytes'] >> 10} KiB: p50 {r['gbps_p50']:.2f} GB/s "
              f"(max {r['gbps_max']:.2f}); host memcpy p50 {r['ceiling_gbps_p50']:.2f} GB/s; ratio to the round's "
              f"memcpy p50 {r['ratio_p50']:.2f}")


if __name__ == "__main__":
    main()
