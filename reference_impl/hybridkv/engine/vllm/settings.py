"""The connector's settings, read once from `kv_connector_extra_config` and validated at the door."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_type_hints

import msgspec

from hybridkv.engine.config import TransferAxes, check_pacing
from hybridkv.wire.endpoints import default_endpoint
from hybridkv.wire.wire_formats import traits

LoadMode = Literal["async", "layerwise"]


@dataclass(frozen=True, slots=True)
class ConnectorSettings(TransferAxes):
    """Extra-config keys of HybridKVConnector: the transfer axes (their defaults: shm, the engine's GPU writing straight
    into the server's arena; a store's commit leaving with its copies; attention of every chunk and the recurrent
    state at the boundary, the only policies vLLM allows) and the connector's own; the defaults are the fast path."""

    endpoint: str = field(default_factory=default_endpoint)  # where `hybridkv serve` listens by default
    salt: str = ""                  # tenant / namespace salt: engines with different salts never share chunks
    chunk_tokens: int = 0           # 0: vLLM's block size (the unified hybrid block); see connector.check_chunk_states
    lookup_timeout_s: float = 1.0   # a lookup (scheduler or worker) slower than this counts as a miss
    step_timeout_s: float = 1.0     # the longest a step waits for a store's copies; later ones are cancelled
    # A request whose cached prefix is partly on disk (L2): the connector starts the reads (Prefetch) and
    # tells vLLM "not yet", so the request waits in vLLM's queue, not the scheduler in a lookup; vLLM asks
    # again each step. After this long the lookup waits for the reads itself. 0: always wait in the lookup.
    l2_wait_s: float = 30.0
    timeout_s: float = 30.0         # stores, loads and registration
    retry_s: float = 10.0           # how long a server that refused the registration is left alone (health.py)
    expect_preset: str = ""         # a hybridkv preset name: refuse to start when vLLM's layout differs
    # async: a hit is loaded whole while the request waits in vLLM's queue. layerwise: only the lookup, the pins
    # and the GDN states load there; the attention pages are copied from the pinned arena in the request's first
    # scheduled step, each attention layer waiting for its own (README, "Layer-wise loads")
    load_mode: LoadMode = "async"
    # Hits at every shared block (checkpoints.py): ask vLLM to keep a GDN state every this many chunks of a
    # request's prefill and decode (a step ends there), so a request diverging from a stored prompt, or a chat
    # turn resuming through the last answer, resumes at the last chunk it shares. 0: only where vLLM keeps one
    # itself (the prompt's last block boundary). Models without recurrent groups ignore it.
    state_every_chunks: int = 1
    # Pacing of the copies on the GPU, as TransferConfig's (hybridkv.engine.config): at most this share of the link
    # on average (1: unpaced) ...
    max_link_fraction: float = 1.0
    # ... or at most this cost to memory-bound compute beside them (0: no cap; each direction paced to the share of
    # the link that costs this); with both set, the lower share holds
    max_compute_cost: float = 0.0
    link_gbps: float = 0.0          # the link's rate a pace is a share of; 0: measured once when a pace applies

    def __post_init__(self) -> None:
        TransferAxes.__post_init__(self)  # zero-argument super() does not reach it in a slots dataclass
        for name in ("store_policy", "retrieve_policy"):
            if getattr(self, name) != "boundary":
                # vLLM's block table holds one GDN state block per request, at the hit's end (align mode), and
                # keeps states only where a scheduler step ended: there is nowhere to load, or to take, others
                raise ValueError(f"kv_connector_extra_config {name} {getattr(self, name)!r} is not supported under "
                                 "vLLM: only 'boundary' (attention of every chunk, the GDN state at the hit's end)")
        if traits(self.wire_format).server_holds_cuda:
            raise ValueError(f"kv_connector_extra_config wire_format {self.wire_format} is a baseline the connector "
                             "does not offer: the server would hold a CUDA context")
        if self.load_mode == "layerwise" and not traits(self.wire_format).direct:
            raise ValueError(f"kv_connector_extra_config load_mode 'layerwise' needs a wire format whose copies read "
                             f"the mapped arena (shm), not {self.wire_format!r}: an in-step load must never wait "
                             "for the server")
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"kv_connector_extra_config endpoint must be ipc:// or tcp://, got {self.endpoint!r}")
        for name in ("lookup_timeout_s", "step_timeout_s", "timeout_s", "retry_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"kv_connector_extra_config {name} must be > 0 and finite, "
                                 f"got {getattr(self, name)!r}")
        if not 0 <= self.l2_wait_s < float("inf"):
            raise ValueError(f"kv_connector_extra_config l2_wait_s must be >= 0, got {self.l2_wait_s!r}")
        if self.chunk_tokens < 0:
            raise ValueError(f"kv_connector_extra_config chunk_tokens must be >= 0, got {self.chunk_tokens}")
        if self.state_every_chunks < 0:
            raise ValueError("kv_connector_extra_config state_every_chunks must be >= 0, "
                             f"got {self.state_every_chunks}")
        check_pacing(self.max_link_fraction, self.max_compute_cost, self.link_gbps, "kv_connector_extra_config ")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, environ: Mapping[str, str] | None = None) -> ConnectorSettings:
        """Settings from vLLM's extra-config dict over HYBRIDKV_<KEY> variables of `environ` (default: this
        process's; HYBRIDKV_ENDPOINT is the one `hybridkv serve` and `status` read too); an unknown key, a wrong
        type or a value outside a setting's choices is an error naming the key (or the variable) and the value."""
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        known = sorted(f.name for f in fields(cls))
        path = extra.pop("config", None) or environ.get(CONFIG_ENV)
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {known}")
        hints = get_type_hints(cls)
        from_file = _config_file(str(path), known) if path else {}
        from hybridkv.settings_sources import EVERY_ENV, unknown_variable

        if bad := unknown_variable(environ, EVERY_ENV):  # as `hybridkv serve` refuses one
            raise ValueError(f"{bad}; the connector's are HYBRIDKV_<KEY> of kv_connector_extra_config's keys")
        for name in known:
            var = "HYBRIDKV_" + name.upper()
            if name not in extra and not environ.get(var) and name in from_file:
                extra[name] = from_file[name]
            elif name not in extra and environ.get(var):
                try:
                    extra[name] = msgspec.convert(environ[var], hints[name], strict=False)
                except msgspec.ValidationError:
                    want = f"one of {get_args(hints[name])}" if get_args(hints[name]) else hints[name].__name__
                    raise ValueError(f"{var} must be {want}, got {environ[var]!r}") from None
        try:
            return msgspec.convert(extra, cls)
        except msgspec.ValidationError as e:
            msg = str(e)
            key = msg.rpartition(" - at `$.")[2].rstrip("`") if " - at `$." in msg else ""
            if key not in extra:
                raise ValueError(msg) from None  # one of __post_init__'s checks: it names the key itself
            want = get_type_hints(cls)[key]
            choices = f"one of {get_args(want)}" if get_args(want) else want.__name__
            raise ValueError(f"kv_connector_extra_config {key} must be {choices}, got {extra[key]!r}") from None


