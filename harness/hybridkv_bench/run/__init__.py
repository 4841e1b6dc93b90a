"""`hybridkv bench`'s runner: every (matrix case, workload) against a fresh cache server, the server watchdog,
the progress lines and the probes sampled beside the workload."""
