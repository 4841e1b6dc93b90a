"""The kinds of L2 a server can run with, and the seed's `--l2-adapter` JSON parsed into a kind's spec.

Each kind's spec lives beside its adapter (fs_spec.py, redis_spec.py) and is named here by module and class,
imported only when a configuration names its kind (vLLM's kv_offload factory): a server without a Redis L2 never
imports the Redis spec or the redis package. A new kind of L2 is its adapter's module, its spec's module, and one
`register_spec` line at the end of this file; the config, the CLI and the server loop take it as they are.

A spec is a frozen value (the `L2Spec` protocol): checked when built, equal field by field, written back as
--l2-adapter JSON by `to_json` (for `server_argv`), and it builds its own adapter with `open()`.
"""

from __future__ import annotations

import importlib
import os
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from hybridkv.server.l2.base import L2Adapter

GIB = 1 << 30
MIB = 1 << 20


class L2ConfigError(ValueError):
    """An L2 adapter setting that cannot work; the message names the setting and the value."""


class L2Spec(Protocol):
    """What every kind's spec offers."""

    json_keys: ClassVar[frozenset[str]]  # the --l2-adapter JSON keys of this kind (values checked by from_json)

    @classmethod
    def from_json(cls, kind: str, d: dict[str, Any], env: Mapping[str, str]) -> L2Spec: ...

    def to_json(self) -> dict[str, Any]: ...

    def open(self) -> L2Adapter: ...

    def describe(self) -> str: ...


_KINDS: dict[str, tuple[str, str]] = {}


def register_spec(kind: str, module: str, cls: str) -> None:
    """--l2-adapter's "type" `kind` builds the spec class `cls` of `module`, imported when a config names it."""
    if kind in _KINDS:
        raise ValueError(f"L2 kind {kind!r} is registered already (as {':'.join(_KINDS[kind])})")
    _KINDS[kind] = (module, cls)


def kinds() -> list[str]:
    """The registered kinds, in registration order."""
    return list(_KINDS)


def spec_class(kind: object) -> type[L2Spec]:
    """The spec class of --l2-adapter's "type" `kind` (its module imported now); an unknown kind is one line that
    lists the known ones."""
    where = _KINDS.get(kind) if isinstance(kind, str) else None
    if where is None:
        *first, last = (f'"{k}"' for k in _KINDS)
        known = f'{", ".join(first)} or {last}' if first else last
        raise L2ConfigError(f'--l2-adapter "type" must be {known}, got {kind!r}')
    return getattr(importlib.import_module(where[0]), where[1])


def adapter_class(module: str, cls: str) -> Any:
    """A spec's adapter class, imported when the spec opens it (by name: the adapter imports its spec's module,
    so a spec importing its adapter would tie the two in a cycle)."""
    return getattr(importlib.import_module(module), cls)


def read_secret(path: str, what: str, content: bool = True) -> bytes:
    """A password or key from a file only its owner can read (surrounding whitespace dropped); with
    `content` False only that check (a TLS key, which OpenSSL reads itself)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise L2ConfigError(f"--l2-adapter {what} {path}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise L2ConfigError(f"--l2-adapter {what} {path} is open to other users (mode "
                                f"{oct(stat.S_IMODE(st.st_mode))}); chmod 600 it")
        if not content:
            return b""
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(1 << 16).strip()
    finally:
        os.close(fd)
    if not data:
        raise L2ConfigError(f"--l2-adapter {what} {path} is empty")
    return data


def parse_l2_adapter(text: str, env: Mapping[str, str]) -> L2Spec:
    """Parse the seed's `--l2-adapter` JSON: {"type": KIND, ...} for a registered KIND ("fs", "redis", "valkey").
    `env` is the environment the edge passes down (a Redis password_env is looked up there, never in os.environ
    below the edge)."""
    import json

    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise L2ConfigError(f"--l2-adapter is not JSON ({e.msg} at character {e.pos}): {text!r:.200}") from None
    except RecursionError:
        raise L2ConfigError(f"--l2-adapter nests too deeply to be an adapter's settings: {text!r:.200}") from None
    if not isinstance(d, dict):
        raise L2ConfigError(f"--l2-adapter must be a JSON object, got {type(d).__name__}: {text!r:.200}")
    if "password" in d:
        raise L2ConfigError("--l2-adapter takes no password (it would show in ps and logs): give password_file "
                            "(a file only you can read) or password_env (the name of an environment variable)")
    kind = d.pop("type", None)
    spec = spec_class(kind)
    _no_unknown(kind, d, spec.json_keys)
    return spec.from_json(kind, d, env)


def _no_unknown(kind: str, d: dict, known: frozenset[str]) -> None:
    extra = sorted(set(d) - known)
    if extra:
        raise L2ConfigError(f"--l2-adapter type {kind!r} does not take {extra}; it takes {sorted(known)}")


def typed(d: dict, name: str, typ: type, default: object = None) -> object:
    """d[name] (or `default`), checked to be a `typ`."""
    v = d.get(name, default)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise L2ConfigError(f"--l2-adapter {name!r} must be {typ.__name__}, got {v!r}")
    return v


def number(d: dict, name: str) -> float:
    """d[name], checked to be a positive number below 2**32."""
    v = d[name]
    # JSON's 1e400 is inf: a size that cannot become bytes
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1 << 32:
        raise L2ConfigError(f"--l2-adapter {name!r} must be a positive number below {1 << 32}, got {v!r}")
    return float(v)


register_spec("fs", "hybridkv.server.l2.fs_spec", "FsL2Spec")
register_spec("redis", "hybridkv.server.l2.redis_spec", "RedisL2Spec")
register_spec("valkey", "hybridkv.server.l2.redis_spec", "RedisL2Spec")
