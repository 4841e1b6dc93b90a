"""Fuzz a running cache server: mutated and garbage messages of every request type, then a byte-exact check.

    python reference_impl/tests/server/fuzz_server.py --messages 100000     # starts its own server
    python reference_impl/tests/server/fuzz_server.py --endpoint ipc:///path --pid 1234 --messages 20000

Seeds are valid requests of every type carrying live ids (an engine, a lease, a reservation of this
connection); each message is a seed mutated at the byte level (flips, truncation, splices, random
bytes) or at the field level (a field set to a value of another type, huge, negative or deeply
nested), or plain garbage. Every message must get an answer; the server must stay up, its RSS flat
after warm-up, and a store then retrieve afterwards must return the stored bytes exactly.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import numpy as np
import zmq
from hybridkv.engine.client import CacheClient
from hybridkv.model.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server
from hybridkv.wire import protocol as P

WINDOW = 32  # messages in flight: enough to keep the server busy, few enough to match every answer
RESEED_EVERY = 2000  # fresh live ids: a fuzzed Unregister or EndSession would otherwise end them for good


class SocketClient:
    """`CacheClient.call` over the fuzzer's own DEALER socket (ids are bound to the connection)."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self._ids = 1 << 40

    def call(self, msg: P.Message, frames: list | tuple = ()):
        self._ids += 1
        msg.id = self._ids
        self.sock.send_multipart([P.encode(msg), *frames])
        while True:
            if not self.sock.poll(30_000):
                raise TimeoutError(f"no answer to {type(msg).__name__}")
            out = self.sock.recv_multipart()
            reply = P.decode_reply(out[0])
            if reply.id == msg.id:
                break
        if isinstance(reply, P.Error):
            raise RuntimeError(f"{type(msg).__name__}: {reply.code}: {reply.message}")
        return reply, out[1:]


@dataclass
class FuzzResult:
    messages: int
    answered: int
    unanswered: int
    errors_by_code: dict[str, int]
    seconds: float
    rss_warm_mib: float
    rss_end_mib: float
    server_alive: bool
    roundtrip_exact: bool


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _as_dict(msg: P.Message) -> dict:
    return msgspec.msgpack.decode(P.encode(msg))


_ROUNDS = itertools.count()


