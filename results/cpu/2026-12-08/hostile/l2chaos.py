"""Honest engine stores sets bigger than L1 (spills to a fs L2) and looks them up (reads back from L2), checking every
byte; a vandal thread damages L2 files meanwhile: flips bytes, truncates, swaps two files, replaces one by another
object's file, by a directory, chmods it 000, plants a huge sparse file under an object's name. CLEAR=1: another
engine of the namespace clears it every 50 ms too (VANDAL=0: without the vandal).

    PYTHONPATH=$PWD/reference_impl:$PWD/reference_impl/tests python l2chaos.py
"""

import os
import random
import tempfile
import threading
import time

import numpy as np
from hybridkv.engine.client import CacheClient
from hybridkv.model.layout import GroupLayout, ModelLayout
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P
from serverkit import Engine, settled

DUR = float(os.environ.get("DUR", "40"))
d = tempfile.mkdtemp(prefix="l2c-", dir="/tmp")
l2 = f"{d}/l2"
s = start_server(
    parse(
        [
            f"--endpoint=ipc://{d}/s.sock",
            "--l1-gib=0.004",
            f"--l2-dir={l2}",
            "--l2-gib=0.2",
            "--admin",
            "--io-threads=2",
        ]
    )
)
lay = ModelLayout(
    model="l2c",
    groups=(
        GroupLayout(kind="attention", layer_names=("a",), page_bytes=512, block_tokens=1),
        GroupLayout(kind="recurrent", layer_names=("r",), page_bytes=300, block_tokens=1),
    ),
)
stop = threading.Event()
acts = {}


def vandal():
    rng = random.Random(7)
    while not stop.is_set():
        files = [os.path.join(r, f) for r, _, fs in os.walk(l2) for f in fs if f.endswith(".obj")]
        if len(files) < 2:
            time.sleep(0.05)
            continue
        f, g = rng.sample(files, 2)
        a = rng.randrange(7)
        try:
            if a == 0:
                with open(f, "r+b") as h:
                    h.seek(rng.randrange(os.path.getsize(f)))
                    b = h.read(1)
                    h.seek(-1, 1)
                    h.write(bytes([b[0] ^ 0x5A]))
            elif a == 1:
                os.truncate(f, rng.randrange(os.path.getsize(f)))
            elif a == 2:
                t = f + ".x"
                os.rename(f, t)
                os.rename(g, f)
                os.rename(t, g)
            elif a == 3:
                with open(g, "rb") as h:
                    data = h.read(1 << 20)  # a planted sparse file is 1 TiB
                with open(f, "wb") as h:
                    h.write(data)
            elif a == 4:
                os.unlink(f)
                os.mkdir(f)
            elif a == 5:
                os.chmod(f, 0)
            elif a == 6:
                with open(f, "r+b") as h:
                    h.truncate(1 << 40)
            acts[a] = acts.get(a, 0) + 1
        except OSError:
            pass
        time.sleep(0.002)


clears = [0]


def clearer():
    """Another engine of the same namespace clears it (L1 and L2) every 50 ms: misses, never other bytes."""
    with CacheClient(s.endpoint, timeout_s=60) as c:
        other = Engine(c, layout=lay, chunk_tokens=4)
        while not stop.is_set():
            c.call(P.Clear(engine=other.id))
            clears[0] += 1
            time.sleep(0.05)


t = threading.Thread(target=vandal, daemon=True)
if os.environ.get("VANDAL", "1") == "1":
    t.start()
if os.environ.get("CLEAR") == "1":
    threading.Thread(target=clearer, daemon=True).start()
bad = checked = hits = 0
with CacheClient(s.endpoint, timeout_s=60) as c:
    e = Engine(c, layout=lay, chunk_tokens=4)
    c.keepalive(e.id, 1)
    sets = [e.keys(300, seed=i) for i in range(8)]
    until = time.monotonic() + DUR
    rng = random.Random(1)
    while time.monotonic() < until:
        keys = rng.choice(sets)
        if rng.random() < 0.4:
            e.store(keys)
        if rng.random() < 0.3:
            c.call(P.Prefetch(engine=e.id, keys=keys, policy="all"))
        res = e.lookup(keys, policy="all")
        hits += res.hit_chunks
        for o in res.objects:
            if not np.array_equal(e.arena[o.offset : o.offset + o.length], e.payload(keys[o.chunk], o.group, o.length)):
                bad += 1
            checked += 1
        if res.lease:
            if rng.random() < 0.5:
                r, frames = c.call(P.Retrieve(engine=e.id, lease=res.lease, format="raw"))
                for o, fr in zip(r.objects, frames, strict=False):
                    bad += bytes(fr) != e.payload(keys[o.chunk], o.group, o.length).tobytes()
                    checked += 1
            c.call(P.Release(engine=e.id, lease=res.lease))
    stop.set()
    st = settled(c)
print("vandal acts", acts, "clears", clears[0])
print("checked", checked, "hits", hits, "BAD", bad)
print({k: v for k, v in st.items() if k.startswith("l2_") or "corrupt" in k or "pinned" in k})
print("alive", s.proc.poll() is None)
s.close()
