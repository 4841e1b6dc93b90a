"""Draw docs/grafana-dashboard.json's panels from a real run: a real `hybridkv serve --metrics-port`, scraped
every second by a real Prometheus (Debian's `prometheus` package), under traffic from two engines
(KVTransfer on CPU: stores, hits from L1 and L2, misses, evictions and a few malformed requests). Every panel's
own PromQL is asked of that Prometheus over its HTTP API and drawn at the dashboard's grid position, so the
picture shows what the dashboard's queries return, not what we expect them to. Grafana itself is not packaged
here; the drawing is matplotlib's.

    python harness/campaign/dashboard_picture.py --out docs/img/dashboard.png [--seconds 150] [--check]

`--check` fails (exit 1) when a query that the traffic must feed returns no series, or Prometheus refuses one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
# Panels that may be empty in a healthy run (no L2 trouble, no refusals): the rest must return data.
MAY_BE_EMPTY = {"Evictions / s and L2 trouble", "Refusals and reclaims / s", "Snapshot age"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.monotonic() > end:
                raise RuntimeError(f"{url} did not answer within {timeout} s") from None
            time.sleep(0.2)


def traffic(endpoint: str, seconds: float, stop: threading.Event) -> dict:
    """Two engines: each stores new prompts, re-reads old ones (L1 hits, then L2 hits once evicted), and asks
    for prefixes it never stored (misses); now and then a malformed request (the server answers an error)."""
    from hybridkv.engine.transfer import KVTransfer, TransferConfig
    from hybridkv.model.presets import preset_layout
    from hybridkv_bench.pools import fill_random, vllm_pools

    layout = preset_layout("tiny-hybrid", 1)
    blocks = 256
    pools = vllm_pools(layout, blocks, "cpu")
    fill_random(pools, 1)
    rng = np.random.default_rng(0)
    counts = {"stores": 0, "lookups": 0, "hit_chunks": 0, "bad": 0}
    engines = [KVTransfer(endpoint, layout, pools, TransferConfig(wire_format="shm", salt=f"tenant-{i}",
                                                                  name=f"engine-{i}")) for i in range(2)]
    ct = engines[0].chunk_tokens
    bpc = [ct // g.block_tokens for g in layout.groups]
    prompts: list[list[np.ndarray]] = [[], []]
    bad = zmq.Context.instance().socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(endpoint)
    t0 = time.monotonic()
    n = 0
    try:
        while not stop.is_set() and time.monotonic() - t0 < seconds:
            n += 1
            for e, kv in enumerate(engines):
                chunks = int(rng.integers(2, 9))
                tokens = rng.integers(0, 150_000, chunks * ct)
                src = [list(range(0, chunks * b)) for b in bpc]
                kv.store(f"s{n}-{e}", tokens, src).wait_committed(30)
                kv.end_session(f"s{n}-{e}")
                prompts[e].append(tokens)
                counts["stores"] += 1
                for k in range(3):  # re-reads, older ones more and more often from L2
                    old = prompts[e][int(rng.integers(0, len(prompts[e])))]
                    hit = kv.lookup(f"r{n}-{e}-{k}", old)
                    counts["lookups"] += 1
                    counts["hit_chunks"] += hit.hit_chunks
                    if hit.hit_chunks:
                        # the groups' pages share buffers (as in vLLM): each group loads into blocks of its own
                        dst, first = [], blocks // 2
                        for b in bpc:
                            dst.append(list(range(first, first + hit.hit_chunks * b)))
                            first += hit.hit_chunks * b
                        kv.retrieve(hit, dst).wait(30)
                    kv.end_session(f"r{n}-{e}-{k}")
                miss = rng.integers(0, 150_000, 4 * ct)
                kv.lookup(f"m{n}-{e}", miss)
                kv.end_session(f"m{n}-{e}")
            if n % 7 == 0:  # a hostile or broken client: one garbage message, answered with an error
                bad.send_multipart([b"\x92\x01not-msgpack"])
                counts["bad"] += 1
            time.sleep(0.05)
    finally:
        counts["t_end"] = time.time()  # the stat panels read the last scrape before the engines leave
        time.sleep(2.5)
        for kv in engines:
            kv.close()
        bad.close()
    return counts


def query(prom: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    url = f"{prom}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body}")
    return body["data"]["result"]


def legend(fmt: str | None, labels: dict) -> str:
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in labels.items() if k not in ("instance", "job")) or "value"
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", str(v))
    return out


def reduce(panel: dict, values: list, t: float) -> float | None:
    """A stat, gauge or bar's value as Grafana reduces the series (the panel's `reduceOptions.calcs`: last
    not null by default), over the samples up to `t` (the end of the traffic, before the engines leave)."""
    v = [float(b) for a, b in values if float(a) <= t and b not in ("NaN", "+Inf", "-Inf")]
    if not v:
        return None
    calc = (panel.get("options", {}).get("reduceOptions", {}).get("calcs") or ["lastNotNull"])[0]
    return {"max": max(v), "min": min(v), "mean": sum(v) / len(v)}.get(calc, v[-1])


def colour(panel: dict, v: float) -> str:
    """The panel's threshold colour for `v` (green below its first step)."""
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
    name = "green"
    for st in steps:
        if st.get("value") is None or v >= st["value"]:
            name = st.get("color", name)
    return {"green": "#73bf69", "orange": "#ff9830", "red": "#f2495c", "yellow": "#fade2a"}.get(name, "#73bf69")


