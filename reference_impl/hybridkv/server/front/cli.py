"""`hybridkv serve`: run the CPU-only cache server in this process until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hybridkv.server.books.config import GIB, ConfigError, ServerConfig
from hybridkv.settings_sources import add_config_arguments

if TYPE_CHECKING:
    from hybridkv.server.front.loop import CacheServer
    from hybridkv.server.front.metrics_http import MetricsEndpoint
    from hybridkv.server.l2.specs import L2Spec

MAX_GIB = float(1 << 32)  # 4 EiB: any larger size (inf among them) is a typo, not a machine

# The flags that are one ServerConfig field's value as it is (a bool field: the flag alone), each named as its
# field (--max-keys: max_keys) but for those in FIELD_OF; `server_config` reads them, `server_argv` writes them back
FIELD_FLAGS = ("--l1-dir", "--chunk-tokens", "--eviction", "--client-timeout", "--quarantine", "--io-threads",
               "--spill-watermark", "--flush-on-exit", "--cuda-ipc", "--admin", "--max-keys", "--max-message-bytes",
               "--max-frame-bytes", "--max-clients", "--max-engines", "--max-engines-per-client", "--max-leases",
               "--max-reservations", "--max-queued-replies", "--max-pending", "--max-prefetches",
               "--max-retrieve-objects", "--l1-memfd")
FIELD_OF = {"--client-timeout": "client_timeout_s", "--quarantine": "quarantine_s"}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hybridkv.wire.endpoints import default_endpoint

    p.add_argument("--endpoint", default=default_endpoint(),
                   help="where to listen: ipc://PATH (default, in a 0700 directory) or tcp://127.0.0.1:PORT; "
                        "`hybridkv status` and the vLLM connector look there too unless told otherwise "
                        "(default: %(default)s)")
    p.add_argument("--l1-gib", type=float, default=4.0,
                   help="size of the shared-memory L1 arena in GiB (default: %(default)s)")
    p.add_argument("--l1-dir", default="/dev/shm",
                   help="tmpfs directory for the L1 arena file, mode 0600 (default: %(default)s)")
    p.add_argument("--l1-memfd", action="store_true",
                   help="make the arena a memfd sealed against shrinking, which engines open as /proc/PID/fd/N, "
                        "instead of a file in --l1-dir: nobody can truncate it under the server (a SIGBUS); "
                        "engines must run in the server's pid namespace")
    p.add_argument("--l2-dir", default=None, help="directory of the filesystem L2 (default: no L2)")
    p.add_argument("--l2-gib", type=float, default=0.0, help="L2 capacity in GiB; 0 disables L2 (default: 0)")
    p.add_argument("--l2-fsync", action="store_true",
                   help="fsync every L2 file before it becomes visible (survives power loss; slower)")
    p.add_argument("--chunk-tokens", type=int, default=0,
                   help="require every engine to use this chunk size; 0 lets each engine choose, "
                        "default its layout's unified block size (default: 0)")
    p.add_argument("--eviction", choices=("lru", "fifo"), default="lru",
                   help="L1 eviction policy for ready, unpinned objects (default: %(default)s)")
    p.add_argument("--client-timeout", type=float, default=30.0,
                   help="seconds of silence after which an engine's reservations and pins are reclaimed "
                        "(clients heartbeat at a third of it) (default: %(default)s)")
    p.add_argument("--quarantine", type=float, default=5.0,
                   help="seconds a reclaimed engine's reserved slots stay unused and its leased objects stay "
                        "pinned, in case the vanished writer is still copying or a reader still reading "
                        "(default: %(default)s)")
    p.add_argument("--io-threads", type=int, default=4,
                   help="worker threads for L2 reads/writes and payload copies (default: %(default)s)")
    p.add_argument("--spill-watermark", type=float, default=0.1,
                   help="with L2: copy least-recently-used objects to L2 ahead of need so this fraction "
                        "of L1 is free or clean (default: %(default)s)")
    p.add_argument("--flush-on-exit", action="store_true",
                   help="with L2: write every L1 object to L2 on shutdown, so a restart finds it")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop cleanly (the arena removed) when the process that started the server exits, "
                        "even by SIGKILL: for servers a harness or a test starts")
    p.add_argument("--cuda-ipc", action="store_true",
                   help="also serve the cuda_ipc baseline format: the server maps engines' GPU pages and "
                        "copies itself, so it creates a CUDA context and holds VRAM (for comparison only)")
    p.add_argument("--admin", action="store_true",
                   help="let every client of the endpoint read server-wide stats and clear every namespace "
                        "(without it, clients clear only their own engine's namespace)")
    p.add_argument("--max-keys", type=int, default=1 << 16, help="keys per request (default: %(default)s)")
    p.add_argument("--max-message-bytes", type=int, default=8 << 20,
                   help="bytes of one request's msgpack frame (default: %(default)s)")
    p.add_argument("--max-frame-bytes", type=int, default=256 << 20,
                   help="bytes of any one frame; a larger one drops its connection (default: %(default)s)")
    p.add_argument("--max-clients", type=int, default=0,
                   help="connections at once; past it the endpoint stops accepting until some leave "
                        "(default 0: what the open-file limit, raised to its hard value, leaves room for)")
    p.add_argument("--max-engines", type=int, default=1024, help="registered engines (default: %(default)s)")
    p.add_argument("--max-engines-per-client", type=int, default=64,
                   help="engines one connection may register, its share of --max-engines (default: %(default)s)")
    p.add_argument("--max-leases", type=int, default=4096, help="leases held per engine (default: %(default)s)")
    p.add_argument("--max-reservations", type=int, default=1024,
                   help="open store reservations per engine (default: %(default)s)")
    p.add_argument("--max-queued-replies", type=int, default=1000,
                   help="replies queued per client that is not reading them; more are dropped "
                        "(default: %(default)s)")
    p.add_argument("--max-pending", type=int, default=256,
                   help="requests per client waiting for an answer (parked or on a worker) (default: %(default)s)")
    p.add_argument("--max-prefetches", type=int, default=16,
                   help="prefetch requests per engine still waiting for L1 room to start their L2 reads "
                        "(default: %(default)s)")
    p.add_argument("--max-retrieve-objects", type=int, default=1024,
                   help="objects (payload frames) one Retrieve answers; a client pages through a larger lease. "
                        "The reply is sent in one step of the loop, a few us an object (default: %(default)s)")
    add_l2_and_seed_arguments(p)
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="log level (default: %(default)s)")
    add_observability_arguments(p)
    add_config_arguments(p)


def parse_command_line(p: argparse.ArgumentParser, argv: Sequence[str],
                       environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The command's arguments: its flags over HYBRIDKV_<FLAG> variables over --config FILE (the seed's flags are
    the command line's alone)."""
    from hybridkv.settings_sources import parse

    return parse(p, list(argv), environ, exclude=(*SEED_REPLACED, *SEED_ALIASES))


