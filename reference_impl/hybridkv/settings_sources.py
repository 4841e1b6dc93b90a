"""A command's settings from three places beneath its flags: flags over `HYBRIDKV_<FLAG>` environment variables
over a TOML file (`--config FILE`, or `HYBRIDKV_CONFIG`) over the flags' defaults.

Generic over an argparse parser: every long flag is a key, named as the flag without its dashes (`l1-gib`; in the
file `l1_gib` too), its variable HYBRIDKV_ and the name in capitals with underscores (`HYBRIDKV_L1_GIB`). A flag
added to the parser gets its key and its variable for free. A flag whose metavar is JSON takes a TOML table (or
array) in the file. Values go through the flag's own type and choices; an unknown key, or a value its flag would
refuse, is one line naming the file or the variable (UserError, exit status 2).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "HYBRIDKV_"
CONFIG_ENV = "HYBRIDKV_CONFIG"
# HYBRIDKV_ variables read by other parts, which a command leaves alone: the vLLM connector's settings and its
# config file (hybridkv.engine.vllm.settings; a test holds this list to its fields)
OTHER_ENV = frozenset({"HYBRIDKV_CONNECTOR_CONFIG"} | {ENV_PREFIX + k.upper() for k in (
    "salt", "wire_format", "copy_engine", "streams", "commit", "store_policy", "retrieve_policy", "chunk_tokens",
    "lookup_timeout_s", "step_timeout_s", "l2_wait_s", "timeout_s", "retry_s", "expect_preset", "load_mode",
    "state_every_chunks", "max_link_fraction", "max_compute_cost", "link_gbps")})
# `hybridkv serve`'s variables, one per long flag (a test holds this list to its parser), which the connector leaves
# alone: this module cannot ask the server's parser itself (the engine side never imports the server)
SERVE_ENV = frozenset(ENV_PREFIX + k.upper().replace("-", "_") for k in (
    "admin", "chunk-tokens", "client-timeout", "cuda-ipc", "endpoint", "eviction", "exit-with-parent", "flush-on-exit",
    "headline-interval", "io-threads", "l1-dir", "l1-gib", "l2-adapter", "l2-dir", "l2-fsync", "l2-gib", "log-format",
    "log-level", "max-clients", "max-engines", "max-engines-per-client", "max-frame-bytes", "max-keys", "max-leases",
    "max-message-bytes", "max-pending", "max-prefetches", "max-queued-replies", "max-reservations",
    "max-retrieve-objects", "metrics-host", "metrics-port", "quarantine", "spill-watermark", "l1-memfd"))
# Each HYBRIDKV_ variable some part reads; a part refuses any other (a typo would otherwise be a setting silently unset)
EVERY_ENV = frozenset({CONFIG_ENV, *OTHER_ENV, *SERVE_ENV})
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_UNSET = object()
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# A settings file is a few hundred bytes: a larger one is no settings file (/dev/zero, a log named by mistake), and
# reading it whole filled the RAM.
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Setting:
    """One key: its flag's action, and where its value came from ("default", "flag", the variable, the file)."""
    key: str
    action: argparse.Action
    source: str = "default"


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper().replace("-", "_")


def keys_of(parser: argparse.ArgumentParser, exclude: Iterable[str] = ()) -> dict[str, argparse.Action]:
    """key -> action: each dest once, under its first long flag (an alias sharing a dest is no key of its own)."""
    skip = {"help", "version", "config", "print-config", *(f.lstrip("-") for f in exclude)}
    out: dict[str, argparse.Action] = {}
    dests = set()
    for action in parser._actions:
        longs = [s[2:] for s in action.option_strings if s.startswith("--")]
        if not longs or longs[0] in skip or action.dest in dests or action.dest == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        dests.add(action.dest)
        out[longs[0]] = action
    return out


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", default=None,
                   help=f"read settings from this TOML file (default: ${CONFIG_ENV} if set): each flag's long name "
                        "is a key (l1-gib = 32), a JSON flag a table ([l2-adapter]); flags over HYBRIDKV_<FLAG> "
                        "variables (HYBRIDKV_L1_GIB=32) over the file")
    p.add_argument("--print-config", action="store_true",
                   help="print the settings the flags, variables and file make, with where each came from, as a "
                        "TOML file (--config takes it back), and exit; settings the command would refuse are "
                        "refused here, in the same line (what only the machine can refuse comes at the start)")


