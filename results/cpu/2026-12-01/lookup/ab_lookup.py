"""Back-to-back p50 of a 71-chunk unpinned Lookup round trip, old code against new, beside the bare echo.

One process drives three peers in turn, blocks of BLOCK calls interleaved REPS times so that load changes on
a shared machine fall on all three alike: the bare pyzmq echo (harness/tests/echo_server.py, the ceiling),
the old CacheClient against an old server process, and the new CacheClient against a new server process.
Prints p50, p10 and the calling thread's CPU time a call of each.

    PYTHONPATH=reference_impl:kernels:harness python results/cpu/2026-12-01/lookup/ab_lookup.py \\
        --old /tmp/old/reference_impl     # e.g. `git archive 08beeaa reference_impl | tar -x -C /tmp/old`
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import zmq
from hybridkv import protocol as P
from hybridkv.keys import chunk_keys, namespace
from hybridkv.presets import preset_layout
from hybridkv.server.front.launch import start_server

ROOT = Path(__file__).resolve().parents[4]


def load_client(impl: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, impl / "hybridkv/engine/client.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def server(impl: Path, endpoint: str):
    """A server process running the code under `impl` (its PYTHONPATH points there)."""
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(impl), old])
    try:
        return start_server(endpoint, l1_gib=0.25)
    finally:
        os.environ["PYTHONPATH"] = old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the old code's reference_impl folder")
    ap.add_argument("--new", type=Path, default=ROOT / "reference_impl")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--block", type=int, default=200)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="hkv-ab-", dir="/tmp")
    servers, clients = [], []
    echo = subprocess.Popen([sys.executable, str(ROOT / "harness/tests/echo_server.py"), f"ipc://{d}/echo.sock"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        frame = P.encode(P.Lookup(engine=1, request="r", keys=chunk_keys(
            namespace(preset_layout("qwen3.6-27b"), 0, 784), np.random.default_rng(0).integers(0, 150_000, 71 * 784),
            784)))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{d}/echo.sock")
        calls = {"echo": lambda: (sock.send(frame), sock.recv())}
        for name, impl in (("old", args.old), ("new", args.new)):
            srv = server(impl, f"ipc://{d}/{name}.sock")
            servers.append(srv)
            c = load_client(impl, f"client_{name}").CacheClient(srv.endpoint, timeout_s=10)
            clients.append(c)
            reg, _ = c.call(P.Register(layout=preset_layout("tiny-hybrid"), chunk_tokens=0))
            keys = chunk_keys(reg.namespace, np.arange(71 * 80) % 5000, 80)
            prep, _ = c.call(P.PrepareStore(engine=reg.engine, request="s", keys=keys,
                                            objects=[(k, g) for k in range(71) for g in range(4)]))
            c.call(P.CommitStore(engine=reg.engine, reservation=prep.reservation))
            msg = P.Lookup(engine=reg.engine, request="r", keys=keys, pin=False)
            assert c.call(msg)[0].hit_chunks == 71
            calls[name] = partial(c.call, msg)
        times: dict[str, list[int]] = {k: [] for k in calls}
        cpu = dict.fromkeys(calls, 0)
        for _ in range(300):  # warm-up
            for f in calls.values():
                f()
        for _ in range(args.reps):
            for k, f in calls.items():
                ts, t0 = times[k], time.thread_time_ns()
                for _ in range(args.block):
                    t = time.perf_counter_ns()
                    f()
                    ts.append(time.perf_counter_ns() - t)
                cpu[k] += time.thread_time_ns() - t0
        echo_p50 = statistics.median(times["echo"])
        for k, ts in times.items():
            p50 = statistics.median(ts)
            print(f"{k:4s} p50 {p50 / 1e3:6.1f} us  p50/echo {p50 / echo_p50:.3f}  "
                  f"p10 {np.percentile(ts, 10) / 1e3:6.1f} us  client cpu/call {cpu[k] / len(ts) / 1e3:5.1f} us")
        print(f"new/old p50 {statistics.median(times['new']) / statistics.median(times['old']):.3f}")
    finally:
        for c in clients:
            c.close()
        echo.kill()
        echo.wait()
        for srv in servers:
            srv.close()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