def add_observability_arguments(p: argparse.ArgumentParser) -> None:
    """--metrics-port / --metrics-host (Prometheus), --log-format, --headline-interval."""
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port, printed on the "
                        "ready line; default: no metrics endpoint); see docs/metrics.md")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint listens on; it has no authentication, and shows server-wide "
                        "totals only (default: %(default)s)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="log lines as text or as JSON lines with stable field names (default: %(default)s)")
    p.add_argument("--headline-interval", type=float, default=60.0, metavar="S",
                   help="log a line with the headline counters every S seconds; 0: never (default: %(default)s)")


# The seed's server flags we do not take, and what replaces each (one line each, exit status 2).
SEED_REPLACED = {
    "--host": "the server binds loopback or an ipc socket only (no authentication); use --endpoint",
    "--device": "the server holds no device memory; each engine moves its own pages (wire format shm)",
    "--serde": "serialization is chosen per engine (TransferConfig.wire_format), not by the server",
    "--remote-serde": "serialization is chosen per engine (TransferConfig.wire_format), not by the server",
    "--max-local-disk-size": "use --l2-gib (or --l2-adapter '{\"type\":\"fs\",...}')",
    "--local-disk": "use --l2-dir (or --l2-adapter '{\"type\":\"fs\",...}')",
    "--remote-url": "use --l2-adapter '{\"type\":\"redis\",\"url\":\"redis://HOST:PORT/DB\"}'",
}


