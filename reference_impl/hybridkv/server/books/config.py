"""Server configuration: one typed struct built at the edge (CLI or harness) and passed down."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.server.l2.specs import GIB, L2Spec  # noqa: F401 (GIB re-exported: sizes are given in GiB)
from hybridkv.wire.endpoints import (  # noqa: F401 (re-exported: the server's settings and its socket directory)
    ConfigError,
    check_endpoint,
    default_endpoint,
    default_ipc_dir,
    ensure_private_dir,
)

EVICTION_POLICIES = ("lru", "fifo")
MIN_CLIENT_TIMEOUT_S = 0.05


@dataclass(frozen=True, slots=True)
class ServerConfig:
    l1_bytes: int
    endpoint: str = ""
    l1_dir: str = "/dev/shm"
    l1_memfd: bool = False          # the arena a sealed memfd (nobody can shrink it) instead of a file in l1_dir
    l2: L2Spec | None = None        # the L2 below L1 (a directory, a Redis shared between hosts), or none
    chunk_tokens: int = 0           # 0: each engine chooses; otherwise engines must register with it
    eviction: str = "lru"
    client_timeout_s: float = 30.0  # an engine silent this long is gone: its reservations and pins are reclaimed
    quarantine_s: float = 5.0       # reclaimed slots stay unused this long, in case a late writer still DMAs
    io_threads: int = 4
    spill_watermark: float = 0.1    # keep this fraction of L1 free or clean (in L2) so stores never wait
    flush_on_exit: bool = False     # spill every dirty L1 object to L2 on a clean shutdown
    # stop cleanly (arena removed) once the process that started this one is gone (0: never): a harness or
    # test killed with SIGKILL leaves no server and no arena behind. The pid the parent had at start.
    parent_pid: int = 0
    cuda_ipc: bool = False          # accept the CUDA-IPC baseline format (the server then uses a GPU)
    # ---- limits: what one client can make the server hold or do (DESIGN: Trust and limits) ----
    admin: bool = False             # let every client clear all namespaces and read server-wide stats
    max_keys: int = 1 << 16         # keys per request (a 1M-token prompt of 16-token chunks)
    max_message_bytes: int = 8 << 20   # the msgpack request frame
    max_frame_bytes: int = 256 << 20   # any one frame (payload frames of raw / legacy commits)
    max_clients: int = 0            # connections at once (0: as many as the open-file limit leaves room for)
    max_engines: int = 1024
    max_engines_per_client: int = 64  # one connection's share of max_engines (a TP-8 host needs 8 at most)
    max_leases: int = 4096          # per engine
    max_reservations: int = 1024    # per engine
    max_queued_replies: int = 1000  # per client: ZMQ send high-water mark (replies beyond it are dropped)
    max_pending: int = 256          # per client: requests answered later (parked or on a worker)
    max_prefetches: int = 16        # per engine: Prefetch requests still waiting for L1 room to start reads
    # objects (payload frames) one Retrieve answers: its reply is sent in one loop step, a few us a frame, and no
    # other client is answered meanwhile; a client pages through a larger lease (Retrieve.first)
    max_retrieve_objects: int = 1024

    def __post_init__(self) -> None:
        if not self.endpoint:
            object.__setattr__(self, "endpoint", default_endpoint())
        check_endpoint(self.endpoint)
        if self.l1_bytes <= 0:
            raise ConfigError(f"L1 size must be positive, got {self.l1_bytes} B")
        if self.chunk_tokens < 0:
            raise ConfigError(f"chunk tokens must be >= 0, got {self.chunk_tokens}")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction policy must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        # `not` keeps nan out (every comparison with it is false); inf would never reclaim anything either, and a
        # timeout shorter than a few loop ticks would judge every engine silent between two of its heartbeats
        if not MIN_CLIENT_TIMEOUT_S <= self.client_timeout_s < math.inf:
            raise ConfigError(f"client timeout (--client-timeout) must be at least {MIN_CLIENT_TIMEOUT_S} s and "
                              f"finite, got {self.client_timeout_s!r}")
        if not 0 <= self.quarantine_s < math.inf:
            raise ConfigError(f"quarantine (--quarantine) must be 0 or more seconds, got {self.quarantine_s!r}")
        if self.parent_pid < 0:
            raise ConfigError(f"parent pid must be >= 0, got {self.parent_pid}")
        if not 1 <= self.io_threads <= 64:
            raise ConfigError(f"io threads must be in 1..64, got {self.io_threads}")
        if not 0 <= self.max_clients < 1 << 62:
            raise ConfigError(f"max_clients must be >= 0, got {self.max_clients}")
        for name in ("max_keys", "max_message_bytes", "max_frame_bytes", "max_engines", "max_engines_per_client",
                     "max_leases", "max_reservations", "max_queued_replies", "max_pending", "max_prefetches",
                     "max_retrieve_objects"):
            if not 0 < getattr(self, name) < 1 << 62:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not 0 <= self.spill_watermark < 1:
            raise ConfigError(f"spill watermark must be in [0, 1), got {self.spill_watermark}")

    @property
    def has_l2(self) -> bool:
        return self.l2 is not None
