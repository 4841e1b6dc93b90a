"""Chunk keys: rolling prefix hashes, stable across processes, separated by namespace."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hybridkv.model.keys import KEY_BYTES, chunk_keys, namespace
from hybridkv.model.layout import LayoutError
from hybridkv.model.presets import preset_layout

LAYOUT = preset_layout("qwen3.6-27b", 2)


def test_keys_are_a_rolling_prefix_hash():
    ns = namespace(LAYOUT, 0, 784)
    toks = np.random.default_rng(0).integers(0, 150_000, 5 * 784 + 100)
    keys = chunk_keys(ns, toks, 784)
    assert len(keys) == 5 and all(len(k) == KEY_BYTES for k in keys)  # the partial chunk has no key
    assert chunk_keys(ns, toks[:3 * 784], 784) == keys[:3]               # a prefix shares its keys
    changed = toks.copy()
    changed[2 * 784 + 7] += 1                                            # a change inside chunk 2 ...
    other = chunk_keys(ns, changed, 784)
    assert other[:2] == keys[:2] and all(a != b for a, b in zip(other[2:], keys[2:], strict=True))
    assert chunk_keys(ns, list(map(int, toks)), 784) == keys              # lists and arrays agree


def test_namespace_separates_rank_salt_chunk_and_model():
    base = namespace(LAYOUT, 0, 784)
    others = [namespace(LAYOUT, 1, 784), namespace(LAYOUT, 0, 784, salt="t"), namespace(LAYOUT, 0, 1568),
              namespace(preset_layout("qwen3.5-27b", 2), 0, 784)]
    assert len({base, *others}) == 5
    with pytest.raises(LayoutError, match="tp_rank 2"):
        namespace(LAYOUT, 2, 784)
    with pytest.raises(LayoutError, match="multiple"):
        namespace(LAYOUT, 0, 700)


def test_keys_are_the_same_in_another_process_with_another_hash_seed():
    code = ("import numpy as np; from hybridkv.model.keys import chunk_keys, namespace; "
            "from hybridkv.model.presets import preset_layout; l = preset_layout('qwen3.6-27b', 2); "
            "print(chunk_keys(namespace(l, 1, 784, 's'), np.arange(3 * 784) % 977, 784)[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    here = chunk_keys(namespace(LAYOUT, 1, 784, "s"), np.arange(3 * 784) % 977, 784)[-1].hex()
    assert outs == {here}


def test_bad_tokens_are_refused():
    ns = namespace(LAYOUT, 0, 784)
    with pytest.raises(ValueError, match="one-dimensional"):
        chunk_keys(ns, np.zeros((2, 784), dtype=np.int64), 784)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        chunk_keys(ns, [-1] * 784, 784)
    with pytest.raises(ValueError, match="16 bytes"):
        chunk_keys(b"short", [1] * 784, 784)
