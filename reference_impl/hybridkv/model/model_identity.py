"""A model's identity in chunk namespaces: what its KV depends on, not the path it was loaded from.

The identity is `<architecture>@<digest>`, the digest a BLAKE2b-128 over canonical JSON of
- the model's `config.json`, without the keys that only say where or by which library version it was saved;
- a sample of its weights: every safetensors tensor's name, dtype, shape and up to 4 KiB from its middle (a
  fine-tune with the same config differs there, and a few MiB are read, not the whole checkpoint);
- what the engine adds (activation and cache dtypes, config overrides), given by the caller.
So the same checkpoint served from two paths shares chunks, and two configs or two checkpoints at one path do
not. Without safetensors weights the path stands in for them: nothing is shared that might differ.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from hybridkv.model.layout import LayoutError

# config.json keys that say where or by what the file was saved, never what the model computes
BOOKKEEPING_KEYS = frozenset({"_name_or_path", "name_or_path", "_commit_hash", "transformers_version"})
SAMPLE_BYTES = 4096
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def canonical_json(value: Any) -> bytes:
    """One byte string per JSON value: sorted keys, no whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The config without its bookkeeping keys (at any depth: a VL model nests its text config)."""
    return {k: config_fields(v) if isinstance(v, dict) else v for k, v in config.items() if k not in BOOKKEEPING_KEYS}


def weights_digest(model_dir: Path) -> str | None:
    """A digest of a sample of every safetensors file's tensors; None when the folder holds none."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        with f.open("rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if not 0 < header_len <= MAX_HEADER_BYTES:
                raise LayoutError(f"{f}: not a safetensors file (header length {header_len})")
            header = json.loads(fh.read(header_len))
            base = 8 + header_len
            for name in sorted(k for k in header if k != "__metadata__"):
                t = header[name]
                start, end = t["data_offsets"]
                at = start + max(0, (end - start - SAMPLE_BYTES) // 2)
                fh.seek(base + at)
                h.update(canonical_json([name, t["dtype"], t["shape"]]) + fh.read(min(SAMPLE_BYTES, end - start)))
    return h.hexdigest()


def model_identity(model_dir: str | Path, engine_fields: dict[str, Any] | None = None,
                   fallback_path: str = "") -> str:
    """`<architecture>@<digest>` of the model in `model_dir` (its config.json and safetensors weights) and the
    engine's `engine_fields`. Without safetensors weights, `fallback_path` (default: the folder) enters instead."""
    d = Path(model_dir)
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise LayoutError(f"no readable config.json in model folder {str(d)!r}: {e}") from None
    if not isinstance(config, dict):
        raise LayoutError(f"{d / 'config.json'} is not a JSON object")
    weights = weights_digest(d)
    arch = (config.get("architectures") or [config.get("model_type") or "model"])[0]
    fields = {"config": config_fields(config), "engine": engine_fields or {},
              "weights": weights if weights is not None else {"path": fallback_path or str(d.resolve())}}
    return f"{arch}@{hashlib.blake2b(canonical_json(fields), digest_size=16).hexdigest()}"
