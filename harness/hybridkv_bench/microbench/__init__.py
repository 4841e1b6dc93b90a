"""Microbenchmarks run beside the scenarios: the fixed cost of a store and a load, compute beside offload, the
latency benchmarks' lookup."""
