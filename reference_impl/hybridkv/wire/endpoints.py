"""Where a cache server listens: the default endpoint (an ipc socket in a private directory) and the checks an
endpoint passes. Core, because the server binds these and the engine side connects to them."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path


class ConfigError(ValueError):
    """A server setting that cannot work; the message names the setting and the value."""


# Where `hybridkv serve`, `hybridkv status` and the vLLM connector meet when told nothing else, set for all three
# (--endpoint, kv_connector_extra_config's endpoint, a config file's endpoint = ... override it, each for its own)
ENDPOINT_ENV = "HYBRIDKV_ENDPOINT"


def default_ipc_dir() -> Path:
    """A private (0700) directory for the server's ipc socket: /tmp/hybridkv-UID, the same in every process of the
    user. Not $XDG_RUNTIME_DIR: a login shell has it and a service, a container or `sudo -u` does not, so a server
    and a vLLM started in two of them looked in two places and never met."""
    return Path("/tmp") / f"hybridkv-{os.getuid()}"


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
    """The endpoint when neither a setting nor $HYBRIDKV_ENDPOINT names one (the edges read the variable)."""
    return f"ipc://{default_ipc_dir() / 'server.sock'}"


def endpoint_from(environ: Mapping[str, str]) -> str:
    """The endpoint a command uses when no setting of its own names one: $HYBRIDKV_ENDPOINT, else the default."""
    return environ.get(ENDPOINT_ENV) or default_endpoint()


def why_unreachable(endpoint: str) -> str:
    """What can be seen from here of an endpoint where no server answered, for the line that says so."""
    if endpoint.startswith("ipc://") and not Path(endpoint[len("ipc://"):]).exists():
        return f"the socket file {endpoint[len('ipc://'):]} does not exist"
    return "nothing answered there"


def check_endpoint(endpoint: str) -> str:
    """Accept ipc://PATH, or tcp on the loopback interface only (the protocol has no authentication); no control
    characters (a newline or NUL in a path reaches log lines and the filesystem)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in endpoint):
        raise ConfigError(f"endpoint must not hold control characters, got {endpoint!r}")
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
