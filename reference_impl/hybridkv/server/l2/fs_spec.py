"""The spec of a filesystem L2 (fs.py): a directory, a payload capacity, fsync or not."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from hybridkv.server.l2.specs import GIB, L2ConfigError, adapter_class, number, typed

if TYPE_CHECKING:
    from hybridkv.server.l2.base import L2Adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FsL2Spec:
    """A filesystem L2: `base_path`, a payload capacity, and whether every file is fsynced."""

    base_path: str
    capacity_bytes: int
    fsync: bool = False

    # the seed's --l2-adapter JSON keys for this kind; values are checked by __post_init__
    json_keys: ClassVar[frozenset[str]] = frozenset({"base_path", "max_capacity_gb", "fsync"})

    def __post_init__(self) -> None:
        if not self.base_path:
            raise L2ConfigError("fs L2 needs a base_path (a directory)")
        if self.capacity_bytes <= 0:
            raise L2ConfigError(f"fs L2 capacity must be positive, got {self.capacity_bytes} B")

    @classmethod
    def from_json(cls, kind: str, d: dict[str, Any], env: Mapping[str, str]) -> FsL2Spec:
        """The spec of the seed's --l2-adapter JSON `d` (its "type" taken out); `env` is not read."""
        for need in ("base_path", "max_capacity_gb"):
            if need not in d:
                raise L2ConfigError(f'--l2-adapter type "{kind}" needs "{need}"')
        return cls(str(typed(d, "base_path", str)), int(number(d, "max_capacity_gb") * GIB),
                   bool(typed(d, "fsync", bool, False)))

    def to_json(self) -> dict[str, Any]:
        """The --l2-adapter JSON that `from_json` turns back into this spec."""
        return {"type": "fs", "base_path": self.base_path, "max_capacity_gb": self.capacity_bytes / GIB,
                "fsync": self.fsync}

    def open(self) -> L2Adapter:
        filesystem_l2 = adapter_class("hybridkv.server.l2.fs", "FilesystemL2")
        l2 = filesystem_l2(self.base_path, self.capacity_bytes, fsync=self.fsync)
        if short := self.disk_shortfall(l2.stats()["disk_bytes"]):  # serving goes on: a failed write is counted
            log.warning("L2: capacity %.3f GiB, but %s has room for %.3f GiB (free + what L2 holds): once the disk "
                        "fills, writes fail (ENOSPC) and objects leave L1 with no L2 copy", self.capacity_bytes / GIB,
                        self.base_path, (self.capacity_bytes - short) / GIB)
        return l2

    def disk_shortfall(self, held: int = 0) -> int:
        """The bytes of the capacity that the directory's disk has no room for (its free space plus `held`, what the
        L2 holds there already); 0 when it all fits."""
        return max(0, self.capacity_bytes - shutil.disk_usage(self.base_path).free - held)

    def describe(self) -> str:
        """The L2 as the server's ready line shows it."""
        return f"{self.base_path} ({self.capacity_bytes / GIB:g} GiB)"
