"""The client's own CPU per lookup round trip: process CPU time (every thread of this process: the caller and the
client's I/O thread; the server is another process) over ROUNDS lone 1-chunk and 71-chunk Lookups (pin=false),
divided by ROUNDS. Less moved by a busy machine than wall time, which waits on the server and the scheduler.

    PYTHONPATH=<tree>/reference_impl:<tree>/kernels:<tree>/harness python client_cpu.py [ROUNDS]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

from hybridkv.engine.client import CacheClient
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv_bench.microbench.lookup_bench import store_chunks

try:
    from hybridkv.wire import protocol as P
except ImportError:  # a tree from before the core's folders (8362982 to 2704d0e)
    from hybridkv import protocol as P


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    sock_dir = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    server = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/s.sock", l1_bytes=int(0.25 * GIB)))
    try:
        with CacheClient(server.endpoint, timeout_s=60) as c:
            engine, keys = store_chunks(c)
            out = {}
            for n in (1, 71):
                msgs = [P.Lookup(engine=engine, request="r", keys=keys[:n], pin=False) for _ in range(rounds)]
                for m in msgs[:200]:
                    c.call(m)
                t0 = time.process_time()
                for m in msgs:
                    c.call(m)
                out[f"client_cpu_us_lookup{n}"] = round((time.process_time() - t0) / rounds * 1e6, 2)
        print(json.dumps(out))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
