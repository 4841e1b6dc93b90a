"""A scenario's `[server]` table: the cache server's capacities. Below the scenario and the workload kinds: the
scenario holds it and a kind's checks read it (`workloads.base.Sizing`), and neither imports the other for it."""

from __future__ import annotations

from hybridkv_bench.strict import Strict

GIB = 1 << 30


class ServerSpec(Strict, frozen=True):
    """Cache-server capacities. GiB = 2**30 bytes."""

    l1_gib: float
    l2_gib: float = 0.0  # 0: no L2
    l2_dir: str = ""  # "": a temporary directory made by the runner
    client_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.l1_gib > 0:
            raise ValueError(f"l1_gib must be positive, got {self.l1_gib}")
        if self.l2_gib < 0:
            raise ValueError(f"l2_gib must be >= 0, got {self.l2_gib}")
        if not self.client_timeout_s > 0:
            raise ValueError(f"client_timeout_s must be positive, got {self.client_timeout_s}")

    @property
    def l1_bytes(self) -> int:
        return int(self.l1_gib * GIB)

    @property
    def l2_bytes(self) -> int:
        return int(self.l2_gib * GIB)
