"""Fixtures for the vLLM connector tests: vLLM's real scheduler, planner and cache tensors on CPU, and real
`hybridkv serve` processes. Each test module skips itself where vLLM is not installed (`nox -s vllm` installs it)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybridkv.engine.vllm.settings import kv_transfer_config  # noqa: E402
from hybridkv.server.front.cli import parse  # noqa: E402
from hybridkv.server.front.launch import ServerProcess, start_server  # noqa: E402
from hybridkv_bench import vllm_offline as offline  # noqa: E402
from hybridkv_bench import vllm_planning as planning  # noqa: E402


@pytest.fixture(scope="session")
def model_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="hkv-vllm-models-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(model_dir):
    """vLLM's ModelConfig of the tiny hybrid (built once: vLLM inspects the architecture in a subprocess)."""
    return planning.model_config(planning.write_config(planning.TINY, model_dir / "tiny"), max_model_len=4096)


@pytest.fixture
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")  # short: ipc paths are limited to ~100 characters
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def serve(sock_dir) -> Iterator:
    """Start real cache servers; each gets its own arena folder so no other server's start-up sweep sees it."""
    procs: list[ServerProcess] = []
    dirs: list[str] = []

    def start(*args: str, l1_gib: float = 0.05) -> ServerProcess:
        l1 = tempfile.mkdtemp(prefix="hkv-", dir="/dev/shm")
        dirs.append(l1)
        s = start_server(parse([f"--endpoint=ipc://{sock_dir}/s{len(procs)}.sock", "--l1-dir", l1, *args,
                                f"--l1-gib={l1_gib}"]))
        procs.append(s)
        return s

    yield start
    for s in procs:
        s.close()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_engine(tiny_model) -> Iterator:
    """An OfflineEngine on the tiny hybrid (or `model`, a ModelConfig of its shape), one chunk per step (a GDN state
    exists only at the end of a step); vLLM keeps (and offers) a state every `retention` tokens (one chunk by
    default; 0 is vLLM's default: the prompt's last boundary only); `max_loras` as under --max-loras;
    `kv_events` as under --kv-events-config."""
    engines: list[offline.OfflineEngine] = []

    def make(endpoint: str, *, step_tokens: int = 80, num_blocks: int = 128, retention: int | None = 80,
             model=None, max_loras: int = 0, kv_events: dict | None = None, **extra) -> offline.OfflineEngine:
        vc = planning.vllm_config(model or tiny_model, planning.TINY, max_num_batched_tokens=step_tokens,
                                  kv_transfer=kv_transfer_config(endpoint, **extra), retention_interval=retention,
                                  max_loras=max_loras, kv_events=kv_events)
        e = offline.OfflineEngine(vc, num_blocks=num_blocks)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()