def _seeds(client: SocketClient, engines: set[int]) -> list[tuple[dict, list[bytes]]]:
    """Valid requests of every type, with live ids of this connection. First the engines of earlier rounds
    (`engines`: seeded and fuzzed Registers that succeeded) are unregistered: a connection registers at most
    --max-engines-per-client, and a long fuzz would reach it."""
    for engine in engines:
        try:
            client.call(P.Unregister(engine=engine))
        except RuntimeError:
            pass  # a fuzzed Unregister got there first
    engines.clear()
    from serverkit import Engine

    layout = preset_layout("tiny-hybrid")
    # A namespace per seeding: a reservation committed by the previous round's fuzz must not leave this
    # round's prepare with no slot to name.
    eng = Engine(client, layout=layout, salt=f"round{next(_ROUNDS)}")
    engines.add(eng.id)
    keys = eng.keys(3, seed=1)
    eng.store(keys)
    hit = eng.lookup(keys)
    prep, _ = client.call(P.PrepareStore(engine=eng.id, request="p", keys=eng.keys(1, seed=2), objects=[(0, 0)]))
    share = P.CudaShare(0, b"h" * 64, 4096, 0, b"r" * 16, 0, b"e" * 64, False, 0, [1, 4096], [4096, 1])
    msgs: list[tuple[P.Message, list[bytes]]] = [
        (P.Register(layout=layout, chunk_tokens=0, salt="fuzz"), []),
        (P.Unregister(engine=eng.id), []),
        (P.Heartbeat(engine=eng.id), []),
        (P.Lookup(engine=eng.id, request="f", keys=keys), []),
        (P.Lookup(engine=eng.id, request="f", keys=keys, pin=False, policy="all", skip_chunks=1), []),
        (P.Prefetch(engine=eng.id, keys=keys, policy="all"), []),
        (P.PrepareStore(engine=eng.id, request="f", keys=keys, objects=[(0, 0), (1, 1)]), []),
        (P.CommitStore(engine=eng.id, reservation=prep.reservation), []),
        (P.CommitStore(engine=eng.id, reservation=prep.reservation, format="raw"), [b"\0" * prep.slots[0].length]),
        (P.CommitStore(engine=eng.id, reservation=prep.reservation, format="pickle"), [b"\x80\x05N."]),
        (P.CommitStore(engine=eng.id, reservation=prep.reservation, format="cuda_ipc", blocks=[[0, 1]]), []),
        (P.AbortStore(engine=eng.id, reservation=prep.reservation), []),
        (P.ShareCuda(engine=eng.id, groups=[[share]]), []),
        (P.Retrieve(engine=eng.id, lease=hit.lease, format="raw"), []),
        (P.Retrieve(engine=eng.id, lease=hit.lease, format="torch_save"), []),
        (P.Release(engine=eng.id, lease=hit.lease), []),
        (P.EndSession(engine=eng.id, request="zzz"), []),
        (P.Stats(), []),
        (P.Clear(engine=eng.id), []),
        (P.Health(), []),
    ]
    return [(_as_dict(m), f) for m, f in msgs]


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-2**40, 2**40)])
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-5, 30)
    if kind == 2:
        return "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(0, 40)))
    if kind == 3:
        return rng.randbytes(rng.choice([0, 1, 15, 16, 17, 64, 4096]))
    if kind == 4:
        return None
    if kind == 5:
        return rng.choice([True, False])
    if kind == 6 and depth < 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if kind == 7 and depth < 4:
        return {str(_random_value(rng, 4)): _random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    if kind == 8:
        return [rng.randbytes(16)] * rng.randrange(0, 3000)  # many (and repeated) keys
    if kind == 9:
        return [[rng.randrange(-2, 5), rng.randrange(-2, 5)] for _ in range(rng.randrange(0, 50))]
    if kind == 10:
        return rng.choice(["shm", "raw", "pickle", "torch_save", "cuda_ipc", "boundary", "all", "lookup", ""])
    return rng.randrange(0, 2**63)


def _mutate_fields(rng: random.Random, msg: dict) -> bytes:
    m = dict(msg)
    for _ in range(rng.randrange(1, 4)):
        action = rng.randrange(5)
        field = rng.choice(list(m)) if m else "op"
        if action == 0:
            m[field] = _random_value(rng)
        elif action == 1:
            m.pop(field, None)
        elif action == 2:
            m[str(_random_value(rng, 4))] = _random_value(rng)
        elif action == 3 and isinstance(m.get(field), list) and m[field]:
            m[field] = m[field] * rng.randrange(2, 50)  # repeats: duplicate keys and objects
        else:
            m["op"] = rng.choice(["register", "lookup", "prepare_store", "commit_store", "retrieve", "release",
                                  "stats", "clear", "error", "lookup_result", "nope", 7])
    try:
        return msgspec.msgpack.encode(m)
    except (OverflowError, TypeError, ValueError):
        return msgspec.msgpack.encode(msg)


def _mutate_bytes(rng: random.Random, data: bytes, other: bytes) -> bytes:
    b = bytearray(data)
    action = rng.randrange(6)
    if action == 0 and b:
        for _ in range(rng.randrange(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif action == 1 and b:
        del b[rng.randrange(len(b)):]
    elif action == 2:
        pos = rng.randrange(len(b) + 1)
        b[pos:pos] = rng.randbytes(rng.randrange(1, 64))
    elif action == 3:
        cut = rng.randrange(len(b) + 1)
        b = b[:cut] + bytearray(other[rng.randrange(len(other) + 1):])
    elif action == 4 and b:
        b[rng.randrange(len(b))] = rng.choice([0xc1, 0xdc, 0xdd, 0xde, 0xdf, 0xc4, 0xc6, 0xd9, 0xdb, 0xff])
    else:
        depth = rng.choice([10, 1000, 50_000])
        b = bytearray(rng.choice([b"\x91", b"\x81\xa1k"]) * depth + b"\xc0")
    return bytes(b)


def _message(rng: random.Random, seeds: list[tuple[dict, list[bytes]]]) -> list[bytes]:
    msg, frames = rng.choice(seeds)
    kind = rng.randrange(10)
    if kind < 4:
        head = _mutate_fields(rng, msg)
    elif kind < 8:
        head = _mutate_bytes(rng, msgspec.msgpack.encode(msg), msgspec.msgpack.encode(rng.choice(seeds)[0]))
    elif kind == 8:
        head = rng.randbytes(rng.randrange(0, 200))
    else:
        head = msgspec.msgpack.encode(msg)  # valid: keeps real state changing under the fuzz
    if rng.random() < 0.1:
        frames = [rng.randbytes(rng.randrange(0, 30000)) for _ in range(rng.randrange(0, 4))]
    return [head, *frames]


def fuzz(endpoint: str, pid: int, messages: int, seed: int = 0, log=print) -> FuzzResult:
    rng = random.Random(seed)
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    own = SocketClient(sock)
    codes: dict[str, int] = {}
    sent = answered = 0
    t0 = time.monotonic()
    warm_rss = 0.0
    stalled = False
    engines: set[int] = set()
    # Before RSS counts: what a server loads once, on first use (torch, for the seed's pickle and torch.save
    # formats), is not growth; a fuzzed message reaches those formats or not depending on the seed.
    if not _roundtrip(endpoint, salt="before-fuzz", formats=("raw", "pickle", "torch_save")):
        raise RuntimeError("the server failed a store and retrieve before the fuzz started")
    while sent < messages and not stalled:
        seeds = _seeds(own, engines)  # nothing in flight here: the seeding calls get their own answers
        batch = min(RESEED_EVERY, messages - sent)
        done = inflight = 0
        last_answer = time.monotonic()
        while done < batch or inflight:
            while inflight < WINDOW and done < batch:
                sock.send_multipart(_message(rng, seeds))
                done += 1
                inflight += 1
            if not sock.poll(1000):
                if time.monotonic() - last_answer > 30:
                    stalled = True  # unanswered: counted below
                    break
                continue
            while True:
                try:
                    out = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                inflight -= 1
                answered += 1
                last_answer = time.monotonic()
                try:
                    reply = P.decode_reply(out[0])
                    code = reply.code if isinstance(reply, P.Error) else type(reply).__name__
                    if isinstance(reply, P.Registered):
                        engines.add(reply.engine)
                except msgspec.MsgspecError:
                    code = "undecodable-reply"
                codes[code] = codes.get(code, 0) + 1
        sent += done
        if not warm_rss and sent >= messages // 5:
            warm_rss = rss_mib(pid)
        if sent % 20000 < RESEED_EVERY:
            log(f"  {sent} sent, {answered / (time.monotonic() - t0):.0f}/s, rss {rss_mib(pid):.1f} MiB")
    seconds = time.monotonic() - t0
    sock.close(linger=0)
    end_rss = rss_mib(pid)
    ok = _roundtrip(endpoint)
    return FuzzResult(sent, answered, sent - answered, codes, seconds, warm_rss, end_rss, ok, ok)


def _roundtrip(endpoint: str, salt: str = "after-fuzz", formats: tuple[str, ...] = ("raw",)) -> bool:
    """A fresh engine stores three chunks (raw frames) and reads them back exactly (raw), or at least whole
    (another format: one frame per object)."""
    from serverkit import Engine

    try:
        with CacheClient(endpoint, timeout_s=30) as c:
            eng = Engine(c, salt=salt)
            keys = eng.keys(3, seed=99)
            prep, _ = c.call(P.PrepareStore(engine=eng.id, request="z", keys=keys,
                                            objects=[(i, g) for i in range(3) for g in range(4)]))
            frames = [Engine.payload(keys[s.chunk], s.group, s.length).tobytes() for s in prep.slots]
            c.call(P.CommitStore(engine=eng.id, reservation=prep.reservation, format="raw"), frames)
            ok = True
            for fmt in formats:
                hit = eng.lookup(keys, policy="all", request="z")
                rep, got = c.call(P.Retrieve(engine=eng.id, lease=hit.lease, format=fmt))
                ok = ok and hit.hit_chunks == 3 and len(got) == 12 and (fmt != "raw" or all(
                    np.array_equal(np.frombuffer(g, np.uint8), Engine.payload(keys[o.chunk], o.group, o.length))
                    for o, g in zip(rep.objects, got, strict=True)))
            return ok
    except Exception as e:  # noqa: BLE001 - reported as a failed round trip
        print(f"round trip failed: {type(e).__name__}: {e}", file=sys.stderr)
        return False


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--endpoint", help="fuzz this server (with --pid) instead of starting one")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parents[1]))  # serverkit
    server = None
    if args.endpoint:
        endpoint, pid = args.endpoint, args.pid
    else:
        sock = tempfile.mkdtemp(prefix="hkv-fz-", dir="/tmp")
        server = start_server(ServerConfig(endpoint=f"ipc://{sock}/s.sock", l1_bytes=int(0.05 * GIB), admin=True),
                              log_level="error")
        endpoint, pid = server.endpoint, server.pid
    try:
        res = fuzz(endpoint, pid, args.messages, args.seed)
        alive = server.alive() if server else True
    finally:
        if server:
            server.stop()
            server.close()
    res.server_alive = alive
    print(json.dumps(asdict(res), indent=1))
    growth = res.rss_end_mib - res.rss_warm_mib
    ok = res.server_alive and res.roundtrip_exact and res.unanswered == 0 and growth <= args.max_rss_growth_mib
    print(f"fuzz {'PASSED' if ok else 'FAILED'}: {res.messages} messages in {res.seconds:.1f}s, "
          f"{res.unanswered} unanswered, rss {res.rss_warm_mib:.1f} -> {res.rss_end_mib:.1f} MiB, "
          f"round trip {'exact' if res.roundtrip_exact else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
