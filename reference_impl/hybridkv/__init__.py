"""hybridkv: a multi-group, engine-driven KV cache for hybrid LLMs (CPU-only server, engine-side library)."""

__version__ = "0.1.0"
