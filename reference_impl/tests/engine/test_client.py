"""CacheClient shared by threads: every caller gets its own reply, a thread waiting on a stalled server
blocks no other thread's send, and timeouts and close() end every wait. The server is real; a stalled
server is a real one stopped with SIGSTOP."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import hybridkv.engine.client as client_module
import pytest
from hybridkv.engine.client import CacheClient, ServerError, ServerTimeout
from hybridkv.wire import protocol as P
from serverkit import Engine, module_server


@pytest.fixture(scope="module")
def server():
    """One server for the module (the `client` fixture's too): these tests check the client; the ones that stall
    the server (SIGSTOP) resume it before they end. Engines register under their test's name as salt."""
    with module_server() as s:
        yield s


@contextmanager
def stopped(server) -> Iterator[None]:
    """The server process frozen (it reads nothing, answers nothing) until the block ends."""
    server.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)


def run_threads(targets, timeout: float = 60) -> list[BaseException]:
    """Run each target in its own thread; returns the exceptions they raised."""
    errors: list[BaseException] = []

    def guard(f):
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting for its reply"
    return errors


def test_threads_sharing_a_client_each_get_their_own_reply(client, request):
    eng = Engine(client, salt=request.node.name)
    keys = eng.keys(8)
    eng.store(keys)

    def caller(n: int, use_submit: bool):
        def run():
            for _ in range(100):
                look = P.Lookup(engine=eng.id, request=f"t{n}", keys=keys[:n], pin=False)
                res, _ = client.submit(look).result(30) if use_submit else client.call(look)
                assert res.hit_chunks == n, (n, res.hit_chunks)
                with pytest.raises(ServerError, match="unknown_lease"):  # errors reach their own caller too
                    client.call(P.Release(engine=eng.id, lease=n))
        return run

    assert run_threads([caller(n, use_submit=n % 3 == 0) for n in range(1, 9)]) == []
    assert not client._pending  # every request entered in the table (a call that waited) left it


def test_a_call_whose_reply_comes_after_a_submits_gets_its_own(client, request):
    # call() on a free socket sends and polls alone; when the reply it receives is a submit()'s, that reply
    # goes to its future and the call waits on for its own
    eng = Engine(client, salt=request.node.name)
    keys = eng.keys(4)
    eng.store(keys)
    for i in range(200):
        n = 1 + i % 4
        fut = client.submit(P.Lookup(engine=eng.id, request="s", keys=keys[:n], pin=False))
        res, frames = client.call(P.Lookup(engine=eng.id, request="c", keys=keys[:5 - n], pin=False))
        assert res.hit_chunks == 5 - n and frames == []
        assert fut.result(30)[0].hit_chunks == n
        with pytest.raises(ServerError, match="unknown_lease"):
            client.call(P.Release(engine=eng.id, lease=1))
    assert not client._pending


def test_a_submit_whose_reply_nobody_hurries_still_gets_it(client, monkeypatch, request):
    """`submit(reply_soon=False)` (a release nobody waits on) wakes no I/O thread: its reply is received by the next
    call's leader, or by the I/O thread's next look when no call comes."""
    eng = Engine(client, salt=request.node.name)
    keys = eng.keys(3)
    eng.store(keys)
    pokes = []
    poke = client._io_wake.poke
    monkeypatch.setattr(client._io_wake, "poke", lambda: (pokes.append(1), poke()))
    lone = client.submit(P.Lookup(engine=eng.id, request="a", keys=keys, pin=False), reply_soon=False)
    assert not pokes
    assert lone.result(5)[0].hit_chunks == 3  # the I/O thread's next look, within IDLE_S
    for _ in range(50):
        fut = client.submit(P.Lookup(engine=eng.id, request="b", keys=keys[:2], pin=False), reply_soon=False)
        res, _ = client.call(P.Lookup(engine=eng.id, request="c", keys=keys[:1], pin=False))
        assert res.hit_chunks == 1 and fut.result(5)[0].hit_chunks == 2
    assert not pokes
    hurried = client.submit(P.Lookup(engine=eng.id, request="d", keys=keys, pin=False))
    assert pokes and hurried.result(5)[0].hit_chunks == 3  # the default still wakes it
    assert not client._pending