def draw(panels: list[dict], data: dict, window: tuple[float, float], t_stat: float, out: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_w, unit_h = 0.75, 0.42
    fig = plt.figure(figsize=(24 * unit_w, rows * unit_h + 0.6), facecolor="#111217")
    H = rows * unit_h + 0.6
    fig.text(0.01, 1 - 0.25 / H, f"hybridkv dashboard (docs/grafana-dashboard.json) - {note}", color="#d8d9da",
             fontsize=12, va="top")
    for p in panels:
        g = p["gridPos"]
        x0, y0 = g["x"] / 24, 1 - (0.6 + (g["y"] + g["h"]) * unit_h) / H
        w, h = g["w"] / 24, g["h"] * unit_h / H
        if p["type"] == "row":
            fig.text(x0 + 0.005, y0 + h / 2, p["title"], color="#d8d9da", fontsize=11, weight="bold", va="center")
            continue
        pad = 0.004 if p["type"] in ("stat", "gauge", "bargauge") else 0.028  # room for the y tick labels
        ax = fig.add_axes([x0 + pad, y0 + 0.012, w - pad - 0.004, h - 0.016 - 0.18 / H], facecolor="#181b1f")
        fig.text(x0 + 0.005, y0 + h - 0.09 / H, p["title"], color="#ccccdc", fontsize=8.5, va="center")
        for s in ax.spines.values():
            s.set_color("#2c3235")
        ax.tick_params(colors="#8e8e8e", labelsize=6.5)
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        series = data[p["title"]]
        if p["type"] in ("stat", "gauge"):
            ax.set_xticks([])
            ax.set_yticks([])
            vals = [(legend(t.get("legendFormat"), s["metric"]), reduce(p, s["values"], t_stat))
                    for t, res in series for s in res]
            vals = [(n, v) for n, v in vals if v is not None]
            if p["title"] == "Version" and vals:
                text = next((s["metric"].get("version", "?") for _, res in series for s in res), "?")
            elif not vals:
                text = "no data"
            else:
                text = fmt_value(vals[0][1], unit)
            ax.text(0.5, 0.45, text, color=colour(p, vals[0][1]) if vals else "#8e8e8e", fontsize=16, ha="center",
                    va="center", transform=ax.transAxes, weight="bold")
            continue
        if p["type"] == "bargauge":
            names, vals = [], []
            for t, res in series:
                for s in res:
                    v = reduce(p, s["values"], t_stat)
                    if v is not None:
                        names.append(legend(t.get("legendFormat"), s["metric"]))
                        vals.append(v)
            ys = list(range(len(vals)))[::-1]
            ax.barh(ys, [1.0] * len(vals), color="#22252b", height=0.5)
            ax.barh(ys, vals, color=[colour(p, v) for v in vals], height=0.5)
            for y, n, v in zip(ys, names, vals, strict=True):
                ax.text(0.01, y + 0.38, f"{n}: {fmt_value(v, 'percentunit')}", color="#ccccdc", fontsize=7)
            ax.set_yticks([])
            ax.set_xlim(0, max(1.0, max(vals, default=0)))
            ax.set_ylim(-0.5, len(vals) - 0.1)
            continue
        drawn = 0
        for t, res in series:
            for s in res:
                v = np.array([[float(a), float(b)] for a, b in s["values"] if b not in ("NaN", "+Inf", "-Inf")])
                if len(v):
                    ax.plot(v[:, 0] - window[0], v[:, 1] * scale(unit), lw=1.2,
                            label=legend(t.get("legendFormat"), s["metric"]))
                    drawn += 1
        if drawn:
            ax.legend(fontsize=5.5, loc="upper left", facecolor="#181b1f", edgecolor="#2c3235", labelcolor="#ccccdc",
                      ncol=2 if drawn > 3 else 1)
        else:
            ax.text(0.5, 0.5, "no data (none happened)", color="#8e8e8e", ha="center", transform=ax.transAxes)
        ax.set_xlim(0, window[1] - window[0])
        ax.set_xlabel("s into the run", color="#8e8e8e", fontsize=6.5, labelpad=1)
        if unit and unit != "short":
            ax.set_ylabel(axis_unit(unit), color="#8e8e8e", fontsize=6.5)
        ax.grid(color="#2c3235", lw=0.5)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)


