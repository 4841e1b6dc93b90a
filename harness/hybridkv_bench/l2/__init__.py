"""`hybridkv l2bench`: spill to L2 and reload from it, beside the storage's ceiling, and the watches that time it."""