SEED_ALIASES = ("--l1-size-gb", "--chunk-size", "--eviction-policy", "--port")


def add_l2_and_seed_arguments(p: argparse.ArgumentParser) -> None:
    """--l2-adapter, and the seed's flags: those whose meaning matches ours as aliases, the rest refused."""
    p.add_argument("--l2-adapter", default=None, metavar="JSON",
                   help='L2 as the seed wrote it: \'{"type":"fs","base_path":DIR,"max_capacity_gb":N}\' or '
                        '\'{"type":"redis"|"valkey","url":"redis://HOST:PORT/DB","prefix":"tenant:"}\' '
                        "(a Redis shared by the servers of several hosts); see reference_impl/L2.md")
    seed = p.add_argument_group("the seed's flags (see the README's table)")
    seed.add_argument("--l1-size-gb", dest="l1_gib", type=float, default=argparse.SUPPRESS,
                      help="= --l1-gib (the seed's GB were GiB)")
    seed.add_argument("--chunk-size", dest="chunk_tokens", type=int, default=argparse.SUPPRESS,
                      help="= --chunk-tokens (tokens per chunk)")
    seed.add_argument("--eviction-policy", dest="eviction", type=str.lower, choices=("lru", "fifo"),
                      default=argparse.SUPPRESS, help="= --eviction, LRU or FIFO in any case")
    seed.add_argument("--port", type=int, default=None, help="= --endpoint tcp://127.0.0.1:PORT")
    for flag, instead in SEED_REPLACED.items():
        seed.add_argument(flag, dest=f"seed_{_dest(flag)}", nargs="?", const="", default=None,
                          metavar="X", help=f"not taken (exits 2): {instead}")


def apply_seed(args: argparse.Namespace) -> None:
    """Refuse the seed's flags we do not take; fold --port into args.endpoint."""
    from hybridkv.cli import UserError
    from hybridkv.wire.endpoints import default_endpoint

    for flag, instead in SEED_REPLACED.items():
        if getattr(args, f"seed_{_dest(flag)}") is not None:
            raise UserError(f"{flag} is a seed flag hybridkv does not take: {instead}")
    if args.port is not None:
        # flags over variables over the file: only an --endpoint flag is a second answer to --port
        settings = getattr(args, "settings", None)
        if settings["endpoint"].source == "flag" if settings else args.endpoint != default_endpoint():
            raise UserError(f"--port {args.port} and --endpoint {args.endpoint}: give one")
        if not 0 < args.port < 65536:
            raise UserError(f"--port must be in 1..65535, got {args.port}")
        args.endpoint = f"tcp://127.0.0.1:{args.port}"
        if settings:  # --print-config says where the endpoint came from
            import dataclasses

            settings["endpoint"] = dataclasses.replace(settings["endpoint"], source="flag --port")


def l2_spec(args: argparse.Namespace, env: Mapping[str, str]) -> L2Spec | None:
    """The L2 that --l2-adapter, or --l2-dir / --l2-gib / --l2-fsync, ask for; None without L2. `env`: where a
    Redis password_env is looked up (read here, at the edge: the L2 below is given the password)."""
    import dataclasses

    from hybridkv.cli import UserError
    from hybridkv.server.l2.fs_spec import FsL2Spec
    from hybridkv.server.l2.specs import L2ConfigError, parse_l2_adapter

    if args.l2_adapter is not None:
        if args.l2_dir is not None:
            raise UserError(f"--l2-adapter and --l2-dir {args.l2_dir}: give one")
        try:
            spec = parse_l2_adapter(args.l2_adapter, env)
        except L2ConfigError as e:
            raise UserError(str(e)) from None
        if isinstance(spec, FsL2Spec):
            return dataclasses.replace(spec, fsync=args.l2_fsync or spec.fsync)
        if int(args.l2_gib * GIB):
            raise ConfigError("an L2 size needs an L2 directory (--l2-dir)")
        return spec
    l2_bytes = int(args.l2_gib * GIB)
    if l2_bytes and not args.l2_dir:
        raise ConfigError("an L2 size needs an L2 directory (--l2-dir)")
    if args.l2_dir and not l2_bytes:
        raise ConfigError(f"L2 directory {args.l2_dir} given without a size: set --l2-gib")
    return FsL2Spec(args.l2_dir, l2_bytes, args.l2_fsync) if args.l2_dir else None


