"""16 threads scrape /metrics in a loop while one client times Health.

    PYTHONPATH=$PWD/reference_impl:$PWD/reference_impl/tests python metrics_flood.py
"""

import socket
import tempfile
import threading
import time
import urllib.request

from hybridkv.engine.client import CacheClient
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P

d = tempfile.mkdtemp(prefix="mf-", dir="/tmp")
with socket.socket() as so:
    so.bind(("127.0.0.1", 0))
    port = so.getsockname()[1]
s = start_server(parse([f"--endpoint=ipc://{d}/s.sock", "--l1-gib=0.05", "--admin"]), metrics_port=port)


def health_waits(n=300):
    out = []
    with CacheClient(s.endpoint, timeout_s=30) as c:
        for _ in range(n):
            a = time.perf_counter()
            c.call(P.Health())
            out.append(time.perf_counter() - a)
            time.sleep(0.005)
    out.sort()
    return out[len(out) // 2] * 1000, out[-3] * 1000, out[-1] * 1000


print("quiet: p50 {:.2f} ms p99 {:.2f} max {:.2f}".format(*health_waits()))
stop = threading.Event()
count = [0]


def scraper(kind):
    while not stop.is_set():
        try:
            if kind == "scrape":
                req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept-Encoding": "gzip"})
                urllib.request.urlopen(req, timeout=10).read()
                count[0] += 1
            else:  # slowloris: open, send half a request line, hold
                so = socket.create_connection(("127.0.0.1", port))
                so.send(b"GET /metr")
                time.sleep(11)
                so.close()
        except Exception:
            time.sleep(0.01)


ts = [threading.Thread(target=scraper, args=("scrape",), daemon=True) for _ in range(16)]
for t in ts:
    t.start()
time.sleep(1)
print("16 scrapers: p50 {:.2f} ms p99 {:.2f} max {:.2f}".format(*health_waits()), "scrapes", count[0])
print("server cpu? alive", s.proc.poll() is None)
stop.set()
time.sleep(1)
s.close()
