"""The `hybridkv` command. `serve` is built in; other packages add subcommands through the
`hybridkv.commands` entry-point group (the harness registers bench, report, gate, calibrate, list),
so this package never imports them. Subcommand modules are imported only when chosen, so that
`hybridkv --help` and `hybridkv serve` never import torch."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help). Each module defines add_arguments(parser) and run(args) -> int, and may define
# parse_command_line(parser, argv) -> args.
BUILTIN: dict[str, tuple[str, str]] = {
    "serve": ("hybridkv.server.front.cli", "run the CPU-only cache server"),
    "status": ("hybridkv.status", "sum up a running cache server: tiers, hit rate, traffic, engines, limits, errors"),
}
ENTRY_POINT_GROUP = "hybridkv.commands"


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2, no traceback."""


def version() -> str:
    """The installed distribution's version; the package's own where it runs from a checkout without one."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    from hybridkv import __version__

    try:
        return dist_version("hybridkv")
    except PackageNotFoundError:
        return __version__


def subcommands() -> dict[str, tuple[str, str]]:
    """Built-in subcommands plus those registered by installed packages (each entry point names a
    light module attribute: a dict name -> (module, help), imported without torch)."""
    from importlib.metadata import entry_points

    table = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            extra = ep.load()
        except ImportError:
            continue  # a registered package that is not importable here offers no commands
        for name, spec in extra.items():
            table.setdefault(name, spec)
    return table


def not_installed(command: str, e: ModuleNotFoundError) -> int:
    """A command whose packages are not installed: one line saying which extra brings them, exit status 2.
    `pip install hybridkv` is the server alone; the harness's commands need `[bench]`."""
    top = (e.name or "").split(".")[0]
    if not top or top in ("hybridkv", "hybridkv_bench", "hybridkv_kernels"):
        raise e  # our own package broken: a bug, with its traceback
    print(f"hybridkv {command}: error: needs the Python package {top!r}, not installed here (`pip install hybridkv` "
          "is the cache server alone): pip install 'hybridkv[bench]'", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A built-in command wins over a registered one of its name (subcommands' setdefault), so it runs without
    # reading the installed distributions' entry points and version, which every `hybridkv serve` paid at start.
    table = dict(BUILTIN) if argv and argv[0] in BUILTIN else subcommands()
    if not argv or argv[0] in ("-h", "--help", "--version") or argv[0] not in table:
        # allow_abbrev=False everywhere: a prefix of a flag is an error, never another flag (`--l1-size 4` would
        # otherwise be taken as the seed's --l1-size-gb)
        parser = argparse.ArgumentParser(prog="hybridkv", allow_abbrev=False, description="KV-cache offload for "
                                         "hybrid LLMs: a CPU-only cache server, and the harness that measures it.")
        parser.add_argument("--version", action="version", version=f"hybridkv {version()}")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_) in table.items():
            sub.add_parser(name, help=help_, add_help=False, allow_abbrev=False)
        parser.parse_args(argv)  # prints help or a usage error
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = argv[0]
    try:
        module = importlib.import_module(table[name][0])
    except ModuleNotFoundError as e:
        return not_installed(name, e)
    sp = argparse.ArgumentParser(prog=f"hybridkv {name}", description=table[name][1], allow_abbrev=False)
    module.add_arguments(sp)
    # a command that reads settings beyond its flags (a file, HYBRIDKV_ variables) parses them itself
    parse = getattr(module, "parse_command_line", None)
    try:
        args = parse(sp, argv[1:]) if parse is not None else sp.parse_args(argv[1:])
        return int(module.run(args) or 0)
    except UserError as e:
        print(f"hybridkv {name}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        return not_installed(name, e)
    except BrokenPipeError:
        # the reader of our output left (`hybridkv status | head`): done; the flush at exit writes to /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"hybridkv {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: its UserError is the class subcommands raise.
    from hybridkv.cli import main as _main

    sys.exit(_main())
