"""Host memory: the shared-memory L1 arena engines map (`arena`) and how much memory this process may
still take (`memory_room`). Imports nothing else of hybridkv."""
