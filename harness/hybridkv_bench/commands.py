"""The harness's `hybridkv` subcommands, registered through the `hybridkv.commands` entry point.
Kept free of imports: `hybridkv --help` reads this table without loading torch."""

COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("hybridkv_bench.cli.bench", "run a scenario and write a run folder"),
    "report": ("hybridkv_bench.cli.report", "write plots and a Markdown report for a run folder, or compare runs"),
    "gate": ("hybridkv_bench.cli.gate", "compare a run with a baseline; non-zero exit on regression"),
    "calibrate": ("hybridkv_bench.cli.calibrate", "measure this machine's copy ceilings"),
    "list": ("hybridkv_bench.cli.list", "list scenarios and model presets"),
    "l2bench": ("hybridkv_bench.cli.l2bench", "L2 spill and reload (disk or Redis) beside the storage's own ceiling"),
    "vllm-ttft": ("hybridkv_bench.cli.vllm_ttft", "TTFT of a real vLLM engine: cold, via hybridkv, from vLLM's cache"),
    "vllm-replay": ("hybridkv_bench.cli.vllm_replay", "RAG, chat, fan-out through real vLLM: hits beside vLLM's own"),
}
