"""Where a cache server listens: the default endpoint (an ipc socket in a private directory) and the checks an
endpoint passes. Core, because the server binds these and the engine side connects to them."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class ConfigError(ValueError):
    """A server setting that cannot work; the message names the setting and the value."""


def default_ipc_dir() -> Path:
    """A private (0700) directory for the server's ipc socket."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"hybridkv-{os.getuid()}"


def ensure_private_dir(path: Path) -> Path:
    """Create `path` with mode 0700, or check that an existing one is ours and not open to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to uid {st.st_uid}, not to us: refusing to put a socket there")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(f"{path} is open to other users (mode {oct(stat.S_IMODE(st.st_mode))}); chmod 700 it")
    return path


def default_endpoint() -> str:
    return f"ipc://{default_ipc_dir() / 'server.sock'}"


def check_endpoint(endpoint: str) -> str:
    """Accept ipc://PATH, or tcp on the loopback interface only (the protocol has no authentication)."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) <= len("ipc://"):
            raise ConfigError("ipc endpoint needs a path, e.g. ipc:///tmp/hybridkv-0/server.sock")
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host not in ("127.0.0.1", "localhost", "[::1]"):
            raise ConfigError(f"tcp endpoint must bind 127.0.0.1 (no authentication on the wire), got {host!r}")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"tcp endpoint needs a port in 1..65535, got {port!r}")
        return endpoint
    raise ConfigError(f"endpoint must start with ipc:// or tcp://127.0.0.1:, got {endpoint!r}")
