"""The old and the new CacheClient in one process against one server, in alternating blocks: the fairest A/B a busy
machine allows (both see the same load at nearly the same moments). The new client is the tree on PYTHONPATH;
the old one's client.py (and pending.py) are loaded from OLD_TREE under other module names.

    PYTHONPATH=<new tree>/reference_impl:<new tree>/kernels:<new tree>/harness python ab_client.py OLD_TREE [BLOCKS]
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hybridkv.engine.client import CacheClient
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv_bench.microbench.lookup_bench import store_chunks

try:
    from hybridkv.wire import protocol as P
except ImportError:  # a tree from before the core's folders (8362982 to 2704d0e)
    from hybridkv import protocol as P

BLOCK = 100


def load_old(tree: Path):
    engine = tree / "reference_impl" / "hybridkv" / "engine"
    saved = sys.modules.get("hybridkv.engine.pending")
    spec = importlib.util.spec_from_file_location("hybridkv.engine.pending", engine / "pending.py")
    pending = importlib.util.module_from_spec(spec)
    sys.modules["hybridkv.engine.pending"] = pending
    spec.loader.exec_module(pending)
    spec = importlib.util.spec_from_file_location("old_client", engine / "client.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if saved is None:
        del sys.modules["hybridkv.engine.pending"]
    return mod.CacheClient


def block(c, engine: int, keys: list[bytes], n: int) -> list[float]:
    out = []
    for _ in range(BLOCK):
        msg = P.Lookup(engine=engine, request="r", keys=keys[:n], pin=False)
        t0 = time.perf_counter()
        c.call(msg)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    old_cls = load_old(Path(sys.argv[1]))
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    sock_dir = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
    server = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/s.sock", l1_bytes=int(0.25 * GIB)))
    try:
        with CacheClient(server.endpoint, timeout_s=60) as new, old_cls(server.endpoint, timeout_s=60) as old:
            engines = {"new": store_chunks(new)[0]}
            engines["old"], keys = store_chunks(old)  # engines belong to their connection: one each
            out = {}
            for n in (1, 71):
                t = {"old": [], "new": []}
                cpu = {"old": 0.0, "new": 0.0}
                for i in range(blocks):
                    for side, c in (("old", old), ("new", new)) if i % 2 == 0 else (("new", new), ("old", old)):
                        c0 = time.thread_time()
                        t[side] += block(c, engines[side], keys, n)
                        cpu[side] += time.thread_time() - c0
                for side in ("old", "new"):
                    out[f"lookup{n}_{side}"] = {"p50_us": round(statistics.median(t[side]) * 1e6, 1),
                                                "caller_cpu_us": round(cpu[side] / len(t[side]) * 1e6, 2)}
        print(json.dumps(out))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