def server_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ServerConfig:
    """The configuration `hybridkv serve` runs with these arguments; UserError / ConfigError name the flag. `env`:
    the variables an L2's secrets are read from (default: this process's)."""
    apply_seed(args)
    # say it in the unit it was given in, not in the bytes it becomes
    if not 0 < args.l1_gib < MAX_GIB:
        raise ConfigError(f"L1 size (--l1-gib) must be above 0 and below {MAX_GIB:.0f} GiB, got {args.l1_gib:g}")
    if not 0 <= args.l2_gib < MAX_GIB:
        raise ConfigError(f"L2 size (--l2-gib) must be 0 or more and below {MAX_GIB:.0f} GiB, got {args.l2_gib:g}")
    l2 = l2_spec(args, os.environ if env is None else env)
    return ServerConfig(endpoint=args.endpoint, l1_bytes=int(args.l1_gib * GIB), l2=l2,
                        parent_pid=os.getppid() if args.exit_with_parent else 0,
                        **{FIELD_OF.get(flag, _dest(flag)): getattr(args, _dest(flag)) for flag in FIELD_FLAGS})


def checked_config(args: argparse.Namespace) -> ServerConfig:
    """Every refusal of the settings themselves, for `serve` and `serve --print-config` alike (what only the machine
    can refuse: the arena's room, the L2 directory, the endpoint's socket, comes when the server starts)."""
    from hybridkv.cli import UserError

    try:
        cfg = server_config(args)
        if args.metrics_port is not None:
            # the metrics module brings prometheus_client and wsgiref: imported only by a server that serves them
            from hybridkv.server.front.metrics_http import MetricsError, check_metrics_address

            try:
                check_metrics_address(args.metrics_host, args.metrics_port)
            except MetricsError as e:
                raise ConfigError(str(e)) from None
        if not args.headline_interval >= 0:
            raise ConfigError(f"--headline-interval must be 0 (never) or more seconds, got {args.headline_interval:g}")
    except ConfigError as e:
        raise UserError(str(e)) from None
    return cfg


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """`hybridkv serve ARGV`'s arguments, as the command parses them with the variables `environ` (default: none,
    not this process's: a harness's server runs the configuration it was given)."""
    p = argparse.ArgumentParser(prog="hybridkv serve", allow_abbrev=False)
    add_arguments(p)
    return parse_command_line(p, argv, {} if environ is None else environ)


def parse(argv: Sequence[str]) -> ServerConfig:
    """The configuration `hybridkv serve ARGV` would run with (its process options, such as logging, aside)."""
    return server_config(parse_args(argv))


