"""A Clear of a namespace whose N chunks are in L1 and (spilled ahead) in a filesystem L2, while another client asks
Health in a loop: how long the Clear takes and the other client's worst wait.

    PYTHONPATH=$PWD/reference_impl:$PWD/reference_impl/tests python clear_wait.py 4000
"""

import sys
import tempfile
import threading
import time

from hybridkv.engine.client import CacheClient
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P
from serverkit import Engine, settled

d = tempfile.mkdtemp(prefix="ci-", dir="/tmp")
s = start_server(
    parse(
        [
            f"--endpoint=ipc://{d}/s.sock",
            "--l1-gib=0.05",
            f"--l2-dir={d}/l2",
            "--l2-gib=1",
            "--admin",
            "--spill-watermark=0.99",
        ]
    )
)
lay = ModelLayout(
    model="ci", groups=(GroupLayout(kind="attention", layer_names=("a",), page_bytes=64, block_tokens=1),)
)
with CacheClient(s.endpoint, timeout_s=60) as c, CacheClient(s.endpoint, timeout_s=60) as w:
    e = Engine(c, layout=lay, chunk_tokens=2)
    keys = e.keys(int(sys.argv[1]), seed=1)
    e.store(keys)
    st = settled(c)
    print("l2 objects", st["l2_objects"], "l1", st["l1_objects"])
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
    r = c.call(P.Clear(engine=e.id))
    took = time.perf_counter() - a
    time.sleep(0.3)
    stop.set()
    t.join()
    print(f"clear count {r[0].count} took {took * 1000:.0f} ms; another client's worst Health {worst[0] * 1000:.0f} ms")
s.close()
