"""`hybridkv status` against a hostile or broken server: a real ZMQ ROUTER in the test answers the Status request
with a malformed reply. Whatever comes back, the command ends without a traceback and writes no control character
of the reply to the terminal: a reply that decodes shows what it cannot hold as "?" (exit 0); one that does not is
one line on stderr and exit status 2."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from hybridkv.cli import main
from hybridkv.server.books.telemetry import STATUS_FIGURES, WINDOW_FIGURES
from hybridkv.wire import protocol as P

LIMITS = {"max_engines": 1024, "max_leases": 4096, "max_reservations": 1024}
ESC = "\x1b]0;owned\x07\x1b[2J\x1b[31m"  # sets the window title, clears the screen, turns red
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")  # all but \n


def good() -> dict:
    """A well-formed StatusResult as a dict: each case breaks one part of it."""
    figures = {k: 10 for k in STATUS_FIGURES} | {"l1_capacity_bytes": 1 << 30, "l1_bytes_used": 1 << 20,
                                                  "l2_capacity_bytes": 0, "hit_chunks": 5}
    return {"op": "status_result", "v": P.PROTOCOL_VERSION, "id": 1, "version": "0.1.0", "pid": 4242,
            "uptime_s": 75.0, "figures": figures, "limits": dict(LIMITS), "window_s": 60.0,
            "window": {k: 6 for k in WINDOW_FIGURES}, "errors": {"limit": 3},
            "recent_errors": [[1.5, "lookup", "limit"]]}


def with_(path: str, value: object) -> Callable[[], list[bytes]]:
    """good() with the field at `path` (dotted) set to `value`, or removed when value is DELETE."""
    def make() -> list[bytes]:
        d = good()
        *parents, last = path.split(".")
        node = d
        for key in parents:
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
        return [msgspec.msgpack.encode(d)]
    return make


DELETE = object()
raw = lambda *frames: (lambda: list(frames))  # noqa: E731

# decode as a StatusResult: rendered, unknown figures shown as "?", exit 0
RENDERED = {
    "figure missing": with_("figures.l1_bytes_used", DELETE),
    "no figures": with_("figures", {}),
    "figure nan": with_("figures.l1_bytes_used", math.nan),
    "figure inf": with_("figures.l1_capacity_bytes", math.inf),
    "figure -inf": with_("figures.bytes_committed", -math.inf),
    "negative size": with_("figures.l1_capacity_bytes", -(1 << 30)),
    "negative count": with_("figures.engines", -3),
    "used over capacity": with_("figures.l1_bytes_used", 1 << 40),
    "absurd size": with_("figures.bytes_committed", 1e300),
    "huge int": with_("figures.l2_capacity_bytes", (1 << 64) - 1),
    "hits over lookups": with_("figures.hit_chunks", 10**6),
    "limits missing": with_("limits", {}),
    "limit zero": with_("limits.max_leases", 0),
    "uptime nan": with_("uptime_s", math.nan),
    "uptime inf": with_("uptime_s", math.inf),
    "uptime negative": with_("uptime_s", -5.0),
    "window nan": with_("window_s", math.nan),
    "window inf": with_("window_s", math.inf),
    "window figures missing": with_("window", {}),
    "pid negative": with_("pid", -1),
    "version with escapes": with_("version", ESC + "0.1.0\r\n\u202e"),
    "version long": with_("version", "9" * 50_000),
    "error code with escapes": with_("errors", {ESC: 1, "limit": -7}),
    "many error codes": with_("errors", {f"code{i}": i for i in range(2000)}),
    "recent error with escapes": with_("recent_errors", [[math.nan, ESC, "\x1b[1A\x1b[2K"], [-1.0, "x", "y"]]),
}
# do not decode as the StatusResult asked for: one line, exit 2
REFUSED = {
    "not msgpack": raw(b"\xc1\xc1\xc1"),
    "empty frame": raw(b""),
    "a list": raw(msgspec.msgpack.encode([1, 2, 3])),
    "unknown op": with_("op", "pwn"),
    "figure a string": with_("figures.l1_bytes_used", "lots"),
    "figure a bool": with_("figures.engines", True),
    "pid a string": with_("pid", "4242"),
    "version a number": with_("version", 7),
    "figures a list": with_("figures", [1, 2]),
    "nested too deeply": raw(b"\x91" * 200_000 + b"\x00"),
    "recent error short": with_("recent_errors", [[1.0]]),
    "another reply": raw(P.encode(P.HealthResult(id=1, status="ok", version="1", uptime_s=1.0, pid=1))),
    "error with escapes": raw(P.encode(P.Error(id=1, code=ESC, message=ESC + "\n\nTraceback"))),
    "payload frames": lambda: [*with_("pid", 1)(), b"x" * 10],
    "over the size bound": with_("version", "v" * (1 << 20)),
}


class FakeServer:
    """A ROUTER socket that answers every request with the frames `reply()` makes."""

    def __init__(self, endpoint: str, reply: Callable[[], list[bytes]]):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.reply = reply
        self.asked = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done.is_set():
            if self.sock.poll(50):
                ident, *_ = self.sock.recv_multipart()
                self.asked += 1
                self.sock.send_multipart([ident, *self.reply()])

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.sock.close(linger=0)


@pytest.fixture
def fake(sock_dir: str) -> Iterator[Callable[[Callable[[], list[bytes]]], FakeServer]]:
    servers: list[FakeServer] = []

    def start(reply: Callable[[], list[bytes]]) -> FakeServer:
        servers.append(FakeServer(f"ipc://{sock_dir}/fake{len(servers)}.sock", reply))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def status(server: FakeServer, capsys, *flags: str) -> tuple[int, str, str]:
    code = main(["status", "--endpoint", server.sock.get(zmq.LAST_ENDPOINT).decode(), "--timeout", "10", *flags])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", list(RENDERED))
def test_a_malformed_but_decodable_reply_renders_with_question_marks(case, fake, capsys):
    server = fake(RENDERED[case])
    code, out, err = status(server, capsys)
    assert code == 0, err
    assert server.asked == 1
    assert out.startswith("hybridkv server at ") and err == ""
    assert not CONTROL.search(out), repr(out)
    assert len(out) < 8000  # every text is cut short
    if case not in ("version with escapes", "version long", "error code with escapes", "recent error with escapes",
                    "many error codes"):
        assert "?" in out, out
    # --json writes the reply as JSON: its strings escaped by JSON, nan and inf as null
    code, out, err = status(server, capsys, "--json")
    assert code == 0 and not CONTROL.search(out)
    msgspec.json.decode(out)


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_reply_that_does_not_decode_is_one_line_exit_2(case, fake, capsys):
    server = fake(REFUSED[case])
    code, out, err = status(server, capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("hybridkv status: error: ") and err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert not CONTROL.search(err), repr(err)
    assert len(err) < 600
    assert "no cache server answered" not in err  # the reply came, and is named, not taken for silence


def test_the_known_figures_still_show_beside_a_missing_one(fake, capsys):
    code, out, _ = status(fake(with_("figures.l1_bytes_used", DELETE)), capsys)
    assert code == 0
    assert "L1  [????????????????????????]   ?  ? of 1.0 GiB" in out
    assert "version 0.1.0, pid 4242, up 1m 15s" in out
    assert "errors by code: limit 3" in out
    assert "a figure the reply lacks, or one no server can have" in out


def test_escapes_are_shown_escaped(fake, capsys):
    code, out, _ = status(fake(with_("version", "1.0\x1b[2J")), capsys)
    assert code == 0 and "version 1.0\\x1b[2J," in out


def test_the_command_process_shows_no_traceback(fake):
    """The cases above run in this process; one of each kind as the operator runs it."""
    for reply, want in ((with_("figures.l1_bytes_used", math.nan), 0), (raw(b"\xc1"), 2)):
        server = fake(reply)
        r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "status", "--endpoint",
                            server.sock.get(zmq.LAST_ENDPOINT).decode(), "--timeout", "20"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == want, r.stderr
        assert "Traceback" not in r.stderr
