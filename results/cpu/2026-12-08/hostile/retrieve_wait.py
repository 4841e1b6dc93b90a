"""A raw Retrieve of a lease of N chunks of test_lookup_turns' MIXED layout (every group), while another client asks
Health in a loop: how long it takes and the other client's worst wait.

    T=$PWD/reference_impl/tests; PYTHONPATH=$PWD/reference_impl:$PWD/harness:$T:$T/server:$T/server/ops \
        python retrieve_wait.py 32000
"""

import sys
import tempfile
import threading
import time

from hybridkv.engine.client import CacheClient
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P
from test_lookup_turns import stored

n = int(sys.argv[1])
fmt = sys.argv[2] if len(sys.argv) > 2 else "raw"
d = tempfile.mkdtemp(prefix="rw-", dir="/tmp")
s = start_server(parse([f"--endpoint=ipc://{d}/s.sock", f"--l1-gib={max(0.1, n * 4 * 4096 / 2**30 * 1.2)}", "--admin"]))
with CacheClient(s.endpoint, timeout_s=120) as c, CacheClient(s.endpoint, timeout_s=60) as w:
    eng, keys = stored(c, n)
    res = eng.lookup(keys, policy="all")
    print("objects", len(res.objects))
    worst = [0.0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            a = time.perf_counter()
            w.call(P.Health())
            worst[0] = max(worst[0], time.perf_counter() - a)

    t = threading.Thread(target=watch)
    t.start()
    time.sleep(0.3)
    a = time.perf_counter()
    r, frames = c.call(P.Retrieve(engine=eng.id, lease=res.lease, format=fmt))
    took = time.perf_counter() - a
    time.sleep(0.3)
    stop.set()
    t.join()
    print(
        f"{fmt} retrieve of {len(frames)} frames took {took * 1000:.0f} ms;",
        f"another client's worst Health {worst[0] * 1000:.0f} ms",
    )
s.close()