def scale(unit: str) -> float:
    return {"bytes": 2 ** -20, "decbytes": 1e-6, "Bps": 1e-6, "binBps": 1e-6}.get(unit, 1.0)


def axis_unit(unit: str) -> str:
    return {"bytes": "MiB", "decbytes": "MB", "Bps": "MB/s", "binBps": "MB/s", "s": "s", "percentunit": "fraction",
            "reqps": "req/s", "ops": "ops/s"}.get(unit, unit)


def fmt_value(v: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{100 * v:.1f}%"
    if unit == "s":
        return f"{v:.0f} s"
    if unit in ("bytes", "decbytes"):
        return f"{v / 2 ** 20:.1f} MiB"
    return f"{v:.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    ap.add_argument("--seconds", type=float, default=150.0, help="traffic duration (default: 150)")
    ap.add_argument("--data", type=Path, help="also write every panel's query results here (JSON)")
    ap.add_argument("--check", action="store_true", help="fail when a panel that must have data has none")
    ap.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    ap.add_argument("--from-data", type=Path, help="redraw from a --data file instead of running")
    a = ap.parse_args(argv)
    if a.from_data:
        saved = json.loads(a.from_data.read_text())
        panels = json.loads(DASHBOARD.read_text())["panels"]
        by_expr = {p["title"]: [(t, r["result"]) for t, r in zip(p.get("targets", []), saved["panels"][p["title"]],
                                                                   strict=True)]
                   for p in panels if p["type"] != "row"}
        draw(panels, by_expr, tuple(saved["window"]), saved["traffic"]["t_end"], a.out, saved["note"])
        return 0
    if a.seconds < 70:
        ap.error("--seconds must be at least 70: the panels' rates use 1-minute windows")
    if not shutil.which(a.prometheus):
        print(f"no Prometheus binary {a.prometheus!r} (Debian: apt-get install prometheus)", file=sys.stderr)
        return 2
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    tmp = Path(tempfile.mkdtemp(prefix="hkv-dash-"))
    mport, pport = free_port(), free_port()
    endpoint = f"ipc://{tmp}/server.sock"
    procs: list[subprocess.Popen] = []
    logs = contextlib.ExitStack()  # the processes' log files, closed after the processes stop

    def log(name: str):
        return logs.enter_context(open(tmp / name, "w"))  # noqa: SIM115 (closed by `logs`)

    try:
        # a small L1 over a filesystem L2: the re-reads spill, evict and come back from L2
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hybridkv.cli", "serve", "--endpoint", endpoint, "--l1-gib", "0.03",
             "--l1-dir", str(tmp), "--l2-dir", str(tmp / "l2"), "--l2-gib", "0.5", "--metrics-port", str(mport),
             "--exit-with-parent", "--log-level", "warning"], stdout=log("server.log"),
            stderr=subprocess.STDOUT))
        (tmp / "prom.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
            f"  - job_name: hybridkv\n    static_configs:\n      - targets: ['127.0.0.1:{mport}']\n")
        procs.append(subprocess.Popen(
            [a.prometheus, f"--config.file={tmp / 'prom.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{pport}", "--log.level=warn"],
            stdout=log("prometheus.log"), stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{mport}/metrics")
        prom = f"http://127.0.0.1:{pport}"
        wait_http(f"{prom}/-/ready")
        start = time.time()
        counts = traffic(endpoint, a.seconds, threading.Event())
        time.sleep(3)  # the last scrapes
        end = time.time()
        data: dict[str, list] = {}
        empty = []
        for p in panels:
            if p["type"] == "row":
                continue
            res = []
            for t in p.get("targets", []):
                expr = t["expr"].replace('instance=~"$instance"', 'instance=~".*"')
                res.append((t, query(prom, expr, start, end, 2.0)))
            data[p["title"]] = res
            if not any(r for _, r in res) and p["title"] not in MAY_BE_EMPTY:
                empty.append(p["title"])
        note = (f"a real run: {a.seconds:.0f} s, two CPU engines ({counts['stores']} stores, {counts['lookups']} "
                f"re-reads, {counts['bad']} malformed requests), scraped each second by Prometheus")
        draw(panels, data, (start, end), counts["t_end"], a.out, note)
        if a.data:
            a.data.write_text(json.dumps({"window": [start, end], "traffic": counts, "note": note, "panels": {
                k: [{"expr": t["expr"], "result": r} for t, r in v] for k, v in data.items()}}))
        print(f"{a.out}: {len(data)} panels; traffic {counts}")
        if empty:
            print(f"panels with no data: {empty}", file=sys.stderr)
            return 1 if a.check else 0
        return 0
    except BaseException:
        for name in ("server.log", "prometheus.log"):  # why it failed, before the folder goes
            if (tmp / name).exists():
                print(f"--- {name}\n{(tmp / name).read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        logs.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
