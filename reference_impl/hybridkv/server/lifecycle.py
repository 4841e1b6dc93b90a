"""Start and exit hygiene: an ipc endpoint is taken over only when stale, never from a live server."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

from hybridkv.endpoints import default_ipc_dir, ensure_private_dir

log = logging.getLogger("hybridkv.server")


class EndpointInUse(RuntimeError):
    """Another live process listens on the endpoint."""


def claim_ipc_path(path: str) -> None:
    """Make `path` free for bind: refuse a live server's socket, remove a dead one's."""
    parent = os.path.dirname(path) or "."
    if os.path.abspath(parent) == str(default_ipc_dir()):
        ensure_private_dir(default_ipc_dir())
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise EndpointInUse(f"ipc endpoint {path} exists and is not a socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise EndpointInUse(f"cannot tell whether ipc endpoint {path} is in use ({e}); refusing to take "
                                "it over") from None
        # Nobody accepts on it: the socket file of a server that is gone.
        log.info("taking over the stale ipc endpoint %s", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise EndpointInUse(f"ipc endpoint {path} is in use by a live process (another hybridkv server?); "
                        "stop it or choose another --endpoint")
