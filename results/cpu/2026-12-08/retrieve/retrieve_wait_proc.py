"""hostile/retrieve_wait.py with the other client in a process of its own: a raw Retrieve of a lease of N chunks of
test_lookup_turns' MIXED layout (every group), while another process asks Health in a loop. In retrieve_wait.py both
clients share one process, so the retrieving client's own receive of the frames (under the GIL) delays the other
client as well; here only the server and the machine stand between them. Prints the retrieve's time and the other
client's worst and 99th-percentile Health round trip while it ran (and the worst of a quiet second before it).

    T=$PWD/reference_impl/tests; PYTHONPATH=$PWD/reference_impl:$PWD/harness:$T:$T/server:$T/server/ops \
        python retrieve_wait_proc.py 32001 [cap]
"""

import multiprocessing as mp
import sys
import tempfile
import time

from hybridkv.engine.client import CacheClient
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P


def watch(endpoint: str, stop, ready, out) -> None:
    samples = []
    with CacheClient(endpoint, timeout_s=60) as w:
        w.call(P.Health())
        ready.set()
        while not stop.is_set():
            a = time.monotonic()
            w.call(P.Health())
            samples.append((a, time.monotonic() - a))
    out.put(samples)


def main() -> None:
    from test_lookup_turns import stored

    n = int(sys.argv[1])
    cap = [f"--max-retrieve-objects={sys.argv[2]}"] if len(sys.argv) > 2 else []
    d = tempfile.mkdtemp(prefix="rwp-", dir="/tmp")
    s = start_server(parse([f"--endpoint=ipc://{d}/s.sock", f"--l1-gib={max(0.1, n * 4 * 4096 / 2**30 * 1.2)}",
                            "--admin", *cap]))
    with CacheClient(s.endpoint, timeout_s=120) as c:
        eng, keys = stored(c, n)
        res = eng.lookup(keys, policy="all")
        ctx = mp.get_context("spawn")
        stop, ready, out = ctx.Event(), ctx.Event(), ctx.Queue()
        p = ctx.Process(target=watch, args=(s.endpoint, stop, ready, out))
        p.start()
        ready.wait(60)
        quiet = time.monotonic()
        time.sleep(1.0)
        a = time.monotonic()
        r, frames = c.call(P.Retrieve(engine=eng.id, lease=res.lease))
        b = time.monotonic()
        time.sleep(0.3)
        stop.set()
        samples = out.get(timeout=60)
        p.join(60)
        assert len(frames) == len(res.objects)
        during = sorted(t for at, t in samples if at + t >= a and at <= b)
        before = [t for at, t in samples if quiet <= at and at + t < a]
        p99 = during[int(len(during) * 0.99)] if during else 0.0
        print(f"{len(frames)} objects: retrieve {(b - a) * 1000:.0f} ms; the other process's Health while it ran: "
              f"{len(during)} calls, worst {during[-1] * 1000 if during else 0:.1f} ms, p99 {p99 * 1000:.1f} ms "
              f"(quiet second before: worst {max(before, default=0) * 1000:.1f} ms)")
    s.close()


if __name__ == "__main__":
    main()
