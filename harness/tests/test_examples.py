"""The examples run as a user runs them: a fresh interpreter, the installed packages, a real server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchkit import REPO


@pytest.mark.slow  # end to end: the example in a fresh interpreter (torch) and its server (35 s at load 20-40)
def test_quickstart_stores_retrieves_and_verifies():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("reference_impl", "kernels",
                                                                                 "harness"))}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py")], capture_output=True,
                          text=True, env=env, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lookup: 240 of 245 tokens cached (3 chunks" in done.stdout
    assert "pages identical to the stored ones" in done.stdout
    assert "reclaim" not in done.stderr  # the engine said goodbye: the server had nothing to reclaim
    arena = done.stdout.split("its arena ")[1].split()[0]
    assert arena.startswith("/dev/shm/hybridkv-") and not Path(arena).exists()  # the server removed it
