"""`hybridkv serve`: run the CPU-only cache server in this process until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hybridkv.server.config import default_endpoint

    p.add_argument("--endpoint", default=default_endpoint(),
                   help="where to listen: ipc://PATH (default, in a 0700 directory) or tcp://127.0.0.1:PORT "
                        "(default: %(default)s)")
    p.add_argument("--l1-gib", type=float, default=4.0,
                   help="size of the shared-memory L1 arena in GiB (default: %(default)s)")
    p.add_argument("--l1-dir", default="/dev/shm",
                   help="tmpfs directory for the L1 arena file, mode 0600 (default: %(default)s)")
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
                   help="seconds a reclaimed slot stays unused, in case the vanished writer is still "
                        "copying into it (default: %(default)s)")
    p.add_argument("--io-threads", type=int, default=4,
                   help="worker threads for L2 reads/writes and payload copies (default: %(default)s)")
    p.add_argument("--spill-watermark", type=float, default=0.1,
                   help="with L2: copy least-recently-used objects to L2 ahead of need so this fraction "
                        "of L1 is free or clean (default: %(default)s)")
    p.add_argument("--flush-on-exit", action="store_true",
                   help="with L2: write every L1 object to L2 on shutdown, so a restart finds it")
    p.add_argument("--cuda-ipc", action="store_true",
                   help="also serve the cuda_ipc baseline format: the server maps engines' GPU pages and "
                        "copies itself, so it creates a CUDA context and holds VRAM (for comparison only)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="log level (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if not args.cuda_ipc:
        # The server holds no VRAM: hide every GPU before anything could initialise CUDA.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import zmq

    from hybridkv.arena import ArenaError
    from hybridkv.cli import UserError
    from hybridkv.server.config import ConfigError, ServerConfig
    from hybridkv.server.l2 import L2Error
    from hybridkv.server.loop import CacheServer

    try:
        # say it in the unit it was given in, not in the bytes it becomes
        if not args.l1_gib > 0:
            raise ConfigError(f"L1 size (--l1-gib) must be above 0 GiB, got {args.l1_gib:g}")
        if not args.l2_gib >= 0:
            raise ConfigError(f"L2 size (--l2-gib) must be 0 GiB or more, got {args.l2_gib:g}")
        cfg = ServerConfig(
            endpoint=args.endpoint, l1_bytes=int(args.l1_gib * GIB), l1_dir=args.l1_dir, l2_dir=args.l2_dir,
            l2_bytes=int(args.l2_gib * GIB), l2_fsync=args.l2_fsync, chunk_tokens=args.chunk_tokens,
            eviction=args.eviction, client_timeout_s=args.client_timeout, quarantine_s=args.quarantine,
            io_threads=args.io_threads, spill_watermark=args.spill_watermark, flush_on_exit=args.flush_on_exit,
            cuda_ipc=args.cuda_ipc)
        server = CacheServer(cfg)
        try:
            endpoint = server.bind()
        except zmq.ZMQError as e:
            server.arena.close()  # else the arena file of this failed start stays in /dev/shm
            raise UserError(f"cannot listen on --endpoint {cfg.endpoint}: {e}") from None
    except (ConfigError, ArenaError, L2Error, OSError) as e:
        raise UserError(str(e)) from None
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    l2 = f"{cfg.l2_dir} ({args.l2_gib:g} GiB)" if cfg.has_l2 else "none"

    def ready() -> None:
        print(f"hybridkv server ready: endpoint={endpoint} l1={args.l1_gib:g}GiB arena={server.arena.path} "
              f"l2={l2} pid={os.getpid()}", flush=True)

    server.serve_forever(on_ready=ready)
    print("hybridkv server stopped", flush=True)
    return 0
