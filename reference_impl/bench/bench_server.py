"""The cache server's own cost per request, against a real server process.

Prints lookup latency (p50/p99) for a long prompt, and for store (prepare + commit) and retrieve
(lookup + [retrieve] + release) the server-side wall time per GB of payload, over `shm` (only
metadata crosses the socket; the server copies no payload) and over `raw` (the server copies each
frame once), with a host memcpy of the same bytes, measured in the same run, as the ceiling.

    python reference_impl/bench/bench_server.py [--quick] [--preset qwen3.6-27b-4layers --chunks 71]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient
from hybridkv.keys import chunk_keys
from hybridkv.presets import preset_layout

GB = 1e9


def start_server(endpoint: str, l1_gib: float) -> subprocess.Popen:
    """`hybridkv serve` in its own process; returns once it prints its ready line."""
    cmd = [sys.executable, "-c", "import sys; from hybridkv.cli import main; sys.exit(main())", "serve",
           "--endpoint", endpoint, "--l1-gib", f"{l1_gib:.3f}", "--log-level", "warning", "--admin"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    if not ready or "ready" not in proc.stdout.readline():
        proc.kill()
        raise SystemExit("server did not start")
    return proc


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


class Bench:
    def __init__(self, client: CacheClient, preset: str, chunks: int, chunk_tokens: int):
        self.c = client
        self.layout = preset_layout(preset)
        reg, _ = client.call(P.Register(layout=self.layout, chunk_tokens=chunk_tokens, name="bench"))
        self.eng = reg.engine
        client.keepalive(self.eng, reg.heartbeat_s)
        self.ns = reg.namespace
        self.chunk_tokens = chunk_tokens
        self.chunks = chunks
        self.objects = [(c, g) for c in range(chunks) for g in range(len(self.layout.groups))]
        self.bytes = chunks * self.layout.chunk_bytes(chunk_tokens)

    def keys(self, seed: int) -> list[bytes]:
        tokens = np.random.default_rng(seed).integers(0, 150000, self.chunks * self.chunk_tokens)
        return chunk_keys(self.ns, tokens, self.chunk_tokens)

    def call(self, msg, frames=()):
        return self.c.call(msg, frames)

    def store(self, keys: list[bytes], fmt: str, payload: list | None = None) -> float:
        """Prepare + commit of every object; seconds of the two round trips (shm: no payload moves)."""
        t0 = time.perf_counter()
        prep, _ = self.call(P.PrepareStore(engine=self.eng, request="s", keys=keys, objects=self.objects))
        assert len(prep.slots) == len(self.objects), (len(prep.slots), prep.refused[:1])
        frames = [] if fmt == "shm" else [payload[i] for i in range(len(prep.slots))]
        self.call(P.CommitStore(engine=self.eng, reservation=prep.reservation, format=fmt), frames)
        return time.perf_counter() - t0

    def lookup(self, keys: list[bytes]) -> tuple[float, P.LookupResult]:
        t0 = time.perf_counter()
        res, _ = self.call(P.Lookup(engine=self.eng, request="l", keys=keys, policy="all"))
        dt = time.perf_counter() - t0
        assert res.hit_chunks == self.chunks, res.hit_chunks
        return dt, res

    def retrieve(self, keys: list[bytes], fmt: str) -> float:
        """Lookup (+ raw retrieve) + release; seconds of the round trips."""
        t0 = time.perf_counter()
        _, res = self.lookup(keys)
        if fmt == "raw":
            _, frames = self.call(P.Retrieve(engine=self.eng, lease=res.lease, format="raw"))
            assert sum(len(f) for f in frames) == self.bytes
        self.call(P.Release(engine=self.eng, lease=res.lease))
        return time.perf_counter() - t0

    def clear(self) -> None:
        self.call(P.Clear(engine=self.eng))


def memcpy_ceiling(nbytes: int, reps: int) -> float:
    """Host memcpy GB/s of `nbytes` in one thread: the ceiling for a server that copies a frame once."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(reps))
    return nbytes / best / GB


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3.6-27b-4layers",
                    help="model preset of the stored objects (default: %(default)s, Qwen3.6-27B's 3.2 MB pages)")
    ap.add_argument("--chunks", type=int, default=71, help="chunks per request (default: %(default)s)")
    ap.add_argument("--chunk-tokens", type=int, default=784, help="tokens per chunk (default: %(default)s)")
    ap.add_argument("--lookups", type=int, default=300, help="timed lookups (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=10, help="timed store/retrieve rounds per format")
    ap.add_argument("--quick", action="store_true", help="a short run: 40 lookups, 3 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.lookups, args.rounds = 40, 3

    layout = preset_layout(args.preset)
    described = args.chunks * layout.chunk_bytes(args.chunk_tokens)
    l1_gib = 2.2 * described / 2**30 + 0.05  # the shm set and the raw set side by side
    sock_dir = tempfile.mkdtemp(prefix="hkv-bench-", dir="/tmp")
    endpoint = f"ipc://{sock_dir}/bench.sock"
    server = start_server(endpoint, l1_gib)
    try:
        with CacheClient(endpoint, timeout_s=120) as client:
            b = Bench(client, args.preset, args.chunks, args.chunk_tokens)
            shm_keys, raw_keys = b.keys(1), b.keys(2)

            b.store(shm_keys, "shm")                     # first touch of the arena pages, untimed
            lookup_s = []
            for _ in range(args.lookups):
                dt, res = b.lookup(shm_keys)
                b.call(P.Release(engine=b.eng, lease=res.lease))
                lookup_s.append(dt)

            def rounds(fn) -> list[float]:
                return [fn() for _ in range(args.rounds)]

            def store_again(keys, fmt, payload=None):
                b.clear()
                return b.store(keys, fmt, payload)

            store_shm = rounds(lambda: store_again(shm_keys, "shm"))
            retr_shm = rounds(lambda: b.retrieve(shm_keys, "shm"))
            sizes = [layout.object_bytes(g, args.chunk_tokens) for _, g in b.objects]
            payload = [np.full(n, i % 251, np.uint8) for i, n in enumerate(sizes)]
            b.store(raw_keys, "raw", payload)          # first touch of the raw set's pages, untimed
            store_raw = rounds(lambda: store_again(raw_keys, "raw", payload))
            retr_raw = rounds(lambda: b.retrieve(raw_keys, "raw"))
            stats, _ = client.call(P.Stats())
        ceiling = memcpy_ceiling(described, 3)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        shutil.rmtree(sock_dir, ignore_errors=True)

    gb = described / GB
    med = lambda xs: pct(xs, 50)
    result = {
        "context": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "preset": args.preset,
                    "chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "objects": len(b.objects),
                    "object_bytes": sorted(set(sizes)), "described_gb": gb, "lookups": args.lookups,
                    "rounds": args.rounds, "server_errors": stats.counters["errors"]},
        "lookup_s_p50": pct(lookup_s, 50), "lookup_s_p99": pct(lookup_s, 99),
        "store_shm_s_per_gb": med(store_shm) / gb, "retrieve_shm_s_per_gb": med(retr_shm) / gb,
        "store_raw_s_per_gb": med(store_raw) / gb, "retrieve_raw_s_per_gb": med(retr_raw) / gb,
        "store_raw_gbps": gb / med(store_raw), "retrieve_raw_gbps": gb / med(retr_raw),
        "memcpy_peak_gbps": ceiling,
    }
    r = result
    print(f"hybridkv server bench: {args.preset}, {args.chunks} chunks x {len(layout.groups)} groups = "
          f"{len(b.objects)} objects of {sizes[0] / 1e6:.1f} MB, {gb:.3f} GB per request; {os.cpu_count()} CPUs")
    print("The server's work per request is per object (keys hashed, table entries, slot offsets), not per")
    print("byte: on shm it copies no payload, so Qwen3.6-27B's 51.4 MB objects (16 layers per group) cost the")
    print(f"same per lookup as these {sizes[0] / 1e6:.1f} MB ones, and s/GB for 51.4 MB objects is 16x lower.")
    print()
    print(f"{'what':<34}{'p50':>12}{'p99':>12}")
    print(f"{'lookup (71 chunks, pin, all)':<34}{r['lookup_s_p50'] * 1e3:>10.2f}ms{r['lookup_s_p99'] * 1e3:>10.2f}ms")
    print()
    print(f"{'path (median of rounds)':<34}{'s per GB':>12}{'GB/s':>12}")
    for name, key in (("store shm (prepare+commit)", "store_shm"), ("retrieve shm (lookup+release)", "retrieve_shm"),
                      ("store raw (server copies once)", "store_raw"), ("retrieve raw (frames out)", "retrieve_raw")):
        spg = r[f"{key}_s_per_gb"]
        print(f"{name:<34}{spg:>12.4f}{1 / spg:>12.1f}")
    print(f"{'ceiling: host memcpy, 1 thread':<34}{1 / ceiling:>12.4f}{ceiling:>12.1f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
