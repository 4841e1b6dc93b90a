"""How much memory this process may still take: the machine's (MemAvailable) and its memory cgroup's.

A tmpfs file's pages are RAM, charged to the memory cgroup of the process that allocates them, and the tmpfs
mount's size says nothing of either: /dev/shm is half the RAM by default, whatever else runs, and a container's
limit is not in it. Backing more than is left wakes the OOM killer, which in a cgroup ends the server with no
word (exit 137) and on the machine ends other processes (unmapped tmpfs pages count in no process's score, so
it kills one process after another without freeing them). So the arena's size is checked against both before
its first byte is allocated. Both figures keep a margin: the server's own tables, and what the others need.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1; v2 as "max"


def margin(total: int) -> int:
    """What to leave of `total` bytes of memory: 1/16 of it, at least 128 MiB, at most 2 GiB."""
    return min(2 * GIB, max(128 * MIB, total // 16))


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo's figures in bytes (its "kB" are KiB)."""
    out = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


@dataclass(frozen=True)
class Cgroup:
    """One memory cgroup's limit and use (its reclaimable page cache aside), in bytes."""
    path: Path
    limit: int
    used: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.used - margin(self.limit))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def _stat(path: Path, name: str) -> int:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name and value.isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def memory_cgroup_dirs(proc_cgroup: str = "/proc/self/cgroup",
                        mountinfo: str = "/proc/self/mountinfo") -> list[tuple[Path, Path, bool]]:
    """(this process's memory cgroup directory, its hierarchy's mount point, v2?) for each mounted hierarchy that
    has the memory controller (v1), or the unified one (v2)."""
    try:
        groups = Path(proc_cgroup).read_text().splitlines()
        mounts = Path(mountinfo).read_text().splitlines()
    except OSError:
        return []
    wanted: dict[str, str] = {}  # "memory" (v1) / "" (v2) -> the cgroup path
    for line in groups:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            wanted[""] = path
        elif "memory" in controllers.split(","):
            wanted["memory"] = path
    found = []
    for line in mounts:
        fields = line.split()
        if " - " not in line:
            continue
        post = line.split(" - ", 1)[1].split()
        fstype, options = post[0], post[2].split(",") if len(post) > 2 else []
        root, point = fields[3], Path(fields[4])
        key = "" if fstype == "cgroup2" else "memory" if fstype == "cgroup" and "memory" in options else None
        if key is None or key not in wanted:
            continue
        rel = os.path.relpath(wanted[key], root)
        if rel.startswith(".."):  # our cgroup is outside what this mount shows
            continue
        found.append((point / rel if rel != "." else point, point, key == ""))
    return found


def memory_cgroups() -> list[Cgroup]:
    """The memory cgroups with a limit that this process is in, itself and its ancestors up to its hierarchy's
    root: each can end it."""
    out = []
    for leaf, top, v2 in memory_cgroup_dirs():
        d = leaf
        while True:
            if v2:
                limit, current = _read_int(d / "memory.max"), _read_int(d / "memory.current")
                cache = _stat(d / "memory.stat", "inactive_file")
            else:
                limit, current = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
                cache = _stat(d / "memory.stat", "total_inactive_file")
            if limit is not None and current is not None and limit < UNLIMITED:
                out.append(Cgroup(d, limit, max(0, current - cache)))
            if d == top or d.parent == d:
                break
            d = d.parent
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def check_room(size: int, directory: str | Path, shm_free: int) -> str | None:
    """Why `size` bytes of tmpfs file in `directory` (`shm_free` free there) cannot be held: one line naming the
    three figures (the mount's free space, the RAM available, the memory cgroup's room), or None when they fit."""
    info = meminfo()
    available = info.get("MemAvailable", info.get("MemFree", 0))
    ram_room = max(0, available - margin(info.get("MemTotal", available)))
    groups = memory_cgroups()
    tightest = min(groups, key=lambda g: g.room, default=None)
    if size <= shm_free and size <= ram_room and (tightest is None or size <= tightest.room):
        return None
    cgroup = ("the memory cgroup sets no limit" if tightest is None else
              f"the memory cgroup {_gib(tightest.room)} (limit {_gib(tightest.limit)} of {tightest.path}, "
              f"{_gib(tightest.used)} in use, a {_gib(margin(tightest.limit))} margin)")
    return (f"L1 of {_gib(size)} cannot be held: {directory} has {_gib(shm_free)} free, RAM {_gib(ram_room)} "
            f"(MemAvailable {_gib(available)} less a {_gib(margin(info.get('MemTotal', available)))} margin), "
            f"{cgroup}; lower --l1-gib")