CONFIG_ENV = "HYBRIDKV_CONNECTOR_CONFIG"  # a TOML file of connector settings, beneath variables and extra-config


def _config_file(path: str, known: list[str]) -> dict[str, Any]:
    """The settings of TOML file `path` (the extra-config keys, `-` or `_` alike), read as `hybridkv serve --config`
    reads its file; an unreadable file, bad TOML, an unknown key or a NUL character is an error naming the file."""
    from hybridkv.cli import UserError
    from hybridkv.settings_sources import has_nul, load_toml

    try:
        table = load_toml(path, f"connector config file {path}")
    except UserError as e:
        raise ValueError(str(e)) from None
    out = {k.replace("-", "_"): v for k, v in table.items()}
    unknown = sorted(set(out) - set(known))
    if unknown:
        raise ValueError(f"connector config file {path}: unknown keys {unknown}; known: {known}")
    if nul := sorted(k for k, v in out.items() if has_nul(v)):
        raise ValueError(f"connector config file {path}: {nul[0]} holds a NUL character")
    return out


def kv_transfer_config(endpoint: str, **extra: Any) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` (or `LLM(kv_transfer_config=...)`) for HybridKVConnector at `endpoint`, with
    the settings it needs (`kv_role` both, `kv_load_failure_policy` recompute) and extra-config keys `extra`."""
    return dict(kv_connector="HybridKVConnector", kv_connector_module_path="hybridkv.engine.vllm.connector",
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"endpoint": endpoint, **extra})


def no_server_at_start(settings: ConnectorSettings, error: BaseException) -> str:
    """The line a connector logs when no server answers as it starts: where it looked, why there, and what it
    means (a server that never answers there leaves offload doing nothing, request after request)."""
    from hybridkv.wire.endpoints import ENDPOINT_ENV, why_unreachable

    default = settings.endpoint == default_endpoint()
    origin = ("the default, where `hybridkv serve` listens without --endpoint" if default
              else f"from kv_connector_extra_config's endpoint or ${ENDPOINT_ENV}")
    return (f"hybridkv: NO CACHE SERVER at {settings.endpoint} ({origin}): {why_unreachable(settings.endpoint)} "
            f"({type(error).__name__}: {error}). Offload does nothing until a server answers there (tried again every "
            f"{settings.retry_s:g} s): start `hybridkv serve`, or give both the same endpoint (${ENDPOINT_ENV})")
