"""hybridkv_bench: scenarios, probes, run folders, reports and CI gates for the hybridkv cache.

Modules are imported by what needs them; none imports torch at module top, so `hybridkv report`,
`gate` and `list` stay light on machines without a GPU stack.
"""
