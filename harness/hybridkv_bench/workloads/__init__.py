"""Workload kinds: what each runs (its requests, their phases and engines) and the hit each request must get."""
