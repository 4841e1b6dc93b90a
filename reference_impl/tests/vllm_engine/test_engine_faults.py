"""The cache server fails under a real vLLM engine: every request completes with recompute's tokens, within a
bound, the engine never dies, and hits come back by themselves once the server does.

The faults are placed exactly with `FaultProxy`: the server is killed or stopped right after vLLM's scheduler
accepted a hit, before the worker's load has started."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from enginekit import BLOCK, close_llm, forget_local, generate, make_llm, prompt, worker_counters
from faultproxy import FaultProxy
from hybridkv.engine.client import CacheClient
from hybridkv.server.front.cli import parse
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P

RETRY_S = 3.0


def _worker_stats(worker):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    s = get_kv_transfer_group().worker_side.stats
    return {k: getattr(s, k) for k in s.__slots__}


@pytest.fixture(scope="module")
def rig(model_dir, sock_dir):
    """A server behind a fault proxy, and one engine that reaches it through the proxy."""
    shm = f"/dev/shm/hkv-faults-{os.getpid()}"
    os.makedirs(shm, exist_ok=True)
    back = f"ipc://{sock_dir}/faults-server.sock"
    proxy = FaultProxy(f"ipc://{sock_dir}/faults-proxy.sock", back)
    rig = {"back": back, "shm": shm, "proxy": proxy, "server": None}

    def start(*flags: str):
        rig["server"] = start_server(parse([f"--endpoint={back}", "--l1-dir", shm, *flags, "--l1-gib=0.25"]))
        return rig["server"]

    rig["start"] = start
    start()
    llm = make_llm(model_dir, proxy.front, retry_s=RETRY_S)
    rig["llm"] = llm
    yield rig
    close_llm(llm)
    proxy.close()
    if rig["server"] is not None:
        rig["server"].close()
    os.rmdir(shm) if not os.listdir(shm) else None


def _cold_then_stored(llm, seed: int, n: int = 1200):
    p = prompt(n, seed)
    (cold,) = generate(llm, [p])
    forget_local(llm)
    return p, cold


def test_server_killed_after_the_scheduler_accepted_a_hit(rig):
    llm, proxy = rig["llm"], rig["proxy"]
    p, cold = _cold_then_stored(llm, 1)
    before = llm.collective_rpc(_worker_stats)[0]
    proxy.arm(lambda: os.kill(rig["server"].pid, signal.SIGKILL))
    t0 = time.monotonic()
    (warm,) = generate(llm, [p])
    elapsed = time.monotonic() - t0
    assert proxy.fired.is_set(), "the fault was never injected: no hit reached the scheduler"
    assert warm.tokens == cold.tokens
    # the worker copies what the scheduler's lookup pinned out of the arena it maps, with no server in the way:
    # a server killed after that lookup leaves those bytes where they were (nothing writes them any more)
    after = llm.collective_rpc(_worker_stats)[0]
    assert (after["load_failures"], after["loads_pinned"]) == (before["load_failures"], before["loads_pinned"] + 1)
    assert elapsed < 5, f"a dead server held the request {elapsed:.1f} s"
    rig["server"].close()
    # restarted empty at the same endpoint: misses, then hits again by themselves within retry_s
    rig["start"]()
    q = prompt(700, 2)
    (q_cold,) = generate(llm, [q])
    deadline = time.monotonic() + RETRY_S + 20
    while True:
        forget_local(llm)
        (again,) = generate(llm, [q])
        assert again.tokens == q_cold.tokens
        if again.cached:
            break
        assert time.monotonic() < deadline, "hits never came back after the server returned"
        time.sleep(0.5)
        (q_cold,) = generate(llm, [q])  # store it again now that the connection may be back
    assert again.cached == (len(q) - 1) // BLOCK * BLOCK


def test_server_stopped_during_a_request(rig):
    llm, proxy = rig["llm"], rig["proxy"]
    p, cold = _cold_then_stored(llm, 3)
    t_cold = time.monotonic()
    generate(llm, [prompt(50, 4)])
    step = time.monotonic() - t_cold
    proxy.arm(lambda: os.kill(rig["server"].pid, signal.SIGSTOP))
    try:
        t0 = time.monotonic()
        (warm,) = generate(llm, [p])
        elapsed = time.monotonic() - t0
        assert proxy.fired.is_set()
        assert warm.tokens == cold.tokens
        # the load waits lookup_timeout_s (1 s) for an answer, then vLLM recomputes
        assert elapsed < 3.0 + 2 * step, f"a stopped server held the request {elapsed:.1f} s"
        # later requests while it stays stopped: no wait of a second each (misses, stores dropped)
        t1 = time.monotonic()
        for i in range(3):
            generate(llm, [prompt(300, 10 + i)])
        assert time.monotonic() - t1 < 3 * (1.0 + 2 * step)
    finally:
        os.kill(rig["server"].pid, signal.SIGCONT)
    deadline = time.monotonic() + RETRY_S + 20
    q = prompt(600, 5)
    while True:
        (q_cold,) = generate(llm, [q])
        forget_local(llm)
        (again,) = generate(llm, [q])
        assert again.tokens == q_cold.tokens
        if again.cached:
            break
        assert time.monotonic() < deadline, "hits never came back after SIGCONT"
        time.sleep(0.5)


def test_server_restarted_with_another_chunk_size(rig):
    llm = rig["llm"]
    p, cold = _cold_then_stored(llm, 6)
    rig["server"].close()
    rig["start"]("--chunk-tokens", str(2 * BLOCK))  # refuses vLLM's layout from now on
    time.sleep(RETRY_S)
    for _ in range(3):
        forget_local(llm)
        (warm,) = generate(llm, [p])
        assert warm.tokens == cold.tokens and warm.cached == 0
        time.sleep(0.5)
    rig["server"].close()
    rig["start"]()


def _answering(endpoint: str) -> float:
    """Wait until the server answers; when it did (monotonic)."""
    with CacheClient(endpoint, timeout_s=30) as c:
        c.call(P.Health())
    return time.monotonic()


def _hits_again(rig) -> None:
    """Wait until a stored prompt hits (an earlier test may leave the connector waiting out a refusal's retry_s)."""
    _answering(rig["back"])
    deadline = time.monotonic() + RETRY_S + 20
    q = prompt(300, 50)
    while True:
        generate(rig["llm"], [q])
        forget_local(rig["llm"])
        (again,) = generate(rig["llm"], [q])
        if again.cached:
            return
        assert time.monotonic() < deadline, "hits never came back"
        time.sleep(0.5)


@pytest.mark.slow
def test_no_hit_lost_after_a_short_stall(rig):
    """The server stops for 1.5 s right after the scheduler accepted a hit: that load fails (a recompute); every
    hit offered once the server answers again loads (the worker registers again at once, not after retry_s)."""
    llm, proxy = rig["llm"], rig["proxy"]
    _hits_again(rig)
    p, cold = _cold_then_stored(llm, 30)
    q, q_cold = _cold_then_stored(llm, 31)
    pid = rig["server"].pid
    cont = threading.Timer(1.5, os.kill, (pid, signal.SIGCONT))
    proxy.arm(lambda: (os.kill(pid, signal.SIGSTOP), cont.start()))
    try:
        (warm,) = generate(llm, [p])
    finally:
        cont.join()
        os.kill(pid, signal.SIGCONT)
    assert proxy.fired.is_set() and warm.tokens == cold.tokens
    back = _answering(rig["back"])
    failures = worker_counters(llm)["load_failures"]
    for _ in range(3):
        forget_local(llm)
        (again,) = generate(llm, [q])
        assert again.tokens == q_cold.tokens
        assert again.cached == (len(q) - 1) // BLOCK * BLOCK, f"a hit lost {time.monotonic() - back:.1f} s after"
    assert worker_counters(llm)["load_failures"] == failures


@pytest.mark.slow
def test_hits_come_back_on_the_next_request_after_a_restart(rig):
    """Restarted empty at the same endpoint: the first request misses and is stored (both sides register again at
    once: the scheduler on `unknown_engine`, the worker when the scheduler's registration moves), the next hits."""
    llm = rig["llm"]
    _hits_again(rig)
    _cold_then_stored(llm, 40)
    failures = worker_counters(llm)["load_failures"]
    rig["server"].close()
    rig["start"]()
    q = prompt(700, 41)
    (q_cold,) = generate(llm, [q])
    forget_local(llm)
    (again,) = generate(llm, [q])
    assert again.tokens == q_cold.tokens
    assert again.cached == (len(q) - 1) // BLOCK * BLOCK
    assert worker_counters(llm)["load_failures"] == failures
