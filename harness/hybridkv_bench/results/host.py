"""Where a run happened: source revision, host, CPU, GPU, driver, PCIe link and package versions.

Everything here reads files or asks small commands; nothing imports torch (versions come from
package metadata), so collecting context costs milliseconds. What cannot be found is None.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

NVIDIA_VENDOR = "0x10de"


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _run(cmd: list[str], cwd: str | Path | None = None, timeout: float = 10.0) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _head_from_files(repo: Path) -> str | None:
    """The commit .git/HEAD points at, read without git (a checkout copied without git installed)."""
    git = repo / ".git"
    if git.is_file():  # a worktree: "gitdir: /path"
        git = Path(git.read_text().split(":", 1)[1].strip())
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        for base in (git, git.parent.parent if git.parent.name == "worktrees" else git):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except (OSError, IndexError):
        return None
    return None


# Written beside a copy of a checkout sent to another machine (a GPU host gets the tree, not its .git, or a
# stale one): "<sha>" or "<sha> clean|dirty", the commit the copy was made from. It wins over git where present.
TREE_FILE = ".tree-commit"
# The root of the tree this code runs from (harness/hybridkv_bench/results/host.py): the tree a run measures.
CODE_ROOT = Path(__file__).resolve().parents[3]


def git_revision(root: str | Path | None = None) -> tuple[str | None, bool | None]:
    """(commit sha, whether tracked files differ from it) of the tree at `root` (default: the tree this code runs
    from); (None, None) when that cannot be told. A `TREE_FILE` at `root` names the commit (dirty unknown when it
    gives the sha alone). A tree that is not the top of its own checkout (a copy laid inside another repository)
    gets no sha: the enclosing repository's HEAD is another tree's."""
    top = Path(root).resolve() if root is not None else CODE_ROOT
    try:
        named = (top / TREE_FILE).read_text().split()
    except OSError:
        named = []
    if len(named) in (1, 2) and len(named[0]) == 40 and all(c in "0123456789abcdef" for c in named[0]):
        if len(named) == 1:
            return named[0], None
        if named[1] in ("clean", "dirty"):
            return named[0], named[1] == "dirty"
    toplevel = _run(["git", "rev-parse", "--show-toplevel"], top)
    if toplevel is not None:
        if Path(toplevel).resolve() != top:
            return None, None
        sha = _run(["git", "rev-parse", "HEAD"], top)
        status = _run(["git", "status", "--porcelain", "--untracked-files=no"], top)
        return sha, (bool(status) if status is not None else None)
    if (top / ".git").exists():  # a checkout copied to a host without git
        return _head_from_files(top), None
    return None, None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_gib() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return round(psutil.virtual_memory().total / (1 << 30), 1)


def nvidia_smi() -> dict | None:
    """GPU names, driver and PCIe link (current and max; an idle link may sit below its max)."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = ("name,driver_version,pcie.link.gen.current,pcie.link.width.current,"
              "pcie.link.gen.max,pcie.link.width.max")
    out = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"])
    if not out:
        return None
    gpus, drivers, links = [], set(), []
    for line in out.splitlines():
        name, driver, gen, width, gen_max, width_max = (x.strip() for x in line.split(","))
        gpus.append(name)
        drivers.add(driver)
        links.append(f"Gen{gen} x{width} (max Gen{gen_max} x{width_max})")
    return {"gpu": gpus, "driver": ", ".join(sorted(drivers)), "pcie_link": links}


def sysfs_pcie_links(root: str | Path = "/sys/bus/pci/devices") -> list[str] | None:
    """PCIe links of NVIDIA display/3D controllers from sysfs, for hosts without nvidia-smi."""
    links = []
    for dev in sorted(Path(root).glob("*")):
        try:
            if (dev / "vendor").read_text().strip() != NVIDIA_VENDOR:
                continue
            if not (dev / "class").read_text().strip().startswith(("0x0300", "0x0302")):
                continue
            speed = (dev / "current_link_speed").read_text().strip()
            width = (dev / "current_link_width").read_text().strip()
        except OSError:
            continue
        links.append(f"{dev.name}: {speed} x{width}")
    return links or None


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "triton", "pyzmq", "msgspec", "nvidia-ml-py"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    import hybridkv
    versions["hybridkv"] = hybridkv.__version__
    return versions


def collect_context(argv: list[str] | None = None, root: str | Path | None = None) -> dict:
    """The run.json `context` block (finished_at is filled in when the run ends); `git_sha` names the tree the
    running code comes from (`git_revision`), not the directory the run was started in."""
    sha, dirty = git_revision(root)
    gpu = nvidia_smi() or {"gpu": None, "driver": None, "pcie_link": sysfs_pcie_links()}
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "git_sha": sha,
        "git_dirty": dirty,
        "host": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "mem_gib": _mem_gib(),
        **gpu,
        "versions": package_versions(),
        "started_at": utc_now(),
        "finished_at": None,
        "argv": list(sys.argv if argv is None else argv),
    }
