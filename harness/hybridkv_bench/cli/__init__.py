"""The `hybridkv` subcommands of the harness (`hybridkv_bench.commands` names them): argument parsing and exit
status only; the work is in the subpackages."""