def convert(action: argparse.Action, value: Any, where: str) -> Any:
    """`value` (from TOML, or an environment variable's string) as the flag's own parsing would make it."""
    from hybridkv.cli import UserError

    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
            value = value.strip().lower() in TRUE
        if not isinstance(value, bool):
            raise UserError(f"{where} must be true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if has_nul(value):  # no flag or variable can hold one; C below (libzmq, the OS) would cut the text at it
        raise UserError(f"{where} holds a NUL character: {value!r}")
    if isinstance(value, dict | list) and action.metavar == "JSON":
        value = json.dumps(value)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise UserError(f"{where} must be a {getattr(action.type, '__name__', 'string')}, got {value!r}")
    try:
        out = action.type(str(value)) if callable(action.type) else str(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise UserError(f"{where}: invalid {getattr(action.type, '__name__', 'value')} value {value!r}") from None
    if action.choices is not None and out not in action.choices:
        raise UserError(f"{where} must be one of {sorted(action.choices)}, got {value!r}")
    return out




def has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, dict):
        return any(has_nul(k) or has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(map(has_nul, value))
    return False


def load_toml(path: str, what: str) -> dict[str, Any]:
    """The table of the TOML settings file at `path`, or UserError in one line starting with `what` (the flag or the
    setting that named the file): not a regular file, too large for a settings file, not UTF-8, not TOML."""
    from hybridkv.cli import UserError

    try:
        # O_NONBLOCK: a FIFO's open would wait for a writer; the descriptor is looked at before any read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UserError(f"{what}: not a regular file")
            if st.st_size > MAX_CONFIG_BYTES:
                raise UserError(f"{what}: {st.st_size} B; a settings file holds at most {MAX_CONFIG_BYTES} B")
            return tomllib.loads(f.read(MAX_CONFIG_BYTES + 1).decode())  # bounded should it grow meanwhile
    except UnicodeDecodeError as e:
        raise UserError(f"{what}: not TOML: not UTF-8 ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{what}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{what}: not TOML: {e}") from None


def unknown_variable(environ: Mapping[str, str], known: Iterable[str]) -> str | None:
    """One line naming the first HYBRIDKV_ variable of `environ` not in `known`, with the likeliest meant of every
    part's variables (EVERY_ENV: one the connector reads is said to be its), or None."""
    known = set(known)
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known:
            close = difflib.get_close_matches(name, sorted(known | EVERY_ENV), n=1)
            whose = ", which the vLLM connector reads" if close and close[0] not in known else ""
            return f"unknown environment variable {name}" + (f" (did you mean {close[0]}{whose}?)" if close else "")
    return None


def read_file(path: str, keys: Mapping[str, argparse.Action]) -> dict[str, tuple[Any, str]]:
    """key -> (value, source) from the TOML file at `path`."""
    from hybridkv.cli import UserError

    table = load_toml(path, f"--config {path}")
    out = {}
    for raw_key, value in table.items():
        key = raw_key.replace("_", "-")
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=1)
            raise UserError(f"--config {path}: unknown key {raw_key!r}" + (f" (did you mean {close[0]!r}?)" if close
                            else "") + "; the keys are the long flags of --help without their dashes")
        out[key] = (convert(keys[key], value, f"{raw_key} in {path}"), f"--config {path}")
    return out


def read_env(environ: Mapping[str, str], keys: Mapping[str, argparse.Action]) -> dict[str, tuple[Any, str]]:
    """key -> (value, source) from HYBRIDKV_<KEY> variables; a HYBRIDKV_ variable that no part reads is refused."""
    from hybridkv.cli import UserError

    names = {env_name(k): k for k in keys}
    unknown = unknown_variable({k: v for k, v in environ.items() if k not in OTHER_ENV}, {*names, CONFIG_ENV})
    if unknown:
        raise UserError(f"{unknown}; each long flag of --help is a variable {ENV_PREFIX}<FLAG>, e.g. "
                        f"{next(iter(names), ENV_PREFIX + 'X')}")
    return {names[name]: (convert(keys[names[name]], value, name), name)
            for name, value in sorted(environ.items()) if name in names}


def parse(parser: argparse.ArgumentParser, argv: list[str], environ: Mapping[str, str] | None = None,
          exclude: Iterable[str] = ()) -> argparse.Namespace:
    """parse_args(argv) with the variables and the file beneath the flags; the result's `settings` attribute holds
    a Setting per key (for --print-config). `exclude`: flags that are no key (the command line's alone)."""
    environ = os.environ if environ is None else environ
    keys = keys_of(parser, exclude)
    ns = argparse.Namespace(**{a.dest: _UNSET for a in parser._actions if a.dest != argparse.SUPPRESS})
    args = parser.parse_args(argv, ns)
    path = args.config if args.config is not _UNSET else environ.get(CONFIG_ENV) or None
    layered = {**(read_file(path, keys) if path else {}), **read_env(environ, keys)}
    settings = {}
    for key, action in keys.items():
        if getattr(args, action.dest) is not _UNSET:
            settings[key] = Setting(key, action, "flag")
        elif key in layered:
            setattr(args, action.dest, layered[key][0])
            settings[key] = Setting(key, action, layered[key][1])
        else:
            settings[key] = Setting(key, action)
    for action in parser._actions:  # the rest: defaults, as parse_args would have set them
        if action.dest != argparse.SUPPRESS and getattr(args, action.dest) is _UNSET:
            default = parser.get_default(action.dest)
            if isinstance(default, str) and callable(action.type):
                default = action.type(default)
            setattr(args, action.dest, default)
    args.config = path
    args.settings = settings
    return args


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):  # JSON's escapes are TOML's, but for DEL, which TOML wants escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_value(key)


def describe(args: argparse.Namespace, command: str) -> str:
    """The settings of `args` (from parse()) as a TOML file, each line saying where its value came from; a key
    without a value (its flag's default is none) as a comment. A JSON flag's value is a table at the end."""
    lines = [f"# {command}: flags over HYBRIDKV_<FLAG> variables over --config FILE over defaults"]
    tables = []
    for key, s in args.settings.items():
        value = getattr(args, s.action.dest)
        if isinstance(s.action, argparse._StoreFalseAction):
            value = not value
        if value is None:
            lines.append(f"# {key}: not set ({s.source})")
        elif s.action.metavar == "JSON" and isinstance(parsed := json.loads(value), dict):
            tables.append(f"\n[{key}]  # {s.source}")
            tables += [f"{toml_key(k)} = {toml_value(v)}" for k, v in parsed.items()]
        else:
            lines.append(f"{key} = {toml_value(value)}  # {s.source}")
    return "\n".join(lines + tables)
