"""Start to ready of `hybridkv serve` (start_server, as the tests start it), trees alternated:
`python start_ab.py N OLD_TREE NEW_TREE`; each start in a fresh interpreter; prints medians and every start."""

import os
import statistics
import subprocess
import sys

ONE_START = r'''
import shutil, tempfile, time
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
cfg = parse([f"--endpoint=ipc://{d}/s.sock", "--l1-gib=0.05", "--client-timeout=30", "--admin"])
t = time.monotonic()
s = start_server(cfg)
dt = time.monotonic() - t
s.stop()
s.close()
shutil.rmtree(d)
print(dt)
'''


def main() -> None:
    n, trees = int(sys.argv[1]), sys.argv[2:]
    res: dict[str, list[float]] = {t: [] for t in trees}
    for _ in range(n):
        for t in trees:
            env = dict(os.environ, PYTHONPATH=f"{t}/reference_impl:{t}/kernels:{t}/harness")
            out = subprocess.run([sys.executable, "-c", ONE_START], env=env, capture_output=True, text=True, cwd="/tmp")
            if out.returncode:
                sys.exit(out.stderr)
            res[t].append(float(out.stdout))
    for t, v in res.items():
        print(t, f"median {statistics.median(v):.3f} min {min(v):.3f} max {max(v):.3f}",
              " ".join(f"{x:.2f}" for x in v))


if __name__ == "__main__":
    main()
