"""The wire protocol between engines (ZMQ DEALER) and the cache server (ZMQ ROUTER).

A message is one msgpack frame holding a tagged msgspec struct, followed by zero or more payload
frames. Payload bytes never go inside msgpack: they travel as separate frames sent with copy=False,
so there is no 4 GiB msgpack limit and no copy on either side of the socket. Every message carries
the protocol version `v` and a request id `id` that the reply echoes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated

import msgspec

from hybridkv.model.layout import MAX_GROUPS, MAX_LAYERS, MAX_NAME_CHARS, ModelLayout
from hybridkv.model.policy import Policy
from hybridkv.wire.packed import pack_ints, pack_pairs, packed_field, unpack_ints  # noqa: F401 - the protocol's helpers
from hybridkv.wire.wire_formats import DEFAULT_FORMAT, DEFAULT_PAYLOAD_FORMAT, WireFormat

# A request id, an engine name or a tenant salt: kept by the server for as long as a lease, a reservation or
# an engine lives, so bounded (vLLM's request ids are under 100 characters).
Text = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]

PROTOCOL_VERSION = 1

# Bulk integers travel packed, as int32 little-endian bytes: msgspec builds one Python object per element of a
# msgpack array, so one hostile frame of a million (chunk, group) pairs held the server's loop for a sizeable share
# of a second in decode alone (one of millions of one-block lists, for seconds); a bytes field decodes in
# microseconds whatever its length. A
# hand-written client may still send short lists (their lengths are checked before any element is built).
MAX_LISTED = 4096        # objects or block lists given as a msgpack list
MAX_LISTED_BLOCKS = 256  # blocks in one listed block list: a listed message decodes in a few ms
MAX_KEYS = 1 << 20       # keys in one request, whatever --max-keys says (a bound on one message's decode time)
MAX_SHARED_DIMS = 8      # dimensions of one shared CUDA page view


class Message(msgspec.Struct, tag_field="op", kw_only=True, forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION
    id: int = 0


# ---- requests ------------------------------------------------------------------------------------

class Register(Message, tag="register"):
    """Register an engine rank: its layout, rank and chunk size decide its namespace."""
    layout: ModelLayout
    chunk_tokens: int
    tp_rank: int = 0
    salt: Text = ""
    name: Text = ""


class Unregister(Message, tag="unregister"):
    """Forget an engine: its reservations are aborted and its pins released."""
    engine: int


class Heartbeat(Message, tag="heartbeat"):
    """Tell the server this engine is alive (any request does; this one does nothing else)."""
    engine: int


class Lookup(Message, tag="lookup"):
    """Find the longest resumable prefix of `keys`; pin its objects for `request` and bring them into L1."""
    engine: int
    request: Text
    keys: Annotated[list[bytes], msgspec.Meta(max_length=MAX_KEYS)]
    policy: Policy = "boundary"
    # chunks the engine already holds: their attention objects are neither pinned nor returned
    skip_chunks: int = 0
    pin: bool = True


class Prefetch(Message, tag="prefetch"):
    """Start L2 -> L1 reads of the longest resumable prefix of `keys` ahead of need, pinning nothing;
    answered at once, before any read ends (a later Lookup of the prefix then finds it in L1)."""
    engine: int
    keys: Annotated[list[bytes], msgspec.Meta(max_length=MAX_KEYS)]
    policy: Policy = "boundary"
    # chunks the engine already holds: their attention objects are not read (as Lookup.skip_chunks)
    skip_chunks: int = 0


class PrepareStore(Message, tag="prepare_store"):
    """Reserve L1 slots for the objects (chunk index into keys, group) that the server lacks. `objects` is
    sent packed (`pack_pairs`: int32 chunk, group, chunk, group, ...); a list of at most MAX_LISTED pairs is
    taken too and packed on arrival, so the server always reads `pairs()`."""
    engine: int
    request: Text
    keys: Annotated[list[bytes], msgspec.Meta(max_length=MAX_KEYS)]
    objects: bytes | Annotated[list[tuple[int, int]], msgspec.Meta(max_length=MAX_LISTED)]

    def __post_init__(self) -> None:
        self.objects = packed_field(self.objects, "objects", 8)

    def pairs(self) -> Sequence[int]:
        """chunk, group, chunk, group, ...: object i is (pairs[2i], pairs[2i + 1])."""
        assert isinstance(self.objects, bytes)
        return unpack_ints(self.objects)

    @property
    def n_objects(self) -> int:
        return len(self.objects) // 8


# engine block ids, one list per object, sent packed (`pack_ints` of them all, objects in order: the server
# splits them by each object's length); a list of at most MAX_LISTED short lists is taken too
Blocks = bytes | Annotated[list[Annotated[list[int], msgspec.Meta(max_length=MAX_LISTED_BLOCKS)]],
                           msgspec.Meta(max_length=MAX_LISTED)]


class CommitStore(Message, tag="commit_store"):
    """Make a reservation's objects visible. For raw and legacy formats one payload frame per slot follows;
    for cuda_ipc, `blocks` names each slot's engine blocks and the server copies them itself. `fenced` (shm,
    a reservation with a fence word): sent with the copies, not after them; the server publishes once the
    fence word holds the reservation id (`hybridkv.server.books.fences`)."""
    engine: int
    reservation: int
    format: WireFormat = DEFAULT_FORMAT
    blocks: Blocks = b""
    fenced: bool = False

    def __post_init__(self) -> None:
        self.blocks = packed_field(self.blocks, "blocks")


class AbortStore(Message, tag="abort_store"):
    """Drop a reservation: its slots are freed and nothing of it ever becomes visible."""
    engine: int
    reservation: int


class Retrieve(Message, tag="retrieve"):
    """Send a lease's objects as payload frames (raw or legacy formats; shm engines read the arena), or,
    for cuda_ipc, copy them into the engine blocks named by `blocks` and answer when done.

    A reply's frames are one multipart message, sent in one step of the server's loop that no other reply can
    interleave, so one Retrieve sends at most `--max-retrieve-objects` frames: the slice of the lease's objects
    from index `first` on. A client pages through a larger lease, each reply's `Retrieved.next` its next `first`
    (`CacheClient.call` does so itself). None (the field left out, the shape before paging): the whole lease, and
    `limit` for a lease over the cap. cuda_ipc sends no frames: it answers every object from `first` on, the
    objects `blocks` names."""
    engine: int
    lease: int
    format: WireFormat = DEFAULT_PAYLOAD_FORMAT
    blocks: Blocks = b""
    first: int | None = None

    def __post_init__(self) -> None:
        self.blocks = packed_field(self.blocks, "blocks")


class CudaShare(msgspec.Struct, array_like=True, frozen=True):
    """One engine page view exported with CUDA IPC (torch's _share_cuda_ fields, plus the view)."""
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    size: Annotated[list[int], msgspec.Meta(max_length=MAX_SHARED_DIMS)]
    stride: Annotated[list[int], msgspec.Meta(max_length=MAX_SHARED_DIMS)]


class ShareCuda(Message, tag="share_cuda"):
    """cuda_ipc baseline: the engine's page views, per group per layer, for the server to map."""
    engine: int
    groups: Annotated[list[Annotated[list[CudaShare], msgspec.Meta(max_length=MAX_LAYERS)]],
                      msgspec.Meta(max_length=MAX_GROUPS)]


class Release(Message, tag="release"):
    """Unpin a lease's objects."""
    engine: int
    lease: int


class EndSession(Message, tag="end_session"):
    """A request has finished: release its leases and abort its open reservations."""
    engine: int
    request: Text


class Stats(Message, tag="stats"):
    """Ask for the server's counters (server-wide: only on a server started with --admin)."""


class Clear(Message, tag="clear"):
    """Drop every unpinned, committed object of this engine's namespace; engine=None clears every
    namespace and is refused unless the server was started with --admin."""
    engine: int | None = None


class Health(Message, tag="health"):
    """Ask whether the server is up."""


class Status(Message, tag="status"):
    """Ask for the operator's summary (`hybridkv status`): open to every client, so it holds server-wide
    totals and sizes only, never a key, namespace, engine name or error message (docs/trust-model.md)."""


Request = (Register | Unregister | Heartbeat | Lookup | Prefetch | PrepareStore | CommitStore | AbortStore | ShareCuda
           | Retrieve | Release | EndSession | Stats | Clear | Health | Status)


# ---- replies -------------------------------------------------------------------------------------

class ObjectLoc(msgspec.Struct, array_like=True, frozen=True):
    """Where one (chunk, group) object lives in the arena: byte offset and length."""
    chunk: int
    group: int
    offset: int
    length: int


class Refusal(msgspec.Struct, array_like=True, frozen=True):
    chunk: int
    group: int
    reason: str


class Error(Message, tag="error"):
    """A request failed; `code` is one of ErrorCode, `message` names the offending value."""
    code: str
    message: str


class Registered(Message, tag="registered"):
    engine: int
    namespace: bytes
    object_bytes: list[int]      # per group
    arena_path: str              # the L1 arena file, for engines on this host that map it (shm format)
    arena_bytes: int
    heartbeat_s: float           # send something at least this often or be reclaimed
    l2: bool = False             # the server has an L2 tier: a prefix may have to come back from disk


class LookupResult(Message, tag="lookup_result"):
    hit_chunks: int
    lease: int                   # 0 when nothing was pinned
    objects: list[ObjectLoc]     # the pinned objects, in retrieve order


class Prefetching(Message, tag="prefetching"):
    """What a Prefetch found and started, counted in objects of its prefix (chunks for hit_chunks)."""
    hit_chunks: int              # the resumable prefix, in L1 or L2 (the Lookup hit rule); the rest is unknown
    in_l1: int                   # already READY in L1 (refreshed as most recently used)
    loading: int                 # already being read from L2 (no second read is started)
    started: int                 # L2 reads started by this request
    waiting: int                 # to start once in-flight spills free room (the server starts them itself)
    refused: int                 # no room: L1 is full of pinned, reserved or loading objects


class Prepared(Message, tag="prepared"):
    reservation: int             # 0 when nothing was reserved
    slots: list[ObjectLoc]       # reserved, to be written then committed, in this order
    present: list[tuple[int, int]]
    refused: list[Refusal]
    fence: int = 0               # the reservation's fence word (arena offset) for a fenced commit; 0: none


class Committed(Message, tag="committed"):
    objects: int
    bytes: int


class Retrieved(Message, tag="retrieved", omit_defaults=True):
    """The objects of one slice of a lease. `total` and `next` are sent only to a Retrieve that named `first`
    (omit_defaults: a client from before paging decodes its reply, which forbids unknown fields)."""
    objects: list[ObjectLoc]     # this slice's objects, from Retrieve.first on; one payload frame follows per object
    total: int | None = None     # the objects the lease holds
    next: int | None = None      # where the next slice starts: `total` when this one ends the lease


class Done(Message, tag="done"):
    count: int = 0


class StatsResult(Message, tag="stats_result"):
    counters: dict[str, int | float]


class HealthResult(Message, tag="health_result"):
    status: str
    version: str
    uptime_s: float
    pid: int


class RecentError(msgspec.Struct, array_like=True, frozen=True):
    """One error reply the server sent: how long ago, to which request type, with which code (no message:
    a message may name another tenant's key)."""
    age_s: float
    request: str
    code: str


class StatusResult(Message, tag="status_result"):
    version: str
    pid: int
    uptime_s: float
    figures: dict[str, int | float]   # server-wide totals and gauges (hybridkv.server.books.telemetry.STATUS_FIGURES)
    limits: dict[str, int]            # the configured bounds the figures are held against
    window_s: float                   # the span `window` covers: the last minute, or the uptime when shorter
    window: dict[str, int | float]    # growth of the totals over that span (hit rate and GB/s come from it)
    errors: dict[str, int]            # error replies sent, by ErrorCode
    recent_errors: list[RecentError]  # the last few, newest first


Reply = (Error | Registered | LookupResult | Prefetching | Prepared | Committed | Retrieved | Done | StatsResult
         | HealthResult | StatusResult)


class ErrorCode(enum.StrEnum):
    BAD_MESSAGE = "bad_message"          # not a decodable request
    VERSION = "version"                  # protocol version mismatch
    UNKNOWN_ENGINE = "unknown_engine"    # never registered, reclaimed, or registered by another connection
    UNKNOWN_RESERVATION = "unknown_reservation"
    UNKNOWN_LEASE = "unknown_lease"
    BAD_PAYLOAD = "bad_payload"          # wrong frame count or size
    BAD_REQUEST = "bad_request"          # decodable but inconsistent (key size, index, group, duplicate)
    LAYOUT = "layout"
    LIMIT = "limit"                      # over a configured bound (keys, bytes, engines, leases, queue)
    FORBIDDEN = "forbidden"              # an operation on every tenant, on a server without --admin
    SHUTTING_DOWN = "shutting_down"      # the server is stopping: this request will never be answered otherwise
    INTERNAL = "internal"


class BadMessage(ValueError):
    """A frame that is not a request of this protocol; the message says why."""


class _Envelope(msgspec.Struct):
    """The fields every message carries, read leniently (unknown fields ignored) from a frame that
    did not decode, so its error reply can still name the right version and echo the request id."""
    v: int = PROTOCOL_VERSION
    id: int = 0


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes | memoryview) -> Request:
    """Decode one request frame; raises BadMessage naming the problem, whatever went wrong.

    Any exception class becomes BadMessage: deep nesting raises RecursionError inside msgspec, a
    layout's own checks raise LayoutError, and none of them may reach the server loop."""
    try:
        return _request_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessage(str(e)) from None
    except RecursionError:
        raise BadMessage("nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - a hostile frame may trip anything; it is the sender's error
        raise BadMessage(f"{type(e).__name__}: {e}") from None


def peek_envelope(frame: bytes | memoryview) -> tuple[int, int]:
    """(version, request id) of a frame that failed decode_request; (PROTOCOL_VERSION, 0) if unreadable."""
    try:
        env = _envelope_decoder.decode(frame)
    except Exception:  # noqa: BLE001 - best effort: the reply is an error either way
        return PROTOCOL_VERSION, 0
    if not (0 <= env.id < 1 << 64 and -(1 << 63) <= env.v < 1 << 63):
        return PROTOCOL_VERSION, 0
    return env.v, env.id


def decode_reply(frame: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(frame)
