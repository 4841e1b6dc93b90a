"""Raw Retrieves of one large lease of N chunks of test_lookup_turns' MIXED layout (every group, 4-byte objects: the
per-object cost at its worst), no other client: each round's time and objects/s. Runs against whichever tree
PYTHONPATH names (paging or not); `cap` is --max-retrieve-objects (left out: the server's default, or a tree
without the flag).

    T=$PWD/reference_impl/tests; PYTHONPATH=$PWD/reference_impl:$PWD/harness:$T:$T/server:$T/server/ops \
        python retrieve_rate.py 24001 [rounds] [cap]
"""

import statistics
import sys
import tempfile
import time

from hybridkv.engine.client import CacheClient
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P
from test_lookup_turns import stored

n = int(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
cap = [f"--max-retrieve-objects={sys.argv[3]}"] if len(sys.argv) > 3 else []
d = tempfile.mkdtemp(prefix="rr-", dir="/tmp")
s = start_server(parse([f"--endpoint=ipc://{d}/s.sock", f"--l1-gib={max(0.1, n * 4 * 4096 / 2**30 * 1.2)}", "--admin",
                        *cap]))
with CacheClient(s.endpoint, timeout_s=120) as c:
    eng, keys = stored(c, n)
    res = eng.lookup(keys, policy="all")
    took = []
    for _ in range(rounds + 1):  # the first is a warm-up
        a = time.perf_counter()
        r, frames = c.call(P.Retrieve(engine=eng.id, lease=res.lease))
        took.append(time.perf_counter() - a)
        assert len(frames) == len(res.objects) and r.objects == res.objects
    took = took[1:]
    med = statistics.median(took)
    print(f"{len(res.objects)} objects: retrieve median {med * 1000:.0f} ms (min {min(took) * 1000:.0f}, max "
          f"{max(took) * 1000:.0f}), {len(res.objects) / med / 1e6:.2f} M objects/s")
s.close()
