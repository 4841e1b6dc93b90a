"""`hybridkv vllm-replay SCENARIO [--out DIR]`: RAG, chat and system-prompt fan-out traffic through real vLLM
engines, each request's hit and TTFT through hybridkv beside vLLM's own prefix cache, in one run
(`hybridkv_bench.replay`).

Exit status: 0 every hit within the blocks shared and every greedy token equal to the recompute; 1 not; 2 a user
mistake.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hybridkv.cli import UserError

from hybridkv_bench.cli.vllm_ttft import require_vllm, run_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="vllm-replay scenario TOML, e.g. scenarios/vllm_replay/replay_cpu.toml")
    parser.add_argument("--out", default=None, help="run folder (default: results/runs/<name>-<time>)")


def run(args: argparse.Namespace) -> int:
    # the replay asks each engine's worker to flush the connector's stores through LLM.collective_rpc with a
    # function, which vLLM sends to its engine processes only when this is set
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    require_vllm("vllm-replay")
    from hybridkv_bench.replay.rows import failure
    from hybridkv_bench.replay.run import run_replay
    from hybridkv_bench.replay.spec import load_replay_scenario

    try:
        sc = load_replay_scenario(args.scenario)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = run_folder(args.out, sc.name)
    folder, rows = run_replay(sc, out, Path(args.scenario).read_text())
    print((folder / "report.md").read_text())
    print(f"run folder: {folder}")
    return 1 if failure(rows) else 0
