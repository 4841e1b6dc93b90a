"""`pip install hybridkv` is the cache server and `hybridkv status`, without the engine stack: no torch, pandas or
matplotlib; the harness's commands say which extra they need. Installed (not editable) from a copy of this checkout
into a fresh virtual environment, through pip's configured index."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOTS = {"hybridkv": "reference_impl", "hybridkv_kernels": "kernels", "hybridkv_bench": "harness"}


def test_pyproject_lists_every_package():
    """A package left out of pyproject's list is missing from a wheel: hybridkv.server.l2 was, so a non-editable
    install could not start `hybridkv serve`."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT / base).parts)
             for top, base in ROOTS.items() for p in (ROOT / base / top).rglob("__init__.py")}
    assert listed == found


def test_the_server_needs_none_of_the_engine_stack():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.split(">")[0].split("=")[0].strip() in ("torch", "pandas", "matplotlib")]


@pytest.mark.slow
def test_a_slim_install_serves_and_sums_up(tmp_path, sock_dir):
    src = tmp_path / "src"  # a copy: pip builds in the tree, leaving build/ behind
    top = {".nox", ".git", ".venv", "results", "build", ".device", ".whl"}  # the checkout's own, not its packages'
    shutil.copytree(ROOT, src, ignore=lambda d, names: [n for n in names if n == "__pycache__" or n.endswith(
        ".egg-info") or (Path(d) == ROOT and n in top)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and
           not k.startswith("HYBRIDKV_")}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", str(src)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert pip.returncode == 0, pip.stderr[-1500:]
    cwd = str(tmp_path)  # not the checkout: nothing importable by accident

    def hkv(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin/hybridkv"), *args], capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=120)

    listed = subprocess.run([str(venv / "bin/python"), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, env=env, check=True).stdout.lower()
    for heavy in ("torch", "pandas", "matplotlib", "triton"):
        assert f"\n{heavy}==" not in "\n" + listed, listed
    assert hkv("--version").stdout.startswith("hybridkv ")
    assert "--l1-gib" in hkv("serve", "--help").stdout
    endpoint = f"ipc://{sock_dir}/slim.sock"
    server = subprocess.Popen([str(venv / "bin/hybridkv"), "serve", "--endpoint", endpoint, "--l1-gib", "0.02",
                               "--metrics-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=cwd)
    try:
        assert server.stdout is not None
        ready = server.stdout.readline()
        assert ready.startswith(f"hybridkv server ready: endpoint={endpoint}"), ready + server.stderr.read()
        status = hkv("status", "--endpoint", endpoint)
        assert status.returncode == 0 and f"hybridkv server at {endpoint}" in status.stdout, status
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)
    assert server.returncode == 0
    bench = hkv("bench", "scenarios/smoke.toml")
    assert bench.returncode == 2 and "pip install 'hybridkv[bench]'" in bench.stderr, bench
    assert "Traceback" not in bench.stderr