def test_a_reply_callback_may_submit_but_not_call(client):
    inner: list = []
    errors: list[BaseException] = []

    def on_reply(_):
        inner.append(client.submit(P.Health()))
        try:
            client.call(P.Health())
        except RuntimeError as e:
            errors.append(e)

    for _ in range(20):  # the callback runs on the receiving thread, or here when the reply came first
        client.submit(P.Health()).add_done_callback(on_reply)
    deadline = time.monotonic() + 30
    while len(inner) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [f.result(30)[0].status for f in inner] == ["ok"] * 20
    # call() from the thread that receives would wait for itself: refused (only when run on that thread)
    assert all("reply callback" in str(e) for e in errors)


# IDLE_S 5 s: the waiting calls are still in the one poll of a call() that found the socket free, which only the
# other thread's wake-up (or close()) ends before 5 s; at the default they have gone on to lead or follow
ALONE = pytest.mark.parametrize("idle_s", [client_module.IDLE_S, 5.0], ids=["leading", "polling-alone"])


@ALONE
def test_a_thread_sends_while_another_waits_on_a_stalled_server(server, monkeypatch, idle_s):
    monkeypatch.setattr(client_module, "IDLE_S", idle_s)
    with CacheClient(server.endpoint, timeout_s=60) as c:
        c.call(P.Health())
        replies: list = []
        with stopped(server):
            waiting = threading.Thread(target=lambda: replies.append(c.call(P.Health())))
            waiting.start()
            time.sleep(0.3)  # the waiting thread now polls the socket
            sent: list = []
            sender = threading.Thread(target=lambda: sent.append(c.submit(P.Health())))
            second = threading.Thread(target=lambda: replies.append(c.call(P.Health())))
            sender.start()
            second.start()
            sender.join(3)
            assert sent, "submit() waited for another thread's reply instead of sending"
            assert waiting.is_alive() and second.is_alive()
        waiting.join(30)
        second.join(30)
        assert [r[0].status for r in replies] == ["ok", "ok"]
        assert sent[0].result(30)[0].status == "ok"
        assert not c._pending


@ALONE
def test_close_ends_the_waits_of_every_thread(server, monkeypatch, idle_s):
    monkeypatch.setattr(client_module, "IDLE_S", idle_s)
    c = CacheClient(server.endpoint, timeout_s=60)
    c.call(P.Health())
    errors: list[BaseException] = []

    def wait_for_reply():
        try:
            c.call(P.Health())
        except RuntimeError as e:
            errors.append(e)

    with stopped(server):
        threads = [threading.Thread(target=wait_for_reply) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        fut = c.submit(P.Health())
        started = time.monotonic()
        c.close()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads) and time.monotonic() - started < 4
    assert len(errors) == 3 and all("client closed" in str(e) for e in errors)
    with pytest.raises(RuntimeError, match="client closed"):
        fut.result(10)
    with pytest.raises(RuntimeError, match="closed"):
        c.call(P.Health())
    c.close()  # idempotent


def test_a_stalled_server_times_out_calls_and_the_client_serves_on(server):
    with CacheClient(server.endpoint, timeout_s=0.5) as c:
        c.call(P.Health())
        with stopped(server):
            with pytest.raises(ServerTimeout, match="Health: no reply .* within 0.5s"):
                c.call(P.Health())
            with pytest.raises(ServerTimeout, match="no reply"):
                c.submit(P.Health()).result(20)
            # the caller's own shorter timeout: a plain TimeoutError, the request itself still pending
            with pytest.raises(TimeoutError) as e:
                c.call(P.Health(), timeout=0.1)
            assert not isinstance(e.value, ServerTimeout)
        # the late replies of the timed-out requests are dropped; new requests get their own
        res, _ = c.call(P.Health())
        assert res.status == "ok"
