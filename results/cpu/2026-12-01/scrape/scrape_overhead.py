"""Lookup p50 with and without a Prometheus scrape every 100 ms, both in one run (issue 25).

One server (`hybridkv serve --metrics-port 0`), one client doing 71-chunk unpinned lookups of stored chunks
(tiny-hybrid, all four groups, as results/cpu/2026-12-01/lookup), and a scraper in a process of its own (as
Prometheus would be) that GETs /metrics every --interval seconds while it is switched on. Phases of --phase
seconds take turns, --rounds times each, so load swings on a shared machine fall on all alike: quiet (no
scrape), scraped (the measured server is scraped) and control (a second, idle server is scraped instead: the
machine does the same scraping work, but not in the measured server's process). On a machine with few cores,
scraped / control is the cost inside the server; scraped / quiet adds the scraper's own CPU. Prints each
phase's p50 / p90 / p99, the ratios and what the scrapes cost, and writes the figures with their context as JSON.

    PYTHONPATH=reference_impl:kernels:harness python results/cpu/2026-12-01/scrape/scrape_overhead.py \\
        --out results/cpu/2026-12-01/scrape/scrape_overhead.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
from hybridkv import __version__
from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient
from hybridkv.server.front.launch import start_server
from hybridkv_bench.microbench.lookup_bench import store_chunks

ROOT = Path(__file__).resolve().parents[4]


def scraper(urls: list[str], interval: float, target, stop, durations) -> None:
    """GET urls[target - 1] every `interval` seconds while target is not 0; each scrape's seconds go into
    `durations`, with the target."""
    while not stop.is_set():
        which = target.value
        if not which:
            time.sleep(0.01)
            continue
        t = time.perf_counter()
        with urllib.request.urlopen(urls[which - 1], timeout=10) as r:
            body = r.read()
        assert b"hybridkv_hit_chunks_total" in body
        durations.put((which, time.perf_counter() - t))
        time.sleep(max(0.0, interval - (time.perf_counter() - t)))


def percentiles(ts: list[float]) -> dict[str, float]:
    return {"p50_us": statistics.median(ts) * 1e6, "p90_us": float(np.percentile(ts, 90)) * 1e6,
            "p99_us": float(np.percentile(ts, 99)) * 1e6, "calls": len(ts)}


def context() -> dict:
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"git_sha": sha, "host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "load_avg_at_start": os.getloadavg(), "python": platform.python_version(), "hybridkv": __version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--phase", type=float, default=1.0, help="seconds of one phase")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between two scrapes")
    ap.add_argument("--out", type=Path, default=None, help="write the figures and their context as JSON here")
    args = ap.parse_args()
    ctx = context()
    d = tempfile.mkdtemp(prefix="hkv-scrape-", dir="/tmp")
    spawn = mp.get_context("spawn")
    target, stop, durations = spawn.Value("i", 0), spawn.Event(), spawn.Queue()
    srv = start_server(f"ipc://{d}/s.sock", "--metrics-port", "0", l1_gib=0.25)
    other = start_server(f"ipc://{d}/o.sock", "--metrics-port", "0", l1_gib=0.25)
    assert srv.metrics_url is not None and other.metrics_url is not None
    proc = spawn.Process(target=scraper, args=([srv.metrics_url, other.metrics_url], args.interval, target, stop,
                                               durations), daemon=True)
    proc.start()
    c = CacheClient(srv.endpoint, timeout_s=10)
    try:
        engine, keys = store_chunks(c)
        msg = P.Lookup(engine=engine, request="r", keys=keys, pin=False)
        assert c.call(msg)[0].hit_chunks == 71
        for _ in range(500):  # warm-up
            c.call(msg)
        phases = {"quiet": 0, "scraped": 1, "control": 2}
        times: dict[str, list[float]] = {k: [] for k in phases}
        server_cpu = dict.fromkeys(phases, 0.0)  # the measured server's CPU seconds in each phase
        me = psutil.Process(srv.pid)
        for _ in range(args.rounds):
            for phase, which in phases.items():
                target.value = which
                time.sleep(0.02)  # a scrape of the phase before, in flight, finishes first
                ts, end = times[phase], time.perf_counter() + args.phase
                cpu0 = sum(me.cpu_times()[:2])
                while (t := time.perf_counter()) < end:
                    c.call(msg)
                    ts.append(time.perf_counter() - t)
                server_cpu[phase] += sum(me.cpu_times()[:2]) - cpu0
        target.value = 0
        stop.set()
        proc.join(10)
        scrapes: dict[int, list[float]] = {1: [], 2: []}
        while not durations.empty():
            which, s = durations.get()
            scrapes[which].append(s)
    finally:
        c.close()
        stop.set()
        if proc.is_alive():
            proc.kill()
        srv.close()
        other.close()
        shutil.rmtree(d, ignore_errors=True)
    figures = {k: {**percentiles(ts), "server_cpu_us_per_lookup": server_cpu[k] / len(ts) * 1e6,
                   "server_cpu_share": server_cpu[k] / (args.rounds * args.phase)} for k, ts in times.items()}
    keys = ("p50_us", "p90_us", "p99_us")
    over_quiet = {k: figures["scraped"][k] / figures["quiet"][k] for k in keys}
    over_control = {k: figures["scraped"][k] / figures["control"][k] for k in keys}
    result = {"context": {**ctx, "load_avg_at_end": os.getloadavg(), "rounds": args.rounds, "phase_s": args.phase,
                          "scrape_interval_s": args.interval, "lookup": "71 chunks, unpinned, all hit, tiny-hybrid"},
              **figures, "scraped_over_quiet": over_quiet, "scraped_over_control": over_control,
              "scrapes": {name: {"count": len(scrapes[w]), "p50_ms": statistics.median(scrapes[w]) * 1e3}
                          for name, w in (("measured_server", 1), ("other_server", 2)) if scrapes[w]}}
    for phase, p in figures.items():
        print(f"{phase:8s} lookup p50 {p['p50_us']:7.1f} us  p90 {p['p90_us']:7.1f} us  p99 {p['p99_us']:7.1f} us  "
              f"({p['calls']:,} calls); server CPU {p['server_cpu_us_per_lookup']:5.1f} us a lookup, "
              f"{p['server_cpu_share']:.0%} of a core")
    for name, r in (("quiet", over_quiet), ("control", over_control)):
        print(f"scraped / {name:7s}: p50 {r['p50_us']:.3f}  p90 {r['p90_us']:.3f}  p99 {r['p99_us']:.3f}")
    print(f"scrapes: {result['scrapes']}; load {ctx['load_avg_at_start']} -> {result['context']['load_avg_at_end']}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
