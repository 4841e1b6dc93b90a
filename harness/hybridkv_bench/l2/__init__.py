"""`hybridkv l2bench`: spill to L2 and reload from it, beside the storage's ceiling (the workload file: `spec`; the L2
and its ceilings: `target`; the run: `workload`), and the watches that time it (`watch`)."""