def server_argv(config: ServerConfig) -> list[str]:
    """The `hybridkv serve` flags that run `config`: `parse(server_argv(c)) == c`. A nonzero parent_pid becomes
    --exit-with-parent, whose pid is the parent of the process that runs the flags."""
    import dataclasses
    import json

    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    # sizes travel in GiB: one that would come back as another byte count is refused, never changed
    if int(float(repr(config.l1_bytes / GIB)) * GIB) != config.l1_bytes:
        raise ConfigError(f"L1 size {config.l1_bytes} B does not survive --l1-gib exactly; give a round size")
    l2_cap = getattr(config.l2, "capacity_bytes", 0)
    if l2_cap and int(float(repr(l2_cap / GIB)) * GIB) != l2_cap:
        raise ConfigError(f"L2 capacity {l2_cap} B does not survive max_capacity_gb exactly; give a round size")
    # --flag=value: a value that starts with '-' stays the flag's value
    argv = [f"--endpoint={config.endpoint}", f"--l1-gib={config.l1_bytes / GIB!r}"]
    for flag in FIELD_FLAGS:
        field = FIELD_OF.get(flag, _dest(flag))
        value = getattr(config, field)
        if value == defaults[field] and type(value) is type(defaults[field]):
            continue
        if isinstance(defaults[field], bool) != isinstance(value, bool):
            raise ConfigError(f"{field} must be {type(defaults[field]).__name__}, got {value!r}")
        argv += [flag] if isinstance(value, bool) else [f"{flag}={value}"]
    if config.l2 is not None:
        argv.append(f"--l2-adapter={json.dumps(config.l2.to_json())}")
    if config.parent_pid:
        argv.append("--exit-with-parent")
    return argv


def run(args: argparse.Namespace) -> int:
    if args.print_config:
        from hybridkv.settings_sources import describe

        checked_config(args)  # what serve refuses is refused here too, in the same line
        print(describe(args, "hybridkv serve"))
        return 0
    if not args.cuda_ipc:
        # The server holds no VRAM: hide every GPU before anything could initialise CUDA.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from hybridkv.server.front.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    # A fatal signal leaves its cause on stderr (every thread's stack), not a bare exit: the arena's pages are
    # allocated at start, so a SIGBUS means its file was truncated under the server (its uid can), and the
    # server died in the copy that touched a page past the new end.
    faulthandler.enable()
    import zmq

    from hybridkv.cli import UserError
    from hybridkv.memory.arena import ArenaError
    from hybridkv.server.books.telemetry import Telemetry
    from hybridkv.server.front.connections import raise_fd_limit
    from hybridkv.server.front.lifecycle import EndpointInUse
    from hybridkv.server.front.loop import CacheServer
    from hybridkv.server.l2.base import L2Error

    # Until the server exists, SIGTERM must still unwind through the finally below (not kill us mid-start
    # with the arena created); afterwards it asks the loop to stop.
    def terminate(*_: object) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, terminate)
    server: CacheServer | None = None
    metrics: MetricsEndpoint | None = None
    raise_fd_limit()  # libzmq cannot survive EMFILE: take every descriptor the hard limit allows
    try:
        cfg = checked_config(args)  # before an arena is made
        server = CacheServer(cfg, telemetry=Telemetry(args.headline_interval))
        try:
            endpoint = server.bind()
        except zmq.ZMQError as e:
            raise UserError(f"cannot listen on --endpoint {cfg.endpoint}: {e}") from None
        if args.metrics_port is not None:
            from hybridkv.server.front.metrics_http import MetricsEndpoint, MetricsError  # as in checked_config

            try:
                metrics = MetricsEndpoint(server.telemetry, server.workers.wake, args.metrics_host, args.metrics_port)
            except MetricsError as e:
                raise UserError(str(e)) from None
        shown = f" metrics={metrics.url}" if metrics is not None else ""
        running = server
        signal.signal(signal.SIGTERM, lambda *_: running.stop())
        signal.signal(signal.SIGINT, lambda *_: running.stop())
        l2 = cfg.l2.describe() if cfg.l2 is not None else "none"

        def ready() -> None:
            print(f"hybridkv server ready: endpoint={endpoint} l1={args.l1_gib:g}GiB arena={running.arena.path} "
                  f"l2={l2}{shown} pid={os.getpid()}", flush=True)

        server.serve_forever(on_ready=ready)
    except (ConfigError, ArenaError, L2Error, EndpointInUse, OSError) as e:
        raise UserError(str(e)) from None
    finally:
        if metrics is not None:
            metrics.close()
        if server is not None:
            server.close()  # every exit path (an error, SIGTERM at start) removes the arena
    try:
        print("hybridkv server stopped", flush=True)
    except BrokenPipeError:
        # --exit-with-parent: the reader of our stdout is gone, as is the parent; and so that the flush at
        # interpreter exit does not fail on it again, stdout becomes /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
